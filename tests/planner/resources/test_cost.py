"""Step time, MFU and the stage IP's inputs: a fully hand-computed model, and the identities
that tie estimate() to StageCostInputs."""

from __future__ import annotations

import pytest

from planner.parallel import ParallelConfig
from planner.resources.cost import estimate, even_split, stage_cost_inputs
from planner.specs import GIB, EfficiencyTable, SpecError, TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model

TABLES = (
    EfficiencyTable("gemm_bf16", (1.0, 1e9), (40.0, 40.0)),
    EfficiencyTable("attention_bf16", (1.0, 1e9), (20.0, 20.0)),
)


def test_tiny_model_every_component_by_hand():
    d, H, E, k, f, V, b, s, m = 64, 4, 8, 2, 96, 256, 2, 32, 4
    model = make_model(layers=1, d=d, heads=H, experts=E, top_k=k, ffn=f, vocab=V)
    cl = make_cluster(tables=TABLES)  # HBM 1000 GB/s, peak 100 TFLOPS
    par = ParallelConfig(pp=1, dp=1, ep=1, micro_batch=b, num_microbatches=m)
    est = estimate(model, cl, TrainingSpec(seq_len=s), par)
    T, hbm = b * s, 1e12
    saved = 2 * 2 * T * d + 2 * T * 3 * d + 2 * T * d  # attention: norm in/out, qkv, context
    saved += 2 * 2 * T * d + T * (4 * E + 12 * k)  # mlp norm, router probs + top-k
    saved += 2 * T * k * d + 2 * T * k * 3 * f + 2 * T * k * d  # dispatch, experts, combine
    # memory-bound kernels, forward bytes (bf16): two norms (read d, write d), two residual
    # adds (read 2d, write d), rope on q and k (d each), router softmax / top-k (3 x fp32 E),
    # permute and unpermute (d + k d each), SwiGLU (read 2f, write f per routed copy)
    kernels = T * (2 * 2 * d + 2 * 3 * d + 2 * 2 * d) * 2 + T * 12 * E
    kernels += 2 * T * (1 + k) * d * 2 + T * k * 3 * f * 2
    want = {
        "attn_proj": 3 * 2 * T * 4 * d * d / 40e12,
        "attn_core": 3 * 2 * b * H * s * (s + 1) / 2 * 2 * (d // H) / 20e12,
        "router": 3 * 2 * T * d * E / 40e12,
        "experts": 3 * 2 * T * k * 3 * d * f / 40e12,
        "head": 3 * 2 * T * d * V / 40e12,
        "elementwise": 3 * kernels / hbm + 4 * 4 * T * V / hbm,  # backward reads/writes 2x
    }
    got = dict(est.stages[0].time_s)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name] == pytest.approx(t, rel=1e-12), name
    params = (4 * d * d + d * E) + 3 * d * f * E + V * d + (V * d + d)
    assert est.stages[0].total_gib == pytest.approx(
        (16 * params + 8 * T + (4 * b * H * s + saved) + 2 * 2 * T * d + 4 * T * V) / GIB + 2.0
    )
    optimizer_s = 2 * 16 * params / hbm
    slot = sum(want.values())
    assert est.optimizer_s == pytest.approx(optimizer_s)
    assert est.step_time_s == pytest.approx(m * slot + optimizer_s)
    # Model FLOPs (MFU numerator) in Megatron-Core's convention, not the time model's: no
    # router GEMM, and the causal square counted as s^2 / 2 rather than s (s + 1) / 2 pairs.
    flops = 3 * 2 * s * (4 * d * d + k * 3 * d * f + d * V)
    flops += 3 * 2 * H * s * s / 2 * 2 * (d // H)
    assert est.model_flops_per_step == pytest.approx(flops * b * m)
    assert est.mfu == pytest.approx(flops * b * m / (est.step_time_s * 100e12))
    assert est.tokens_per_s == pytest.approx(b * m * s / est.step_time_s)
    assert est.used_measured_tables == ("attention_bf16", "gemm_bf16")
    assert est.comm_s == () and est.bubble_fraction == 0


def test_pipeline_step_time_identities():
    model = make_model(layers=8, first_dense=2)
    par = ParallelConfig(pp=4, dp=4, ep=4, micro_batch=2, num_microbatches=6)
    est = estimate(model, make_cluster(), TrainingSpec(seq_len=64), par)
    assert est.bubble_fraction == pytest.approx(3 / 9)
    p2p = dict(est.comm_s)["p2p_system"] / 6  # per micro-batch, forward + backward
    assert est.slot_s == pytest.approx(max(st.total_s for st in est.stages) + p2p)
    assert est.step_time_s == pytest.approx(9 * est.slot_s + est.dp_exposed_s + est.optimizer_s)
    assert est.tflops_per_gpu == pytest.approx(
        est.model_flops_per_step / (est.step_time_s * 16) / 1e12
    )
    assert {"a2a_node", "dp_node"} <= set(dict(est.comm_s))


def test_stage_cost_inputs_agree_with_estimate():
    model = make_model(layers=6, first_dense=1, vocab=1024)
    cl, tr = make_cluster(), TrainingSpec(seq_len=64)
    par = ParallelConfig(pp=3, dp=2, ep=2, micro_batch=2, num_microbatches=4)
    inputs = stage_cost_inputs(model, cl, tr, par)
    split = [(0,), (1, 2, 3), (4, 5)]
    est = estimate(model, cl, tr, par, stage_layers=split)
    assert not inputs.recompute_allowed
    assert inputs.usable_memory_bytes == pytest.approx((80.0 - 2.0) * GIB)
    for i, layers in enumerate(split):
        units = [inputs.units[j] for j in layers]
        mem = sum(u.state_bytes for u in units) + inputs.in_flight(i) * sum(
            u.act_bytes for u in units
        )
        time = sum(u.time_s for u in units)
        for extra, on in ((inputs.first, i == 0), (inputs.last, i == 2)):
            if on:
                mem += extra.state_bytes + inputs.in_flight(i) * extra.act_bytes
                time += extra.time_s
        assert est.stages[i].total_gib == pytest.approx(mem / GIB + 2.0)
        assert est.stages[i].total_s == pytest.approx(time)


def test_recompute_costs_time_and_saves_memory():
    model = make_model(layers=4)
    cl, tr = make_cluster(), TrainingSpec(seq_len=64, flash_attention=False)
    par = ParallelConfig(pp=2, dp=2, ep=2, micro_batch=2, num_microbatches=4, recompute="full")
    inputs = stage_cost_inputs(model, cl, tr, par)
    u = inputs.units[0]
    assert inputs.recompute_allowed
    assert u.act_recompute_bytes == 2 * 2 * 64 * 64 and u.act_recompute_bytes < u.act_bytes
    assert u.time_recompute_s > u.time_s
    full = estimate(model, cl, tr, par)
    none = estimate(model, cl, tr, par, recompute_layers=((), ()))
    assert full.stages[0].total_gib < none.stages[0].total_gib
    assert full.stages[0].total_s > none.stages[0].total_s
    assert full.stages[0].recompute_layers == (0, 1)


def test_even_split_and_split_errors():
    assert even_split(10, 4) == ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9))
    model = make_model(layers=4)
    par = ParallelConfig(pp=2, dp=2, ep=2)
    with pytest.raises(SpecError, match="contiguous"):
        estimate(model, make_cluster(), TrainingSpec(seq_len=8), par, stage_layers=[(0, 2), (1, 3)])


@pytest.mark.parametrize(
    "par,match",
    [
        (ParallelConfig(pp=1, dp=6, ep=3), "must divide the 8 experts"),
        (ParallelConfig(pp=5, dp=1), "exceeds the 4 layers"),
        (ParallelConfig(pp=2, dp=16), "cluster hand-cluster has 16"),
        (ParallelConfig(pp=1, dp=1, tp=3), "3 must divide the 4 attention heads"),
    ],
)
def test_invalid_layouts_are_one_line_errors(par, match):
    with pytest.raises(SpecError, match=match) as err:
        estimate(make_model(layers=4), make_cluster(), TrainingSpec(seq_len=8), par)
    assert "\n" not in str(err.value)


def test_does_not_fit_names_the_stage():
    cl = make_cluster(memory_gib=2.1)
    par = ParallelConfig(pp=2, dp=2, ep=2, micro_batch=8, num_microbatches=4)
    est = estimate(make_model(layers=4, vocab=8192), cl, TrainingSpec(seq_len=1024), par)
    assert not est.fits
    worst = max(est.stages, key=lambda st: st.total_gib)
    assert est.reason.startswith(f"stage {worst.stage} needs {worst.total_gib:.1f} GiB > 2.1 GiB")


def test_halo_dispatcher_beats_flat_across_nodes_with_small_messages():
    model = make_model(layers=2, d=64, experts=16)
    par = ParallelConfig(pp=1, dp=16, ep=16, micro_batch=1, num_microbatches=2)
    cl, tr = make_cluster(), TrainingSpec(seq_len=16)
    flat = estimate(model, cl, tr, par, dispatcher="flat")
    halo = estimate(model, cl, tr, par, dispatcher="halo")
    assert dict(halo.comm_s)["a2a_system"] < dict(flat.comm_s)["a2a_system"]
    assert halo.step_time_s < flat.step_time_s
