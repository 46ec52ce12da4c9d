"""The named efficiencies of the cluster profile (planner.specs.EFFICIENCIES), each against a
hand count: what it scales, and that the defaults leave the derived model unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from planner.parallel import ParallelConfig
from planner.resources import comm, overlap
from planner.resources.compute import M_HALF_ROWS, gemm_time, layer_work
from planner.resources.deepep import deepep_buffer_bytes
from planner.resources.layer_comm import COMM_SMS, fsdp_gather_s, sm_contention_s
from planner.resources.layer_cost import layer_cost
from planner.resources.memory import layer_activations
from planner.specs import EFFICIENCIES, PARTIAL_GRAPH_SHARE, ClusterSpec, SpecError, TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model


def test_every_efficiency_is_a_cluster_field_inside_its_bounds():
    fields = {f.name: f for f in dataclasses.fields(ClusterSpec)}
    for e in EFFICIENCIES:
        assert e.name in fields, e.name
        assert e.low < e.high and e.meaning
        default = fields[e.name].default
        assert e.low <= default <= e.high or e.name == "layer_overhead_us", e.name
    assert len(EFFICIENCIES) <= 8  # the cap per hardware and software stack


def test_grouped_gemm_half_rows_only_moves_the_grouped_gemms():
    cl, tr = make_cluster(), TrainingSpec()
    rows, flops = 256.0, 1e12
    slow = dataclasses.replace(cl, grouped_gemm_half_rows=768.0)
    dense = gemm_time(slow, tr, rows, flops, 0.0, 0)[0]
    assert dense == pytest.approx(flops / (100e12 * 0.5 * rows / (rows + M_HALF_ROWS)))
    grouped = gemm_time(slow, tr, rows, flops, 0.0, 0, grouped=True)[0]
    assert grouped == pytest.approx(flops / (100e12 * 0.5 * rows / (rows + 768.0)))


def test_hbm_efficiency_scales_memory_bound_time():
    model, cl = make_model(layers=1), make_cluster()
    par, tr = ParallelConfig(pp=1, dp=2, ep=2), TrainingSpec(seq_len=32)
    base = {w.name: w.time_s for w in layer_work(model, model.layers[0], cl, tr, par)}
    half = dataclasses.replace(cl, hbm_efficiency=0.5)
    slow = {w.name: w.time_s for w in layer_work(model, model.layers[0], half, tr, par)}
    assert slow["elementwise"] == pytest.approx(2 * base["elementwise"])
    assert slow["attn_core"] == pytest.approx(base["attn_core"])


def test_layer_overhead_is_host_work_that_cuda_graphs_remove():
    model, par = make_model(layers=1), ParallelConfig(pp=1, dp=2, ep=2)
    cl = dataclasses.replace(make_cluster(), layer_overhead_us=800.0)
    for graphs, share in (("none", 1.0), ("partial", PARTIAL_GRAPH_SHARE), ("full", 0.0)):
        tr = TrainingSpec(seq_len=32, cuda_graphs=graphs)
        host = [w for w in layer_work(model, model.layers[0], cl, tr, par) if w.name == "host"]
        assert sum(w.time_s for w in host) == pytest.approx(share * 800e-6)
    # the profile's default: cuda_graphs true means the whole iteration is captured
    graphed = dataclasses.replace(cl, cuda_graphs=True)
    works = layer_work(model, model.layers[0], graphed, TrainingSpec(seq_len=32), par)
    assert not [w for w in works if w.name == "host"]
    with pytest.raises(SpecError, match="cuda_graphs"):
        TrainingSpec(cuda_graphs="sometimes")


def test_scale_up_and_scale_out_efficiency_split_by_level():
    cl = make_cluster()  # node 100 GB/s (no kind, 4 devices); system over NICs (16 devices)
    tuned = dataclasses.replace(cl, scale_up_efficiency=0.5, scale_out_efficiency=0.25)
    node, system = cl.levels
    assert tuned.link_bytes_per_s(node) == pytest.approx(50e9)
    assert tuned.link_bytes_per_s(system) == pytest.approx(system.bw_gbps * 1e9 * 0.25)
    t, _ = comm.ring_allreduce_s(tuned, 4, 1, 1e8)
    assert t == pytest.approx(2 * 3 / 4 * 1e8 / 50e9 + 6 * 1e-6)


def test_overlap_efficiency_exposes_the_unhidden_share():
    assert overlap.imperfect_s(1.0, 5.0, 1.0) == 1.0
    assert overlap.imperfect_s(1.0, 5.0, 0.25) == pytest.approx(1.0 + 0.75 * 4.0)
    assert overlap.imperfect_s(1.0, 5.0, 0.0) == pytest.approx(5.0)


def test_sm_contention_by_hand():
    cl = make_cluster()
    assert sm_contention_s(cl, "deepep", 1e-3) == 0.0  # no SM count in the profile
    h = dataclasses.replace(cl, device=dataclasses.replace(cl.device, sms=132))
    sigma = COMM_SMS["deepep"] / 132
    assert sm_contention_s(h, "deepep", 1e-3) == pytest.approx(1e-3 * sigma / (1 - sigma))


def test_fsdp_backward_gather_also_hides_behind_the_recompute():
    model = make_model(layers=2)
    cl = dataclasses.replace(make_cluster(), scale_up_efficiency=0.003)  # slow links: exposed
    par = ParallelConfig(pp=1, dp=4, ep=4, num_microbatches=2)
    tr = TrainingSpec(seq_len=32, fsdp=True, recompute="full")
    c = layer_cost(model, 0, cl, tr, par)
    gather, reduce, level = fsdp_gather_s(cl, tr, par, (c.params_dense, c.params_expert))
    fwd = sum(w.forward_s for w in c.work)
    bwd = sum(w.time_s for w in c.work) - fwd
    plain = max(0.0, gather - fwd) + max(0.0, gather + reduce - bwd)
    assert dict(c.comm_s)[f"fsdp_{level}"] == pytest.approx(plain)  # not recomputed
    # recomputed: the backward's window grows by the recompute R, so the exposed part
    # shrinks; the layer's time grows by max(R, exposed) - exposed, never less than 0
    kept = layer_cost(model, 0, cl, dataclasses.replace(tr, fsdp=False), par)
    recompute = kept.recompute_extra_s
    hidden = max(0.0, gather - fwd) + max(0.0, gather + reduce - bwd - recompute)
    assert c.recompute_extra_s == pytest.approx(recompute + hidden - plain)
    assert 0 <= c.recompute_extra_s < recompute


def test_deepep_buffers_by_hand():
    # DeepEP's legacy Config sizing: 12 channels x peers x slots x (hidden + 2,048 B metadata)
    slot = 7168 * 2 + 128 * 8 + 128 * 4 + 128 * 4
    assert deepep_buffer_bytes(7168 * 2, 8) == 12 * 8 * 288 * slot  # NVLink only
    assert deepep_buffer_bytes(7168 * 2, 64) == 12 * 8 * 288 * slot + 12 * 8 * 128 * 2 * slot
    assert deepep_buffer_bytes(7168 * 2, 1) == 0
    model, cl = make_model(layers=2), make_cluster()
    par, tr = ParallelConfig(pp=1, dp=4, ep=4), TrainingSpec(seq_len=32)
    deep = layer_cost(model, 0, cl, tr, par, "deepep")
    flat = layer_cost(model, 0, cl, tr, par, "flat")
    want = deepep_buffer_bytes(model.hidden_size * 2, 4)
    assert dict(deep.workspace)["deepep_buffers"] == pytest.approx(want)
    assert "deepep_buffers" not in dict(flat.workspace)


def test_fp8_recipes_save_the_gemm_inputs_quantized():
    # Transformer Engine keeps a low-precision GEMM's input for wgrad in FP8 (1 B/element;
    # MXFP8 1 + 1/32): the norm outputs, the context, the routed copies and the activation
    # outputs; q/k/v, the fc1 outputs, the router and the norm inputs stay bf16
    model, par = make_model(layers=1), ParallelConfig(pp=1, dp=2, ep=2)
    bf16 = dict(layer_activations(model, model.layers[0], TrainingSpec(seq_len=32), par).components)
    for dtype, saved in (("fp8", 1.0), ("mxfp8", 1.0 + 1 / 32)):
        tr = TrainingSpec(seq_len=32, dtype=dtype)
        low = dict(layer_activations(model, model.layers[0], tr, par).components)
        r = saved / 2
        assert low["attn_norm"] == pytest.approx(bf16["attn_norm"] * (1 + r) / 2)
        assert low["mlp_norm"] == pytest.approx(bf16["mlp_norm"] * (1 + r) / 2)
        assert low["context"] == pytest.approx(bf16["context"] * r)
        assert low["dispatch"] == pytest.approx(bf16["dispatch"] * r)
        assert low["experts"] == pytest.approx(bf16["experts"] * (2 + r) / 3)  # SwiGLU: 1 of 3
        for name in ("qkv", "router", "combine", "scores"):
            assert low[name] == pytest.approx(bf16[name]), name
    # recomputed activation outputs are not kept, so nothing of them is quantized
    sel = ParallelConfig(pp=1, dp=2, ep=2, recompute="selective", recompute_modules=("moe_act",))
    tr = TrainingSpec(seq_len=32, dtype="fp8")
    kept = dict(layer_activations(model, model.layers[0], tr, sel, "selective").components)
    assert kept["experts"] == pytest.approx(bf16["experts"] * 2 / 3)
