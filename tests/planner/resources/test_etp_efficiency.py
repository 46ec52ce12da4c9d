"""Expert tensor parallelism earns the grouped expert GEMM no rows efficiency: its efficiency is
taken at the rows of the unsplit expert (M / etp), whose output tiles M x f / etp are the same;
and the split shortens the reduction of the down projection (f / etp), which costs."""

from __future__ import annotations

import pytest

from planner.parallel import ParallelConfig
from planner.resources.compute import KERNEL_LAUNCH_S
from planner.resources.layer_cost import layer_cost
from planner.specs import TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model

D, E, K, F = 64, 8, 2, 96


def _experts_s(par: ParallelConfig) -> float:
    model = make_model(layers=2, d=D, heads=4, experts=E, top_k=K, ffn=F)
    c = layer_cost(model, 0, make_cluster(), TrainingSpec(seq_len=32), par)
    return next(w for w in c.work if w.name == "experts").time_s


def _by_hand(etp: int, rows: float) -> float:
    """The hand cluster's roofline (100 TFLOPS x 0.5 x rows / (rows + 128), 1 TB/s HBM, bf16)
    for the experts of one rank: ep 2, T = 32 tokens, each routed to K experts, gathered over
    etp, E / ep = 4 local experts of width F / etp, 3 matrices (SwiGLU)."""
    f, copies = F / etp, 32 * K * etp
    flops = 3 * 2 * copies * 3 * D * f
    # reduction lengths (bf16 half 365): up [D -> 2f] reduces over D forward and 2f in its
    # data gradient, down [f -> D] over f and D; the weight gradients take the rows factor
    h = 365.0
    up, down = D * 2 * f, f * D
    k_factor = 3 * (up + down) / (
        up * (1 + (D + h) / D + (2 * f + h) / (2 * f)) + down * (1 + (f + h) / f + (D + h) / D)
    )
    compute = flops / (100e12 * 0.5 * rows / (rows + 128) * k_factor)
    weights, io = 4 * 3 * D * f, copies * (2 * D + 3 * f)
    memory = 2 * 3 * (weights + io) / 1e12
    return max(compute, memory) + 9 * KERNEL_LAUNCH_S


def test_etp_experts_priced_at_the_unsplit_rows():
    rows = 2 * 32 * K / E  # ep T k / E tokens per expert before the etp gather
    t1 = _experts_s(ParallelConfig(pp=1, dp=4, ep=2, etp=1))
    t2 = _experts_s(ParallelConfig(pp=1, dp=4, ep=2, etp=2))
    assert t1 == pytest.approx(_by_hand(1, rows))
    assert t2 == pytest.approx(_by_hand(2, rows))
    assert t2 != pytest.approx(_by_hand(2, 2 * rows))  # not the gathered etp x M rows
    # same FLOPs per rank, shorter reductions: the split is slower per FLOP
    assert t2 > t1
