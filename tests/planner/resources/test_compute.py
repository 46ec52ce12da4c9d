"""Compute model: FLOPs by hand, the skinny-GEMM roofline, measured tables."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.parallel import ParallelConfig
from planner.resources import compute
from planner.resources.compute import (
    KERNEL_LAUNCH_S,
    M_HALF_ROWS,
    causal_context,
    layer_work,
    model_flops_per_sequence,
)
from planner.resources.params import count_params
from planner.specs import AttentionSpec, EfficiencyTable, TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model


def test_layer_flops_by_hand():
    d, H, E, k, f, b, s = 64, 4, 8, 2, 96, 2, 32
    model = make_model(d=d, heads=H, experts=E, top_k=k, ffn=f)
    par = ParallelConfig(pp=1, dp=2, ep=2, micro_batch=b)
    work = {w.name: w for w in layer_work(model, model.layers[0], make_cluster(),
                                          TrainingSpec(seq_len=s), par)}  # fmt: skip
    T = b * s
    assert work["attn_proj"].flops == 3 * 2 * T * 4 * d * d
    assert work["attn_core"].flops == pytest.approx(3 * 2 * b * H * s * (s + 1) / 2 * 2 * (d // H))
    assert work["router"].flops == 3 * 2 * T * d * E
    assert work["experts"].flops == 3 * 2 * T * k * 3 * d * f
    assert work["elementwise"].flops == 0


def test_model_flops_match_six_n_plus_attention():
    model = make_model(layers=4, d=64, heads=4, experts=8, top_k=2, ffn=96, vocab=512)
    s = 16
    tr = TrainingSpec(seq_len=s)
    counts = count_params(model)
    core = 4 * 3 * 2 * 4 * s * (s + 1) / 2 * 2 * 16
    # 6 x (active parameters that multiply activations): the embedding is a gather and the
    # final norm an elementwise op, neither a GEMM.
    gemm_params = counts.active - counts.embedding - model.hidden_size
    assert model_flops_per_sequence(model, make_cluster(), tr) == pytest.approx(
        6 * s * gemm_params + core, rel=1e-12
    )


def test_skinny_expert_gemms_are_slower_per_token():
    model = make_model(d=256, experts=64, top_k=2, ffn=512)
    cl, tr = make_cluster(), TrainingSpec(seq_len=64)

    def per_token(b: int) -> float:
        par = ParallelConfig(pp=1, dp=8, ep=8, micro_batch=b)
        work = {w.name: w for w in layer_work(model, model.layers[0], cl, tr, par)}
        return work["experts"].time_s / (b * 64)

    times = [per_token(b) for b in (1, 4, 16, 64)]
    assert times == sorted(times, reverse=True) and times[0] > 2 * times[-1]


def test_roofline_formula_by_hand():
    cl, tr = make_cluster(), TrainingSpec()
    rows, flops, nbytes = 256.0, 1e12, 1e6
    eff = 0.5 * rows / (rows + M_HALF_ROWS)
    want = flops / (100e12 * eff) + 6 * KERNEL_LAUNCH_S
    assert compute.gemm_time(cl, tr, rows, flops, nbytes, 6)[0] == pytest.approx(want)
    # memory-bound: 1 row, many bytes -> bytes / HBM (1000 GB/s)
    t = compute.gemm_time(cl, tr, 1.0, 1e6, 1e9, 0)[0]
    assert t == pytest.approx(1e9 / 1e12)


def test_measured_tables_replace_the_analytic_efficiency():
    tables = (
        EfficiencyTable("gemm_bf16", (1.0, 1e6), (40.0, 40.0)),
        EfficiencyTable("attention_bf16", (16.0, 65536.0), (20.0, 20.0)),
    )
    model = make_model()
    par = ParallelConfig(pp=1, dp=2, ep=2, micro_batch=2)
    tr = TrainingSpec(seq_len=32)
    work = {w.name: w for w in layer_work(model, model.layers[0], make_cluster(tables=tables),
                                          tr, par)}  # fmt: skip
    for name in ("attn_proj", "router", "experts"):
        assert work[name].time_s == pytest.approx(work[name].flops / 40e12)
        assert work[name].tables == ("gemm_bf16",)
    assert work["attn_core"].time_s == pytest.approx(work["attn_core"].flops / 20e12)
    assert work["attn_core"].tables == ("attention_bf16",)


def test_causal_context_with_and_without_window():
    att = AttentionSpec("gqa", 4, 2, 16)
    assert causal_context(TrainingSpec(seq_len=9), att) == 5
    # window 3 over 6 tokens: queries see 1, 2, 3, 3, 3, 3 keys -> 15 / 6
    assert causal_context(TrainingSpec(seq_len=6), replace(att, sliding_window=3)) == 2.5


def test_grouped_expert_table_is_preferred_for_routed_experts():
    tables = (
        EfficiencyTable("gemm_bf16", (1.0, 1e6), (40.0, 40.0)),
        EfficiencyTable("gemm_grouped_bf16", (1.0, 1e6), (10.0, 10.0)),
    )
    model = make_model()
    par = ParallelConfig(pp=1, dp=2, ep=2, micro_batch=2)
    work = {w.name: w for w in layer_work(model, model.layers[0], make_cluster(tables=tables),
                                          TrainingSpec(seq_len=32), par)}  # fmt: skip
    assert work["experts"].time_s == pytest.approx(work["experts"].flops / 10e12)
    assert work["experts"].tables == ("gemm_grouped_bf16",)
    assert work["attn_proj"].tables == ("gemm_bf16",)
