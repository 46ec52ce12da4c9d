"""Memory of the production knobs, each term by hand on a small model and against
Megatron-Core's formulas: interleaved in-flight chunks, cp, etp and folding, the distributed
optimizer and FSDP, optimizer dtype, recompute modules, MTP, the gate in the activation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.parallel import ParallelConfig
from planner.resources.cost import estimate, stage_cost_inputs
from planner.resources.interleave import live_chunks
from planner.resources.layer_cost import layer_cost
from planner.resources.memory import layer_activations
from planner.specs import GIB, AttentionSpec, LayerSpec, ModelSpec, MoESpec, TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model

D, H, E, K, F, V = 64, 4, 8, 2, 96, 256


def _mem(stage) -> dict[str, float]:
    return {name: gib * GIB for name, gib in stage.memory_gib}


def test_interleaved_live_chunks_match_megatron():
    # the note's worked examples: pp 8 vp 4 holds 39 chunks on rank 0, pp 32 vp 3 holds 127;
    # the all-to-all overlap's extra warm-up forward pairs layer by layer with a backward
    # that frees as it goes, so it holds one layer more (a workspace), not one chunk
    assert live_chunks(0, 8, 4, 128, False) == 39
    assert live_chunks(0, 8, 4, 128, True) == 39
    assert live_chunks(0, 32, 3, 512, False) == 127
    for pp, vp in ((2, 2), (4, 2), (4, 3), (8, 4), (16, 5)):
        m = 4 * pp
        # theoretical_memory_usage.py: pp micro-batches x 1 + (pp - 1) / (pp vp) on stage 0
        assert live_chunks(0, pp, vp, m, False) / vp == pytest.approx(
            pp * (1 + (pp - 1) / (pp * vp))
        )
        assert live_chunks(pp - 1, pp, vp, m, False) == (vp - 1) * pp + 1
    assert [live_chunks(r, 4, 1, 2, False) for r in range(4)] == [2, 2, 2, 1]  # min(pp - r, m)
    assert live_chunks(0, 4, 2, 4, False) == 8  # every chunk-micro-batch of the step


def test_interleaved_stage_activations_by_hand():
    model = make_model(layers=8, d=D, heads=H, experts=E, top_k=K, ffn=F, vocab=V)
    tr = TrainingSpec(seq_len=32)
    par = ParallelConfig(pp=2, dp=2, ep=2, micro_batch=1, num_microbatches=4, vp=2)
    est = estimate(model, make_cluster(), tr, par)
    per_layer = layer_activations(model, model.layers[0], tr, par).total
    ids = 8.0 * 32  # the first stage's token ids
    head = 2 * 2 * 32 * D + 4.0 * 32 * V  # final norm in/out + fp32 logits
    # rank 0: 2 (pp - 1) + (vp - 1) pp + 1 = 5 chunks live, rank 1: (vp - 1) pp + 1 = 3
    assert [st.in_flight for st in est.stages] == [5, 3]
    assert _mem(est.stages[0])["activations"] == pytest.approx(5 / 2 * (4 * per_layer + ids))
    # the head sits in the last rank's last chunk, whose backward follows its forward
    # (Megatron's interleaved schedule starts the backwards with the last chunk): one
    # micro-batch of it is live, beside 3 chunk-micro-batches of layers
    assert _mem(est.stages[1])["activations"] == pytest.approx(3 / 2 * 4 * per_layer + head)
    # the receive buffers posted ahead for the next chunk's input and gradient: 2 a T d
    assert _mem(est.stages[0])["p2p_buffers"] == pytest.approx(2 * 2 * 32 * D)
    inputs = stage_cost_inputs(model, make_cluster(), tr, par)
    assert inputs.in_flight(0) * sum(u.act_bytes for u in inputs.units[:4]) == pytest.approx(
        5 / 2 * 4 * per_layer
    )
    assert inputs.pipeline_slots == 4 + 1 / 2


def test_distributed_optimizer_is_megatrons_6_plus_12_over_d():
    # dense parameters are sharded over dp x cp = 8, experts over edp = tp cp dp / ep = 2
    model = make_model(layers=2, d=D, heads=H, experts=E, top_k=K, ffn=F, vocab=V)
    par = ParallelConfig(pp=2, dp=4, cp=2, ep=4, num_microbatches=4)
    tr = TrainingSpec(seq_len=32, zero=True, bytes_per_param=18)
    c = layer_cost(model, 0, make_cluster(nodes=4), tr, par)
    dense, expert = 4 * D * D + D * E, 3 * D * F * E / 4
    assert (c.params_dense, c.params_expert) == (dense, expert) and par.edp == 2
    assert c.state.total == pytest.approx(dense * (6 + 12 / 8) + expert * (6 + 12 / 2))
    bf16 = layer_cost(model, 0, make_cluster(nodes=4), replace(tr, optimizer_dtype="bf16"), par)
    assert bf16.state.total == pytest.approx(dense * (6 + 8 / 8) + expert * (6 + 8 / 2))


def test_fsdp_shards_everything_and_gathers_two_units():
    model = make_model(layers=2, d=D, heads=H, experts=E, top_k=K, ffn=F, vocab=V)
    par = ParallelConfig(pp=1, dp=4, cp=2, ep=4, num_microbatches=2)
    tr = TrainingSpec(seq_len=32, fsdp=True, bytes_per_param=18)
    est = estimate(model, make_cluster(nodes=4), tr, par)
    dense = 2 * (4 * D * D + D * E) + V * D + (V * D + D)  # layers, embedding, head + norm
    expert = 2 * 3 * D * F * E / 4
    mem = _mem(est.stages[0])
    assert mem["weights"] == pytest.approx(2 * (dense / 8 + expert / 2))
    assert mem["grads"] == pytest.approx(4 * (dense / 8 + expert / 2))
    assert mem["optimizer"] == pytest.approx(12 * (dense / 8 + expert / 2))  # 18 / d in all
    # the largest unit is a layer (4 d^2 + d E + 3 d f E / ep = 53760 parameters): two of
    # them un-sharded, bf16 weights + fp32 gradients
    assert mem["fsdp_gathered"] == pytest.approx(2 * (2 + 4) * 53760)
    inputs = stage_cost_inputs(model, make_cluster(nodes=4), tr, par)
    usable = (80.0 - 2.0) * GIB - 2 * (2 + 4) * 53760
    assert inputs.usable_memory_bytes == pytest.approx(usable)


def test_context_parallel_splits_tokens_and_adds_kv_buffers():
    model = make_model(layers=2, d=D, heads=H, experts=E, top_k=K, ffn=F, vocab=V)
    tr = TrainingSpec(seq_len=64)
    one = ParallelConfig(pp=1, dp=4, ep=4)
    two = ParallelConfig(pp=1, dp=2, cp=2, ep=4)
    a1 = dict(layer_activations(model, model.layers[0], tr, one).components)
    a2 = dict(layer_activations(model, model.layers[0], tr, two).components)
    assert all(a2[n] == pytest.approx(a1[n] / 2) for n in a1)  # s / cp tokens, lse of s / cp
    c = layer_cost(model, 0, make_cluster(), tr, two)
    kv = 2 * 32 * (2 * H * (D // H))  # K and V of the rank's 32 tokens, all 4 heads (MHA)
    assert dict(c.workspace) == {"cp_kv_buffers": 4 * kv}
    mem = _mem(estimate(model, make_cluster(), tr, two).stages[0])
    assert mem["cp_kv_buffers"] == pytest.approx(4 * kv)


def test_expert_tensor_parallel_and_folding():
    model = make_model(layers=2, d=D, heads=H, experts=E, top_k=K, ffn=F, vocab=V)
    tr = TrainingSpec(seq_len=32, zero=True)
    par = ParallelConfig(pp=1, dp=4, ep=2, etp=2)  # expert mesh etp 2 x ep 2 x edp 1
    assert par.edp == 1
    c = layer_cost(model, 0, make_cluster(), tr, par)
    assert c.params_expert == 3 * D * F * E / (2 * 2)
    a = dict(c.act.components)
    T = 32
    assert a["dispatch"] == 2 * 2 * T * K * D  # the etp group's copies, gathered
    assert a["experts"] == 2 * T * K * 3 * F  # etp T k rows of width f / etp
    # folding: ep 8 over tp 2 x dp 4 (ep > dp), experts replicated over edp = 1
    fold = ParallelConfig(pp=1, dp=4, tp=2, ep=8)
    assert fold.edp == 1 and layer_cost(model, 0, make_cluster(), tr, fold).params_expert == (
        3 * D * F * E / 8
    )


def _mla_model() -> ModelSpec:
    att = AttentionSpec(
        kind="mla", num_heads=4, num_kv_heads=4, head_dim=0, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    )  # fmt: skip
    moe = MoESpec(num_experts=E, top_k=K, expert_ffn=F, num_shared_experts=1, shared_ffn=48)
    layers = (LayerSpec("dense", att, dense_ffn=128), LayerSpec("moe", att, moe=moe))
    return ModelSpec(name="mla", family="test", hidden_size=D, vocab_size=V, layers=layers)


@pytest.mark.parametrize(
    "modules,dropped",
    [
        (("core_attn",), {"scores"}),
        (("layernorm",), {"attn_norm", "mlp_norm"}),  # MLA input norm, MoE pre-MLP norm
        (("moe_act",), {"experts"}),
        (("mla_up_proj",), {"qkv"}),
        (("mlp",), set()),  # no effect on MoE layers
        (("moe",), {"router", "dispatch", "experts", "combine", "shared"}),
        (("shared_experts",), {"shared"}),
    ],
)
def test_recompute_modules_drop_their_bytes_on_a_moe_layer(modules, dropped):
    model = _mla_model()
    tr, T, a = TrainingSpec(seq_len=16), 16, 2
    par = ParallelConfig(pp=1, dp=2, ep=2, recompute="selective", recompute_modules=modules)
    moe_layer = model.layers[1]
    none = dict(layer_activations(model, moe_layer, tr, par).components)
    kept = dict(layer_activations(model, moe_layer, tr, par, "selective").components)
    want = {
        "scores": 0.0,
        "attn_norm": a * T * D,  # the norm output is dropped, its input stays
        "mlp_norm": a * T * D,
        "experts": none["experts"] * 2 / 3,  # act(gate) * up of gate, up, act * up
        "qkv": a * T * (32 + 16 + 4),  # the q and kv latents
        "router": 0.0, "dispatch": 0.0, "combine": 0.0, "shared": 0.0,
    }  # fmt: skip
    if modules == ("moe",):
        want["experts"] = 0.0  # the whole block but its input
    for name, value in none.items():
        assert kept[name] == pytest.approx(want[name] if name in dropped else value), name


def test_recompute_mlp_module_on_a_dense_layer_and_its_cost():
    model = _mla_model()
    tr = TrainingSpec(seq_len=16)
    par = ParallelConfig(pp=1, dp=2, ep=2, recompute="selective", recompute_modules=("mlp",))
    dense = dict(layer_activations(model, model.layers[0], tr, par, "selective").components)
    assert dense["dense_mlp"] == 0 and dense["mlp_norm"] == 2 * 16 * D
    c = layer_cost(model, 0, make_cluster(), tr, par)
    forward = {w.name: w.forward_s for w in c.work}
    dropped = c.act.total - c.act_recompute.total
    assert c.recompute_extra_s == pytest.approx(forward["dense_mlp"] + 4 * dropped / 1e12 / 3)


def test_recompute_moe_module_repeats_the_forward_all_to_alls():
    model = make_model(layers=2, d=D, heads=H, experts=E, top_k=K, ffn=F)
    tr = TrainingSpec(seq_len=16)
    par = ParallelConfig(pp=1, dp=8, ep=8, recompute="selective", recompute_modules=("moe",))
    c = layer_cost(model, 0, make_cluster(), tr, par)
    forward = {w.name: w.forward_s for w in c.work}
    a2a = dict(c.comm_s)["a2a_system"]
    dropped = c.act.total - c.act_recompute.total
    want = forward["router"] + forward["experts"] + 4 * dropped / 1e12 / 3 + a2a / 2
    assert c.recompute_extra_s == pytest.approx(want)


def test_mtp_layers_follow_the_training_setting():
    base = make_model(layers=4, d=D, heads=H, experts=E, top_k=K, ffn=F, vocab=V)
    model = replace(base, num_mtp_layers=1)
    par = ParallelConfig(pp=2, dp=2, ep=2, num_microbatches=2)
    cl = make_cluster()
    on = estimate(model, cl, TrainingSpec(seq_len=16), par)
    off = estimate(model, cl, TrainingSpec(seq_len=16, mtp_layers=0), par)
    added = estimate(base, cl, TrainingSpec(seq_len=16, mtp_layers=1), par)
    # one MTP module on the last stage: 2 norms + final norm (3 d), eh_proj 2 d^2, one layer;
    # pp > 1 with an untied head: the embedding copy it reads (V d)
    mtp = 3 * D + 2 * D * D + (4 * D * D + D * E) + 3 * D * F * E / 2
    w_on, w_off = _mem(on.stages[1])["weights"], _mem(off.stages[1])["weights"]
    assert w_on - w_off == pytest.approx(2 * (mtp + V * D))
    assert _mem(added.stages[1])["weights"] == pytest.approx(w_on)
    assert _mem(on.stages[0]) == _mem(off.stages[0])


def test_gate_in_the_activation_keeps_no_combine_input():
    model = make_model(layers=2, d=D, heads=H, experts=E, top_k=K, ffn=F)
    par = ParallelConfig(pp=1, dp=2, ep=2)
    plain = dict(
        layer_activations(model, model.layers[0], TrainingSpec(seq_len=16), par).components
    )
    tr = TrainingSpec(seq_len=16, gate_in_activation=True)
    gated = dict(layer_activations(model, model.layers[0], tr, par).components)
    assert plain["combine"] == 2 * 16 * K * D and gated["combine"] == 0
    assert {n: v for n, v in gated.items() if n != "combine"} == {
        n: v for n, v in plain.items() if n != "combine"
    }


def test_a2a_overlap_holds_one_more_layer_as_a_workspace():
    model, cl = make_model(layers=2), make_cluster()
    par = ParallelConfig(pp=1, dp=2, ep=2, num_microbatches=4)
    plain = layer_cost(model, 0, cl, TrainingSpec(seq_len=32), par)
    paired = layer_cost(model, 0, cl, TrainingSpec(seq_len=32, a2a_overlap=True), par)
    assert "a2a_overlap_layer" not in dict(plain.workspace)
    assert dict(paired.workspace)["a2a_overlap_layer"] == pytest.approx(paired.act.total)
    est = estimate(model, cl, TrainingSpec(seq_len=32, a2a_overlap=True), par)
    base = estimate(model, cl, TrainingSpec(seq_len=32), par)
    extra = est.stages[0].total_gib - base.stages[0].total_gib
    assert extra == pytest.approx(paired.act.total / GIB)


def _megatron_last_rank_live(pp: int, vp: int, m: int) -> tuple[int, int]:
    """Replays Megatron-Core's interleaved order on the last rank (schedules.py: virtual
    micro-batch k is chunk (k // pp) % vp of micro-batch (k // (pp vp)) pp + k % pp, the
    backwards run the chunks in reverse; warm-up (vp - 1) pp forwards, then one forward and
    one backward per step) and returns the most chunk-micro-batches live at once and the most
    micro-batches of the LAST chunk live at once."""

    def chunk(k: int, forward: bool) -> tuple[int, int]:
        c = (k // pp) % vp
        return (c if forward else vp - 1 - c), (k // (pp * vp)) * pp + k % pp

    total = m * vp
    warmup = min((vp - 1) * pp, total)
    live: set[tuple[int, int]] = set()
    peak = peak_all = 0
    for k in range(warmup):
        live.add(chunk(k, True))
    for k in range(total):
        if warmup + k < total:
            live.add(chunk(warmup + k, True))
        peak = max(peak, sum(1 for c, _ in live if c == vp - 1))
        peak_all = max(peak_all, len(live))
        live.discard(chunk(k, False))
    return peak_all, peak


@pytest.mark.parametrize(("pp", "vp", "m"), [(2, 2, 4), (4, 2, 8), (8, 4, 16), (4, 3, 12)])
def test_head_activations_live_once_on_the_interleaved_last_stage(pp, vp, m):
    # the replay holds as many chunks as the model's count, and one of them is the last
    assert _megatron_last_rank_live(pp, vp, m) == (live_chunks(pp - 1, pp, vp, m, False), 1)
    model = make_model(layers=2 * pp * vp, d=D, heads=H, experts=E, top_k=K, ffn=F, vocab=V)
    tr = TrainingSpec(seq_len=32)
    par = ParallelConfig(pp=pp, dp=2, ep=2, micro_batch=1, num_microbatches=m, vp=vp)
    est = estimate(model, make_cluster(), tr, par)
    last = est.stages[-1]
    per_layer = layer_activations(model, model.layers[-1], tr, par).total
    head = 2 * 2 * 32 * D + 4.0 * 32 * V
    layers = len(last.layers)
    assert _mem(last)["activations"] == pytest.approx(
        last.in_flight / vp * layers * per_layer + head
    )
