"""The reduction-length factor of a GEMM group: K / (K + K_half) per forward and data-gradient
GEMM, the weight gradient at 1, FLOP-weighted harmonic mean; computed here by hand."""

from __future__ import annotations

import pytest

from planner.parallel import ParallelConfig
from planner.resources.compute import K_HALF, K_HALF_DEFAULT, layer_work, reduction_factor
from planner.specs import TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model


def test_one_matrix_by_hand():
    h = K_HALF_DEFAULT
    k_in, k_out = 1024.0, 256.0
    slow = 1 + (k_in + h) / k_in + (k_out + h) / k_out
    assert reduction_factor(((k_in, k_out),), "bf16") == pytest.approx(3 / slow)
    assert reduction_factor(((k_in, k_out),), "fp8") == pytest.approx(
        3 / (1 + (k_in + K_HALF["fp8"]) / k_in + (k_out + K_HALF["fp8"]) / k_out)
    )
    assert reduction_factor((), "bf16") == 1.0


def test_flop_weighted_over_matrices():
    h = K_HALF_DEFAULT
    a, b = (512.0, 2048.0), (2048.0, 512.0)
    wa, wb = a[0] * a[1], b[0] * b[1]
    slow = lambda m: 1 + (m[0] + h) / m[0] + (m[1] + h) / m[1]  # noqa: E731
    want = 3 * (wa + wb) / (wa * slow(a) + wb * slow(b))
    assert reduction_factor((a, b), "bf16") == pytest.approx(want)


def test_long_reductions_approach_one_and_tp_lowers_it():
    assert reduction_factor(((1e9, 1e9),), "bf16") == pytest.approx(1.0, abs=1e-6)
    d = 4096
    tp1 = reduction_factor(((d, 3 * d), (d, d)), "bf16")
    tp8 = reduction_factor(((d, 3 * d / 8), (d / 8, d)), "bf16")
    assert 0.95 < tp1 < 0.96 and 0.86 < tp8 < 0.88


def test_tp_raises_attention_projection_time_per_flop():
    """Same FLOPs over the tp group, shorter reductions: tp 4's projections take longer in sum
    than tp 1's (the analytic path, compute-bound shapes)."""
    model = make_model(d=2048, heads=16, experts=8, top_k=2, ffn=1024)
    tr = TrainingSpec(seq_len=2048)

    def proj(tp: int):
        par = ParallelConfig(pp=1, dp=1, tp=tp, ep=1, micro_batch=2)
        return next(w for w in layer_work(model, model.layers[0], make_cluster(), tr, par)
                    if w.name == "attn_proj")  # fmt: skip

    one, four = proj(1), proj(4)
    assert four.flops * 4 == pytest.approx(one.flops)
    assert four.time_s * 4 > one.time_s * 1.03
