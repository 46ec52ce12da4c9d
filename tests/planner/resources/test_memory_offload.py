"""Optimizer state that leaves the device or shrinks: host offload (Megatron's
HybridDeviceOptimizer), the precision-aware optimizer's master-weight remainders and the
gradient buffer's dtype, each against a hand derivation from Megatron-Core's code and its
theoretical_memory_usage formula (6 + 12/d B per parameter with the distributed optimizer)."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from planner.inputs.clusters import load_cluster
from planner.parallel import ParallelConfig
from planner.resources.cost import estimate
from planner.resources.memory import layer_activations, offloaded_layer_bytes, state_bytes
from planner.resources.offload import ADAM_HOST_BYTES, host_link, host_optimizer_s
from planner.specs import GIB, SpecError, TrainingSpec
from planner.targets import TARGETS, check_training
from tests.planner.resources.resource_specs import make_cluster, make_model

D, E, F, V = 64, 8, 96, 256
DENSE = 4 * D * D + D * E  # the hand model's attention + router (no norms)
EXPERT = 3 * D * F * E / 2  # gated experts over ep 2
PAR = ParallelConfig(pp=3, dp=4, ep=2, micro_batch=1, num_microbatches=4)


def _mid_state(**knobs) -> dict[str, float]:
    """The middle stage's weights, grads and optimizer bytes (one layer) under Megatron's 18 B
    accounting with the distributed optimizer and `knobs`."""
    model = make_model(layers=3, d=D, experts=E, ffn=F, vocab=V)
    tr = TrainingSpec(seq_len=8, zero=True, bytes_per_param=18, **knobs)
    mem = dict(estimate(model, make_cluster(), tr, PAR).stages[1].memory_gib)
    return {k: mem[k] * GIB for k in ("weights", "grads", "optimizer")}


def _sharded() -> float:
    return DENSE / PAR.dp + EXPERT / PAR.edp


def test_default_is_megatrons_formula():
    # theoretical_memory_usage.py: 6 + 12 / d bytes per parameter, d the data-parallel size
    # (edp for experts)
    s = _mid_state()
    total = DENSE * (6 + 12 / PAR.dp) + EXPERT * (6 + 12 / PAR.edp)
    assert s["weights"] + s["grads"] + s["optimizer"] == pytest.approx(total)


@pytest.mark.parametrize("f", [0.25, 0.5, 1.0])
def test_offload_keeps_the_device_share_at_hybrid_optimizers_12_bytes(f):
    # HybridDeviceOptimizer (param_update_in_fp32): the device's 1 - f share of the rank's
    # optimizer parameters holds an fp32 copy and fp32 m, v (12 B) whatever the moment dtype;
    # weights and the gradient buffer stay
    for moments in ("fp32", "bf16"):
        s = _mid_state(optimizer_offload_fraction=f, optimizer_dtype=moments)
        assert s["optimizer"] == pytest.approx(12 * (1 - f) * _sharded())
        assert s["weights"] == pytest.approx(2 * (DENSE + EXPERT))
        assert s["grads"] == pytest.approx(4 * (DENSE + EXPERT))
    # all offloaded: Megatron's formula without its 12 / d term
    s = _mid_state(optimizer_offload_fraction=1.0)
    assert sum(s.values()) == pytest.approx(6 * (DENSE + EXPERT))


def test_precision_aware_master_remainders_only_for_bf16_parameters():
    # TE FusedAdam store_param_remainders: 2 B master + m + v; FP8 / MX recipes keep fp32 main
    # params in Megatron-Core (use_precision_aware_optimizer_no_fp8_or_ds_fp8 is false)
    assert _mid_state(precision_aware_optimizer=True)["optimizer"] == pytest.approx(
        (2 + 8) * _sharded()
    )
    both = _mid_state(precision_aware_optimizer=True, optimizer_dtype="bf16")
    assert both["optimizer"] == pytest.approx((2 + 4) * _sharded())
    for dtype in ("fp8", "mxfp8"):
        tr = TrainingSpec(dtype=dtype, precision_aware_optimizer=True, optimizer_dtype="bf16")
        assert state_bytes(DENSE, EXPERT, tr, PAR).optimizer == pytest.approx(
            (4 + 4) * (DENSE + EXPERT)
        )


def test_bf16_gradient_buffer():
    # Megatron-Bridge's grad_reduce_in_fp32=False (--grad-reduce-in-bf16): 2 B per parameter
    # held, so the formula becomes 4 + 12 / d
    s = _mid_state(grad_dtype="bf16")
    assert s["grads"] == pytest.approx(2 * (DENSE + EXPERT))
    total = DENSE * (4 + 12 / PAR.dp) + EXPERT * (4 + 12 / PAR.edp)
    assert sum(s.values()) == pytest.approx(total)
    assert _mid_state(grad_dtype="fp32")["grads"] == pytest.approx(4 * (DENSE + EXPERT))


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"optimizer_offload_fraction": -0.1}, "optimizer_offload_fraction must be between 0"),
        ({"optimizer_offload_fraction": 1.5}, "optimizer_offload_fraction must be between 0"),
        ({"optimizer_offload_fraction": math.nan}, "optimizer_offload_fraction must be between"),
        ({"optimizer_offload_fraction": 0.5, "fsdp": True}, "not FSDP; drop fsdp or the offload"),
        ({"grad_dtype": "fp16"}, "grad_dtype 'fp16' is unknown; use fp32 or bf16"),
    ],
)
def test_spec_errors_are_one_line(knobs, words):
    with pytest.raises(SpecError) as err:
        TrainingSpec(**knobs)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("knobs", "flag"),
    [
        ({"optimizer_offload_fraction": 0.5}, "--optimizer-offload-fraction 0.5"),
        ({"precision_aware_optimizer": True}, "--precision-aware-optimizer True"),
        ({"grad_dtype": "bf16"}, "--grad-dtype bf16"),
        ({"activation_offload_modules": "expert_fc1"}, "--activation-offload-modules expert_fc1"),
    ],
)
def test_only_megatron_runs_them(knobs, flag):
    check_training(TrainingSpec(zero=True, **knobs), TARGETS["megatron"])
    for name in ("torchtitan", "piper"):
        with pytest.raises(SpecError, match=flag):
            check_training(TrainingSpec(**knobs), TARGETS[name])


def test_host_step_by_hand():
    # the slowest of gradient D2H, fp32 CPU Adam through host DRAM and weight H2D, per
    # offloaded parameter: on an H100 host (PCIe Gen5 64 GB/s, 76.8 GB/s of DDR5 per GPU)
    # Adam's 28 B through DRAM is the slowest
    cluster = load_cluster("h100")
    link = host_link(cluster)
    assert (link.link_gbps, link.dram_gbps) == (64.0, 76.8)
    par = ParallelConfig(pp=2, dp=4, ep=2, micro_batch=1, num_microbatches=4)
    held = [(1.0e9, 4.0e9), (2.0e9, 2.0e9)]
    tr = TrainingSpec(zero=True, bytes_per_param=18, optimizer_offload_fraction=0.5)
    per_param = max(4 / 64e9, ADAM_HOST_BYTES / 76.8e9, 2 / 64e9)
    assert ADAM_HOST_BYTES == 28
    want = 0.5 * max(1e9 / 4 + 4e9 / par.edp, 2e9 / 4 + 2e9 / par.edp) * per_param
    assert host_optimizer_s(held, cluster, tr, par) == pytest.approx(want)
    assert host_optimizer_s(held, cluster, TrainingSpec(zero=True), par) == 0.0
    # without the distributed optimizer each rank updates all it holds
    plain = TrainingSpec(bytes_per_param=18, optimizer_offload_fraction=1.0)
    assert host_optimizer_s(held, cluster, plain, par) == pytest.approx(5e9 * per_param)


def test_offload_lengthens_the_step_and_frees_the_device():
    model = make_model(layers=3, d=D, experts=E, ffn=F, vocab=V)
    cluster = load_cluster("h100")
    base = TrainingSpec(seq_len=8, zero=True, bytes_per_param=18)
    off = TrainingSpec(seq_len=8, zero=True, bytes_per_param=18, optimizer_offload_fraction=1.0)
    a, b = estimate(model, cluster, base, PAR), estimate(model, cluster, off, PAR)
    assert b.step_time_s > a.step_time_s
    assert all(dict(st.memory_gib)["optimizer"] == 0.0 for st in b.stages)
    assert max(b.memory_gib_per_stage) < max(a.memory_gib_per_stage)


def test_megatron_export_names_what_was_priced():
    from planner.outputs.export.megatron import _optimizer_args

    plan = SimpleNamespace(training={"zero": True, "optimizer_offload_fraction": 0.5,
                                     "grad_dtype": "bf16"})  # fmt: skip
    args = _optimizer_args(plan)
    assert args == ["--use-distributed-optimizer", "--overlap-grad-reduce",
                    "--overlap-param-gather", "--use-precision-aware-optimizer",
                    "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
                    "--overlap-cpu-optimizer-d2h-h2d", "--grad-reduce-in-bf16"]  # fmt: skip
    plain = _optimizer_args(SimpleNamespace(training={"zero": True}))
    assert plain == ["--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--overlap-param-gather"]  # fmt: skip
    exposed = _optimizer_args(SimpleNamespace(training={"zero": True, "grad_overlap": False}))
    assert exposed == ["--use-distributed-optimizer"]
    fsdp = _optimizer_args(SimpleNamespace(training={"fsdp": True}))
    assert fsdp[-2:] == ["--overlap-grad-reduce", "--overlap-param-gather"]
    assert _optimizer_args(SimpleNamespace(training={})) == []  # plain DDP: nothing priced
    both = {"optimizer_dtype": "bf16", "precision_aware_optimizer": True}
    pao = _optimizer_args(SimpleNamespace(training=both))
    assert pao.count("--use-precision-aware-optimizer") == 1
    acts = _optimizer_args(
        SimpleNamespace(training={"activation_offload_modules": "core_attn,moe_act"})
    )
    assert acts == ["--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                    "moe_act"]  # fmt: skip


# --- fine-grained activation offloading -------------------------------------------------------


def _components(model, training, par, recompute="none") -> dict[str, float]:
    return dict(layer_activations(model, model.layers[0], training, par, recompute).components)


def test_activation_offload_removes_each_modules_input_by_hand():
    # T = b s tokens, a = 2 B; MHA q/k/v/context d each, gated experts 3 x k T f
    model = make_model(layers=2, d=D, experts=E, top_k=2, ffn=F, vocab=V)
    par = ParallelConfig(pp=1, dp=2, ep=2, micro_batch=2, num_microbatches=2)
    t = 2 * 16
    base = TrainingSpec(seq_len=16)
    plain = _components(model, base, par)
    assert plain["dispatch"] == pytest.approx(2 * t * 2 * D)
    cases = {
        "expert_fc1": {"dispatch": 0.0},
        "moe_act": {"experts": plain["experts"] / 3},  # gate and up go, act(gate) * up stays
        "core_attn": {"qkv": 0.0},
        "attn_proj": {"context": 0.0},
        "attn_norm": {"attn_norm": 2 * t * D},  # the input goes, the norm output stays
        "qkv_linear": {"attn_norm": 2 * t * D},
        "mlp_norm": {"mlp_norm": 2 * t * D},
    }
    for module, changed in cases.items():
        got = _components(model, replace(base, activation_offload_modules=module), par)
        assert got == pytest.approx({**plain, **changed}), module
    both = replace(base, activation_offload_modules="attn_norm,qkv_linear")
    assert _components(model, both, par)["attn_norm"] == 0.0
    # with moe_act recomputed the activation output is already gone: offloading moe_act
    # leaves nothing of the expert intermediates
    rc = ParallelConfig(pp=1, dp=2, ep=2, micro_batch=2, num_microbatches=2,
                        recompute="selective", recompute_modules=("moe_act",))  # fmt: skip
    off = replace(base, activation_offload_modules="moe_act")
    assert _components(model, off, rc, "selective")["experts"] == pytest.approx(0.0)


def test_activation_offload_workspace_is_one_layers_moved_bytes():
    model = make_model(layers=4, d=D, experts=E, top_k=2, ffn=F, vocab=V)
    par = ParallelConfig(pp=2, dp=2, ep=2, micro_batch=1, num_microbatches=4)
    base = TrainingSpec(seq_len=16)
    off = replace(base, activation_offload_modules="expert_fc1,moe_act")
    moved = (
        layer_activations(model, model.layers[0], base, par).total
        - layer_activations(model, model.layers[0], off, par).total
    )
    assert offloaded_layer_bytes(model, model.layers[0], off, par, "none") == pytest.approx(moved)
    a, b = estimate(model, make_cluster(), base, par), estimate(model, make_cluster(), off, par)
    first_a, first_b = dict(a.stages[0].memory_gib), dict(b.stages[0].memory_gib)
    assert first_b["activation_offload"] * GIB == pytest.approx(moved)
    # stage 0 holds min(pp, m) = 2 micro-batches of its 2 layers
    assert (first_a["activations"] - first_b["activations"]) * GIB == pytest.approx(2 * 2 * moved)


def test_activation_offload_names_are_checked():
    with pytest.raises(SpecError, match="activation_offload_modules names 'fc2'"):
        TrainingSpec(activation_offload_modules="expert_fc1,fc2")


def test_pure_bf16_state_without_master_weights():
    # NeMo AutoModel's pure bf16 training: bf16 parameters updated in place, bf16 gradients
    # and bf16 Adam moments: the optimizer component is 4 B per parameter against 12 (fp32
    # master + fp32 m, v), the gradients 2 B against 4, the weights unchanged
    model = make_model(layers=3, d=D, experts=E, ffn=F, vocab=V)
    cluster = load_cluster("h100")
    base = TrainingSpec(seq_len=8, zero=True, bytes_per_param=18)
    pure = TrainingSpec(seq_len=8, zero=True, bytes_per_param=18, master_weights=False,
                        grad_dtype="bf16", optimizer_dtype="bf16")  # fmt: skip
    a, b = estimate(model, cluster, base, PAR), estimate(model, cluster, pure, PAR)
    for sa, sb in zip(a.stages, b.stages, strict=True):
        ma, mb = dict(sa.memory_gib), dict(sb.memory_gib)
        assert mb["optimizer"] == pytest.approx(ma["optimizer"] * 4 / 12)
        assert mb["grads"] == pytest.approx(ma["grads"] * 2 / 4)
        assert mb["weights"] == pytest.approx(ma["weights"])
    with pytest.raises(SpecError, match="master_weights"):
        TrainingSpec(master_weights=False, grad_dtype="bf16")  # fp32 moments
