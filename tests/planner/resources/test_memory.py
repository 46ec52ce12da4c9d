"""Memory model: the paper's equations, the pp - i structure, every component by hand."""

from __future__ import annotations

import itertools

import pytest

from planner.parallel import ParallelConfig
from planner.resources.cost import estimate, memory_lower_bound_gib
from planner.resources.memory import layer_activations
from planner.specs import GIB, TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model


def _state_and_act_bytes(stage) -> float:
    m = dict(stage.memory_gib)
    return (m["weights"] + m["grads"] + m["optimizer"] + m["activations"]) * GIB


def test_paper_equations_in_the_papers_setting():
    # Paper: stage i = L/PP (64 d^2 + 48 E d f / EP)
    #                 + (PP - i) L/PP (12 b s d + 4 b H s^2 + 2 b s k (3 f + d) / EP)
    L, d, H, E, k, f = 8, 64, 4, 8, 2, 96
    model = make_model(layers=L, d=d, heads=H, experts=E, top_k=k, ffn=f)
    b, s, pp, ep = 2, 32, 4, 4
    training = TrainingSpec(seq_len=s, bytes_per_param=16, flash_attention=False)
    par = ParallelConfig(pp=pp, dp=ep, ep=ep, micro_batch=b, num_microbatches=8)
    est = estimate(model, make_cluster(), training, par, accounting="paper")
    per_stage_state = L / pp * (64 * d**2 + 48 * E * d * f / ep)
    per_layer_act = 12 * b * s * d + 4 * b * H * s**2 + 2 * b * s * k * (3 * f + d) / ep
    for i, stage in enumerate(est.stages):
        want = per_stage_state + (pp - i) * L / pp * per_layer_act
        assert _state_and_act_bytes(stage) == pytest.approx(want, rel=1e-12)
    gap = _state_and_act_bytes(est.stages[0]) - _state_and_act_bytes(est.stages[-1])
    assert gap == pytest.approx(L * (pp - 1) / pp * per_layer_act, rel=1e-12)


def test_general_attention_and_expert_terms_reduce_to_the_papers():
    # With MHA, no flash attention and balanced routing, the general model's attention terms
    # are exactly 12 b s d + 4 b H s^2 and its received-copies + expert intermediates are
    # 2 b s k (3 f + d) per rank (b = this rank's micro-batch).
    d, H, k, f, b, s = 64, 4, 2, 96, 3, 16
    model = make_model(d=d, heads=H, top_k=k, ffn=f)
    training = TrainingSpec(seq_len=s, flash_attention=False)
    par = ParallelConfig(pp=1, dp=4, ep=4, micro_batch=b)
    act = dict(layer_activations(model, model.layers[0], training, par).components)
    attention = act["attn_norm"] + act["qkv"] + act["context"] + act["scores"]
    assert attention == 12 * b * s * d + 4 * b * H * s**2
    assert act["dispatch"] + act["experts"] == 2 * b * s * k * (3 * f + d)
    flash = dict(layer_activations(model, model.layers[0], TrainingSpec(seq_len=s), par).components)
    assert flash["scores"] == 4 * b * H * s  # fp32 log-sum-exp per head and query


def test_recompute_and_skew():
    model = make_model(d=64, heads=4, top_k=2, ffn=96)
    par = ParallelConfig(pp=1, dp=2, ep=2, micro_batch=2)
    tr = TrainingSpec(seq_len=16, flash_attention=False)
    layer = model.layers[0]
    none = dict(layer_activations(model, layer, tr, par, "none").components)
    sel = dict(layer_activations(model, layer, tr, par, "selective").components)
    full = layer_activations(model, layer, tr, par, "full")
    assert full.total == 2 * 2 * 16 * 64  # bf16 layer input only
    assert sel["scores"] == 0 and sum(sel.values()) == sum(none.values()) - none["scores"]
    hot = dict(
        layer_activations(
            model, layer, TrainingSpec(seq_len=16, flash_attention=False, routing_skew=1.5), par
        ).components
    )
    assert hot["experts"] == 1.5 * none["experts"] and hot["dispatch"] == 1.5 * none["dispatch"]
    assert hot["qkv"] == none["qkv"] and hot["combine"] == none["combine"]


@pytest.mark.parametrize("m", [2, 8])
def test_in_flight_micro_batches_pp_minus_i(m):
    model = make_model(layers=8)
    par = ParallelConfig(pp=4, dp=2, ep=2, micro_batch=1, num_microbatches=m)
    tr = TrainingSpec(seq_len=32)
    est = estimate(model, make_cluster(), tr, par, stage_layers=[(0, 1), (2, 3), (4, 5), (6, 7)])
    per_layer = layer_activations(model, model.layers[0], tr, par).total
    for i in (1, 2):  # middle stages: no embedding or head
        acts = dict(est.stages[i].memory_gib)["activations"] * GIB
        assert est.stages[i].in_flight == min(4 - i, m)
        assert acts == pytest.approx(min(4 - i, m) * 2 * per_layer, rel=1e-12)


def test_state_by_hand_zero_and_megatron_bytes():
    d, E, f, V = 64, 8, 96, 256
    model = make_model(layers=3, d=d, experts=E, ffn=f, vocab=V)
    par = ParallelConfig(pp=3, dp=4, ep=2, micro_batch=1, num_microbatches=4)
    dense = 4 * d * d + d * E  # attention (no biases) + router; no norms in the hand model
    expert = 3 * d * f * E / 2
    cl = make_cluster()
    plain = estimate(model, cl, TrainingSpec(seq_len=8), par)
    mid = dict(plain.stages[1].memory_gib)
    assert mid["weights"] * GIB == pytest.approx(2 * (dense + expert))
    assert mid["grads"] * GIB == pytest.approx(2 * (dense + expert))
    assert mid["optimizer"] * GIB == pytest.approx(12 * (dense + expert))
    zero = estimate(model, cl, TrainingSpec(seq_len=8, zero=True, bytes_per_param=18), par)
    zmid = dict(zero.stages[1].memory_gib)
    assert zmid["grads"] * GIB == pytest.approx(4 * (dense + expert))  # Megatron: fp32 grads
    assert zmid["optimizer"] * GIB == pytest.approx(12 * (dense / 4 + expert / par.edp))
    # embedding on the first stage, untied head + final norm on the last
    w = [dict(st.memory_gib)["weights"] * GIB for st in plain.stages]
    assert w[0] - w[1] == pytest.approx(2 * V * d)
    assert w[2] - w[1] == pytest.approx(2 * (V * d + d))


def test_tied_head_is_a_copy_only_when_pipelined():
    from dataclasses import replace

    model = replace(make_model(layers=2), tie_word_embeddings=True)
    cl, tr = make_cluster(), TrainingSpec(seq_len=8)
    one = estimate(model, cl, tr, ParallelConfig(pp=1, dp=1, ep=1))
    two = estimate(model, cl, tr, ParallelConfig(pp=2, dp=1, ep=1))
    w1 = dict(one.stages[0].memory_gib)["weights"] * GIB
    w2 = sum(dict(st.memory_gib)["weights"] for st in two.stages) * GIB
    assert w2 - w1 == pytest.approx(2 * model.vocab_size * model.hidden_size)


def _splits(n: int, pp: int):
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        yield [tuple(range(bounds[i], bounds[i + 1])) for i in range(pp)]


@pytest.mark.parametrize(
    "pp,m,recompute", [(2, 4, "none"), (3, 2, "none"), (3, 8, "full"), (4, 8, "selective")]
)
def test_memory_lower_bound_holds_for_every_split(pp, m, recompute):
    model = make_model(layers=6, first_dense=1, vocab=4096)
    cl = make_cluster()
    tr = TrainingSpec(seq_len=64, flash_attention=False)
    par = ParallelConfig(pp=pp, dp=2, ep=2, micro_batch=2, num_microbatches=m, recompute=recompute)
    bound = memory_lower_bound_gib(model, cl, tr, par)
    options = [None, ()] if recompute != "none" else [None]
    best = min(
        max(st.total_gib for st in estimate(model, cl, tr, par, split, rc).stages)
        for split in _splits(6, pp)
        for rc in options
    )
    assert 0 < bound <= best + 1e-9


@pytest.mark.parametrize("target", ["piper", "megatron", "torchtitan"])
def test_state_bytes_per_parameter_by_target_and_dtype(target):
    """bf16: the target's accounting (Megatron's 18 for megatron and piper: bf16 weights, fp32
    gradients, master and moments; 16 with bf16 gradients for torchtitan's); fp32: fp32
    weights and gradients and no master, 16 whatever the accounting.
    """
    from planner.resources.memory import state_bytes
    from planner.targets import TARGETS, with_conventions

    par = ParallelConfig(pp=1, dp=4, tp=1, ep=1, micro_batch=1, num_microbatches=1)
    for dtype, expect in (("bf16", None), ("fp32", (4, 4, 8))):
        tr = with_conventions(TrainingSpec(seq_len=128, global_batch=4, dtype=dtype),
                              TARGETS[target])  # fmt: skip
        got = state_bytes(1000.0, 0.0, tr, par)
        per_param = (got.weights / 1000, got.grads / 1000, got.optimizer / 1000)
        if expect is None:
            grads = TARGETS[target].bytes_per_param - 14
            expect = (2, grads, 12)
        assert per_param == expect
    bpp = {"piper": 18, "megatron": 18, "torchtitan": 16}[target]
    assert TARGETS[target].bytes_per_param == bpp


def test_fsdp_gathers_the_weights_in_the_training_dtype():
    import dataclasses

    from planner.resources.cost import predicted_traffic

    model, cluster = make_model(), make_cluster()
    device = dataclasses.replace(cluster.device, peak_tflops=(("bf16", 100.0), ("fp32", 25.0)))
    cluster = dataclasses.replace(cluster, device=device)
    par = ParallelConfig(pp=1, dp=4, tp=1, ep=1, micro_batch=1, num_microbatches=2)
    out = {}
    for dtype in ("bf16", "fp32"):
        tr = TrainingSpec(seq_len=128, global_batch=8, dtype=dtype, fsdp=True)
        out[dtype] = predicted_traffic(model, cluster, tr, par, [tuple(range(model.num_layers))])
    assert out["bf16"]["param_gather"] > 0 and out["bf16"]["grad_dense"] > 0
    assert out["fp32"]["param_gather"] == pytest.approx(2 * out["bf16"]["param_gather"])
    # the paper's 16 B accounting (TrainingSpec's default) reduces bf16 gradients in bf16
    assert out["fp32"]["grad_dense"] == pytest.approx(2 * out["bf16"]["grad_dense"])


def test_fsdp_reduces_gradients_in_each_targets_reduce_dtype():
    """Megatron-FSDP reduce-scatters in the model's gradient dtype (bf16), FSDP2 under
    torchtitan and Piper's runtime in fp32: the same plan's reduce-scatter moves twice the
    bytes for them, and costs more time; the gathers move bf16 weights for all three."""
    from planner.resources.cost import predicted_traffic
    from planner.resources.layer_comm import fsdp_gather_s
    from planner.targets import TARGETS, with_conventions

    model, cluster = make_model(), make_cluster()
    par = ParallelConfig(pp=1, dp=4, tp=1, ep=1, micro_batch=1, num_microbatches=2)
    base = TrainingSpec(seq_len=128, global_batch=8, fsdp=True)
    out, times = {}, {}
    for name in ("megatron", "torchtitan", "piper"):
        tr = with_conventions(base, TARGETS[name])
        out[name] = predicted_traffic(model, cluster, tr, par, [tuple(range(model.num_layers))])
        times[name] = fsdp_gather_s(cluster, tr, par, (1e9, 0.0))
    for name in ("torchtitan", "piper"):
        assert out[name]["grad_dense"] == pytest.approx(2 * out["megatron"]["grad_dense"])
        assert out[name]["param_gather"] == pytest.approx(out["megatron"]["param_gather"])
        assert times[name][0] == pytest.approx(times["megatron"][0])  # the gather
        assert times[name][1] > 1.9 * times["megatron"][1]  # the reduce-scatter
