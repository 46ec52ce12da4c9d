"""Tensor parallelism conserves FLOPs: the tp ranks of a group together do the work of tp = 1.

Under sequence parallelism every tp rank runs the column-/row-parallel GEMMs on all b s / cp
tokens of its group with 1/tp of the weights (Megatron-Core tensor_parallel/layers.py:
ColumnParallelLinear gathers the sequence, RowParallelLinear reduce-scatters it), the
attention core on H / tp heads, the router and the routed experts on its own b s / (tp cp)
tokens, and the head on its vocabulary slice. So each kind of work, summed over the tp ranks,
equals the tp = 1 figure: the oracle here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.parallel import ParallelConfig
from planner.resources.compute import head_work, layer_work
from planner.specs import MoESpec, TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model


def _model():
    model = make_model(d=256, heads=8, experts=8, top_k=2, ffn=128, vocab=1024, first_dense=1,
                       dense_ffn=512)  # fmt: skip
    shared = MoESpec(num_experts=8, top_k=2, expert_ffn=128, num_shared_experts=1,
                     shared_ffn=384)  # fmt: skip
    layers = list(model.layers)
    layers[-1] = replace(layers[-1], moe=shared)
    return replace(model, layers=tuple(layers), num_mtp_layers=1)


def _flops(work) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in work:
        out[w.name] = out.get(w.name, 0.0) + w.flops
    return out


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("cp", [1, 2])
def test_tp_ranks_together_do_the_work_of_one(tp: int, cp: int):
    model, cluster = _model(), make_cluster()
    training = TrainingSpec(seq_len=64)
    one = ParallelConfig(pp=1, dp=tp, cp=cp, ep=2, micro_batch=2)
    split = ParallelConfig(pp=1, dp=1, tp=tp, cp=cp, ep=2, micro_batch=2)
    for layer in model.layers:
        ref = _flops(layer_work(model, layer, cluster, training, one))
        got = _flops(layer_work(model, layer, cluster, training, split))
        assert set(got) == set(ref)
        for name, flops in ref.items():
            assert got[name] * tp == pytest.approx(flops, rel=1e-12), (layer.kind, name)
    ref = _flops(head_work(model, cluster, training, one))
    got = _flops(head_work(model, cluster, training, split))
    for name, flops in ref.items():
        assert got[name] * tp == pytest.approx(flops, rel=1e-12), name


def test_tp_projection_flops_by_hand():
    """attn_proj at tp 4: 3 x 2 x (b s) x (4 d^2 / 4) per rank, not divided by tp twice."""
    d, b, s, tp = 256, 2, 64, 4
    model = make_model(d=d, heads=8, experts=8, top_k=2, ffn=128)
    par = ParallelConfig(pp=1, dp=1, tp=tp, ep=4, micro_batch=b)
    work = {w.name: w for w in layer_work(model, model.layers[0], make_cluster(),
                                          TrainingSpec(seq_len=s), par)}  # fmt: skip
    assert work["attn_proj"].flops == 3 * 2 * (b * s) * (4 * d * d / tp)
    assert work["router"].flops == 3 * 2 * (b * s / tp) * d * 8
