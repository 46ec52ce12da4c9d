"""Time of the production knobs by hand: the interleaved bubble and its p2p, the cp ring, the
expert-TP collectives, FSDP's gathers, DeepEP's deduplicated dispatch, the all-to-all overlap,
FP8 / MXFP8 on the linear GEMMs only; the knobs' rules; the stage IP under vp vs brute force."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from planner.ip.solvers import SolverOptions
from planner.ip.stage_ip import solve_stages, stage_memory_bytes, stage_time_s
from planner.parallel import ParallelConfig
from planner.resources import comm
from planner.resources.comm import distinct_groups
from planner.resources.cost import estimate, stage_cost_inputs
from planner.resources.deepep import deepep_all_to_all_s
from planner.resources.layer_cost import layer_cost
from planner.resources.overlap import paired_a2a_exposed_s
from planner.specs import GIB, DeviceSpec, EfficiencyTable, SpecError, TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model

D, H, E, K, F, V = 64, 4, 8, 2, 96, 256
MSG = 1e-6  # the hand cluster's per-message overhead


def _model(layers: int = 4):
    return make_model(layers=layers, d=D, heads=H, experts=E, top_k=K, ffn=F, vocab=V)


def test_interleaved_bubble_and_p2p_by_hand():
    model, cl, tr = _model(8), make_cluster(), TrainingSpec(seq_len=32)
    par = ParallelConfig(pp=2, dp=2, ep=2, num_microbatches=4, vp=2)
    est = estimate(model, cl, tr, par)
    assert est.bubble_fraction == pytest.approx((1 / 2) / (4 + 1 / 2))  # (pp-1)/vp over the step
    # a pipeline send of a T d = 2 x 32 x 64 B inside the node (ranks 2 apart): vp sends each way
    send = 1e-6 + 2 * 32 * D / 100e9
    assert est.slot_s == pytest.approx(max(st.total_s for st in est.stages) + 2 * 2 * send)
    assert est.step_time_s == pytest.approx(
        (4 + 1 / 2) * est.slot_s + est.dp_exposed_s + est.optimizer_s
    )
    plain = estimate(model, cl, tr, replace(par, vp=1))
    assert plain.slot_s == pytest.approx(max(st.total_s for st in plain.stages) + 2 * send)
    assert plain.step_time_s > est.step_time_s  # the smaller bubble outweighs the extra sends


def test_context_parallel_ring_by_hand():
    model, tr = _model(2), TrainingSpec(seq_len=64)
    cl = make_cluster(gpus_per_node=1, nodes=16, nics_per_node=1)  # every peer over a 25 GB/s NIC
    par = ParallelConfig(pp=1, dp=2, cp=2, ep=2)
    c = layer_cost(model, 0, cl, tr, par)
    core = next(w for w in c.work if w.name == "attn_core")
    kv = 2 * 32 * 2 * D  # K and V of the rank's 32 tokens
    step = 10e-6 + kv / 25e9
    fwd, bwd = core.forward_s, core.time_s - core.forward_s
    want = max(0.0, step - fwd / 2) + max(0.0, 2 * step - bwd / 2)  # cp - 1 = 1 step each way
    assert dict(c.comm_s)["cp_system"] == pytest.approx(want) and want > 0
    assert dict(c.hidden_s)["cp_system"] == pytest.approx(3 * step - want)
    # attention work per rank is 1/cp of the causal square
    one = layer_cost(model, 0, cl, tr, ParallelConfig(pp=1, dp=4, ep=2))
    assert core.flops == pytest.approx(next(w for w in one.work if w.name == "attn_core").flops / 2)


def test_expert_tensor_parallel_collectives_by_hand():
    model, tr, cl = _model(2), TrainingSpec(seq_len=32), make_cluster()
    c = layer_cost(model, 0, cl, tr, ParallelConfig(pp=1, dp=4, ep=2, etp=2))
    buf = 2 * 2 * 32 * K * D  # etp x T k d, bf16
    one_pass = 0.5 * buf / 100e9 + 1e-6  # ring over the 2 etp ranks in the node
    assert dict(c.comm_s)["etp_node"] == pytest.approx(4 * one_pass)  # AG + RS, fwd and bwd
    plain = layer_cost(model, 0, cl, tr, ParallelConfig(pp=1, dp=4, ep=2))
    flops = {w.name: w.flops for w in c.work}
    assert flops["experts"] == pytest.approx({w.name: w.flops for w in plain.work}["experts"])


def test_fsdp_gathers_behind_compute_by_hand():
    model, cl = _model(2), make_cluster()
    tr = TrainingSpec(seq_len=32, fsdp=True, bytes_per_param=18)
    par = ParallelConfig(pp=1, dp=4, ep=4, num_microbatches=2)  # edp 1: only dense shards
    c = layer_cost(model, 0, cl, tr, par)
    dense = 4 * D * D + D * E
    gather = 3 / 4 * 2 * dense / 100e9 + 3 * 1e-6  # bf16 weights, ring over 4 node ranks
    reduce = 3 / 4 * 2 * dense / 100e9 + 3 * 1e-6  # bf16 gradients (Megatron-FSDP's default)
    fwd = sum(w.forward_s for w in c.work)
    bwd = sum(w.time_s for w in c.work) - fwd
    want = max(0.0, gather - fwd) + max(0.0, gather + reduce - bwd)
    assert dict(c.comm_s)["fsdp_node"] == pytest.approx(want)
    assert dict(c.hidden_s)["fsdp_node"] == pytest.approx(2 * gather + reduce - want)
    est = estimate(model, cl, tr, par)
    assert est.dp_exposed_s == 0 and not any(n.startswith("dp_") for n, _ in est.comm_s)
    assert est.fsdp_first_gather_s == pytest.approx(gather)


def test_distinct_destinations_match_enumeration():
    for experts, groups, k in ((8, 4, 2), (16, 4, 3), (12, 3, 4), (8, 8, 2)):
        size = experts // groups
        counts = [len({e // size for e in c}) for c in itertools.combinations(range(experts), k)]
        assert distinct_groups(groups, experts, k) == pytest.approx(sum(counts) / len(counts))


def test_deepep_dispatch_by_hand():
    cl = make_cluster(gpus_per_node=4, nodes=4)  # node 100 GB/s 1 us; NIC 25 GB/s 10 us
    B = 1e6  # T x bytes per token: one copy of each of the rank's tokens
    # inside one node: each token once per distinct destination rank, over NVLink
    d4 = distinct_groups(4, E, K)
    inside = 1e-6 + max(3 * MSG, MSG + B * d4 * 3 / 4 / 100e9)
    assert deepep_all_to_all_s(cl, 4, B, K, E) == pytest.approx(inside)
    # 4 nodes: once per distinct remote node over RDMA, forwarded over NVLink in the node
    rdma = B * distinct_groups(4, 16, K) * 3 / 4
    nvl = B * distinct_groups(16, 16, K) * 3 / 4
    want = max(10e-6 + max(3 * MSG, MSG + rdma / 25e9), 1e-6 + max(3 * MSG, MSG + nvl / 100e9))
    assert deepep_all_to_all_s(cl, 16, B, K, 16) == pytest.approx(want)
    # k = 2 copies per token sent flat, fewer over the NIC deduplicated
    assert deepep_all_to_all_s(cl, 16, B, K, 16) < comm.all_to_all_time_s(cl, 16, K * B, "flat")


def test_deepep_layer_cost_uses_the_deduplicated_volume():
    model, tr, cl = _model(2), TrainingSpec(seq_len=64), make_cluster()
    par = ParallelConfig(pp=1, dp=16, ep=8)
    flat = dict(layer_cost(model, 0, cl, tr, par, "flat").comm_s)["a2a_system"]
    deep = dict(layer_cost(model, 0, cl, tr, par, "deepep").comm_s)["a2a_system"]
    assert deep == pytest.approx(4 * deepep_all_to_all_s(cl, 8, 2 * 64 * D, K, E))
    assert deep < flat


def test_all_to_all_overlap_pairs_the_steady_phase():
    # one pair: max(a_f, t) + max(m_b + m_f, 2t) + max(a_b, t) - compute
    assert paired_a2a_exposed_s(1.0, 2.0, 3.0, 4.0, 0.5) == 0.0  # fully hidden
    assert paired_a2a_exposed_s(1.0, 2.0, 0.5, 0.5, 3.0) == pytest.approx(3 + 6 + 3 - 4)
    model = make_model(layers=2, d=D, heads=H, experts=16, top_k=K, ffn=F, vocab=V)
    tr, cl = TrainingSpec(seq_len=64), make_cluster()
    par = ParallelConfig(pp=1, dp=16, ep=16, num_microbatches=4)
    plain = layer_cost(model, 0, cl, tr, par)
    ovl = layer_cost(model, 0, cl, replace(tr, a2a_overlap=True), par)
    a2a = dict(plain.comm_s)["a2a_system"]
    shown, hidden = dict(ovl.comm_s)["a2a_system"], dict(ovl.hidden_s)["a2a_system"]
    assert shown + hidden == pytest.approx(a2a) and 0 <= shown < a2a
    est = estimate(model, cl, replace(tr, a2a_overlap=True), par)
    # pp = 1: the first forward and the last backward run alone, one micro-batch unpaired;
    # the paired forward holds one layer beside the backward, not a second micro-batch
    assert est.stages[0].in_flight == 1
    assert est.unpaired_s == pytest.approx(2 * hidden)


def _fp8_cluster(mx: bool = False):
    peaks = (("bf16", 100.0), ("fp8", 200.0)) + ((("mxfp8", 200.0),) if mx else ())
    tables = (
        EfficiencyTable("gemm_bf16", (1.0, 1e9), (40.0, 40.0)),
        EfficiencyTable("gemm_fp8", (1.0, 1e9), (80.0, 80.0)),
        EfficiencyTable("gemm_mxfp8", (1.0, 1e9), (80.0, 80.0)),
        EfficiencyTable("attention_bf16", (1.0, 1e9), (20.0, 20.0)),
    )
    cl = make_cluster(tables=tables)
    return replace(cl, device=DeviceSpec("dev", 80.0, peaks, 1000.0))


@pytest.mark.parametrize("dtype,cast", [("fp8", 6.0), ("mxfp8", 2 * (2 + 1 + 1 / 32))])
def test_low_precision_speeds_up_only_the_linear_gemms(dtype, cast):
    model, cl = _model(2), _fp8_cluster(mx=True)
    par = ParallelConfig(pp=1, dp=2, ep=2, num_microbatches=4)
    bf = {w.name: w for w in layer_cost(model, 0, cl, TrainingSpec(seq_len=32), par).work}
    lp = {
        w.name: w for w in layer_cost(model, 0, cl, TrainingSpec(seq_len=32, dtype=dtype), par).work
    }
    for name in ("attn_proj", "experts"):
        assert lp[name].time_s == pytest.approx(bf[name].time_s / 2)  # 80 vs 40 TFLOPS
    for name in ("attn_core", "router", "elementwise"):
        assert lp[name].time_s == pytest.approx(bf[name].time_s)
    T, copies = 32, 32 * K
    io = T * 2 * D + copies * (2 * D + 3 * F)  # the linear GEMMs' inputs and output gradients
    weights = 4 * D * D + (E / 2) * 3 * D * F
    assert lp["quantize"].time_s == pytest.approx(cast * (io + weights / 4) / 1e12)
    assert "quantize" not in bf


def test_mxfp8_needs_the_devices_peak():
    par = ParallelConfig(pp=1, dp=2, ep=2)
    with pytest.raises(SpecError, match="mxfp8"):
        estimate(_model(2), _fp8_cluster(), TrainingSpec(seq_len=32, dtype="mxfp8"), par)


@pytest.mark.parametrize(
    "training,par,dispatcher,match",
    [
        (dict(a2a_overlap=True), dict(pp=1, dp=2), "flat", "needs ep > 1"),
        (dict(a2a_overlap=True), dict(pp=2, dp=2, ep=2, num_microbatches=2), "flat", "vp > 1"),
        (dict(a2a_overlap=True), dict(pp=1, dp=2, ep=2), "halo", "not halo"),
        (dict(a2a_overlap=True), dict(pp=1, dp=2, ep=2, recompute="full"), "flat", "full"),
        (
            dict(a2a_overlap=True),
            dict(pp=1, dp=2, ep=2, recompute="selective", recompute_modules=("moe",)),
            "flat",
            "'moe'",
        ),
        (dict(mtp_layers=1), dict(pp=1, dp=2, cp=2, ep=2), "flat", "context parallelism"),
        (dict(a2a_overlap=True, mtp_layers=1), dict(pp=1, dp=2, ep=2), "flat", "needs pp > 1"),
        (dict(), dict(pp=1, dp=2, ep=2), "ring", "dispatcher 'ring'"),
    ],
)
def test_knob_conflicts_are_one_line_errors(training, par, dispatcher, match):
    tr = TrainingSpec(seq_len=32, **training)
    with pytest.raises(SpecError, match=match) as err:
        estimate(_model(4), make_cluster(), tr, ParallelConfig(**par), dispatcher=dispatcher)
    assert "\n" not in str(err.value)


def test_megatron_counts_embedding_and_loss_as_pipeline_layers_for_vp():
    # 6 layers over pp 4 x vp 2 = 8 chunks: valid with the embedding and loss as units
    par = ParallelConfig(pp=4, dp=1, num_microbatches=4, vp=2)
    model = make_model(layers=6, experts=0, first_dense=6)
    est = estimate(model, make_cluster(), TrainingSpec(seq_len=32), par)
    assert len(est.stages) == 4
    with pytest.raises(SpecError, match="embedding and the loss"):
        estimate(model, make_cluster(), TrainingSpec(seq_len=32), replace(par, vp=3))


def test_stage_ip_with_interleaving_is_optimal_against_brute_force():
    model = make_model(
        layers=10, d=D, heads=H, experts=E, top_k=K, ffn=F, vocab=4096, first_dense=2
    )
    tr = TrainingSpec(seq_len=64)
    par = ParallelConfig(pp=3, dp=2, ep=2, micro_batch=2, num_microbatches=6, vp=2)
    big = stage_cost_inputs(model, make_cluster(), tr, par)
    splits = []
    for cuts in itertools.combinations(range(1, 10), 2):
        bounds = (0, *cuts, 10)
        stages = [tuple(range(bounds[i], bounds[i + 1])) for i in range(3)]
        if min(len(s) for s in stages) < par.vp:
            continue
        mem = max(stage_memory_bytes(big, i, s, ()) for i, s in enumerate(stages))
        time = max(stage_time_s(big, i, s, ()) for i, s in enumerate(stages))
        splits.append((stages, mem, time))
        est = estimate(model, make_cluster(), tr, par, stage_layers=stages)
        for i, s in enumerate(stages):  # the contract: estimate's stage = the IP's stage
            buffers = dict(est.stages[i].memory_gib)["p2p_buffers"]  # reserved from usable
            assert est.stages[i].total_gib - buffers == pytest.approx(
                stage_memory_bytes(big, i, s, ()) / GIB + 2.0
            )
    mems = sorted({m for _, m, _ in splits})
    cap = (mems[len(mems) // 2] + mems[len(mems) // 2 + 1]) / 2  # between two splits' peaks
    inputs = replace(big, usable_memory_bytes=cap)
    best = min(t for _, m, t in splits if m <= cap)
    sol = solve_stages(inputs, SolverOptions(backend="cpsat", time_limit_s=10))
    assert sol.report.status == "OPTIMAL"
    assert sol.bottleneck_s == pytest.approx(best, rel=1e-5)
    assert math.isfinite(sol.bottleneck_s)
