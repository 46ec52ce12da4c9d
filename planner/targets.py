"""The training engines a plan is made for: what each executes and how it keeps its state.

A plan is only worth what the run that executes it does, so `piper plan`, `piper estimate`
and `piper export` take `--target megatron|torchtitan|piper`. Each target is one `Target`
row: its conventions (bytes per parameter of training state, where the router weights are
applied, whether recompute is chosen per layer) and its capabilities (what the search may
offer). The search offers only what the target executes and prices it as the engine runs
it; an export of a plan made for another target refuses the settings it cannot carry.
planner/EXPORT.md ("Targets") gives each row's source, file and line in the engines' code.

Shape of the vocabulary: `Sharding` "none" | "zero" (distributed optimizer) | "fsdp";
dispatchers "flat" | "halo" | "halo-dedup" | "deepep" (the search's names); recompute "none" |
"selective" | "full"; etp rule "any" (etp divides the expert FFN) or "one_or_tp" (etp is tp
without expert parallelism, 1 with it: `etp_allowed`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

from planner.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec

TargetName = Literal["piper", "megatron", "torchtitan"]
TARGET_NAMES: tuple[TargetName, ...] = get_args(TargetName)
DEFAULT_TARGET: TargetName = "piper"
# torchtitan's memory budgets as recompute modules: planner.parallel.BUDGET_MODULES (a sibling
# room, not imported here; tests/planner/search/test_targets_budget.py holds the two equal)
TITAN_BUDGETS = tuple(f"budget:{i / 20:g}" for i in range(21))


@dataclass(frozen=True)
class Target:
    """One engine's capability table and conventions.

    bytes_per_param: weight + gradient + optimizer bytes per parameter before sharding
        (16: bf16 weight, bf16 gradient, fp32 master and two fp32 moments, or fp32 weight,
        fp32 gradient and two fp32 moments; 18: Megatron-Core's bf16 weight, fp32 main
        gradient, fp32 main weight and two fp32 moments).
    gate_in_activation: the router weights multiply inside the expert activation (or before
        the experts), so the combine keeps no expert outputs for the gate's gradient.
    per_layer_recompute: recompute may differ from layer to layer (the stage IP's choice);
        False = the policy applies to every layer of the model.
    recompute_modules: the selective-recompute modules the engine reruns, the first the one
        set the search tries (None = the search's Megatron-Core module sets; "op" =
        torchtitan's per-op SAC, planner.resources.op_sac; "budget:<b>" = its memory-budget
        AC, planner.resources.memory_budget, each alone).
    etp_rule: "any" or "one_or_tp" (expert TP is 1 or the attention TP).
    """

    name: TargetName
    engine: str
    version: str  # the release whose code the table was checked against
    bytes_per_param: int
    gate_in_activation: bool
    per_layer_recompute: bool
    recompute: tuple[str, ...]
    recompute_modules: tuple[str, ...] | None
    sharding: tuple[str, ...]
    a2a_overlap: bool
    dispatchers: tuple[str, ...]
    cuda_graphs: tuple[str, ...]
    dtypes: tuple[str, ...]
    optimizer_dtypes: tuple[str, ...]
    vp: bool
    cp: bool
    etp_rule: Literal["any", "one_or_tp"]
    expert_placement: bool  # a planned (non-contiguous) expert placement and replicas
    mtp: bool
    uneven_stages: bool
    default_sharding: str  # what `piper estimate` prices when neither --zero nor --fsdp is given
    # (family, layers, hidden) of the models the engine builds itself; None = any model
    native_models: tuple[tuple[str, int, int], ...] | None = None
    # families the engine builds from its own modules through the export's config module
    # (planner/outputs/export/torchtitan_model.py), when every layer is of a shape they have
    composed_families: tuple[str, ...] = ()
    # FSDP under the engine's pipelining keeps units unsharded through a step's micro-batches
    # (TrainingSpec.fsdp_hold_unsharded)
    fsdp_pp_holds_unsharded: bool = False
    # the dtype its FSDP reduce-scatters gradients in (TrainingSpec.fsdp_reduce_dtype; None:
    # the model's gradient dtype, Megatron-FSDP's default)
    fsdp_reduce_dtype: str | None = None

    def offers(self, what: str, value: object) -> bool:
        """True when `value` is among the target's choices for `what` (a field name)."""
        return value in getattr(self, what)


TARGETS: dict[TargetName, Target] = {
    "piper": Target(
        name="piper", engine="Piper's runtime (piper run)", version="(this checkout)",
        # bf16: fp32 parameters (the master), fp32 gradients, fp32 Adam moments and the bf16
        # copies a step computes with (runtime/RUNTIME.md "Precision"): Megatron's 18 B
        bytes_per_param=18, gate_in_activation=False, per_layer_recompute=True,
        recompute=("none", "selective", "full"), recompute_modules=("core_attn",),
        sharding=("none", "fsdp"), a2a_overlap=False,
        dispatchers=("flat", "halo", "halo-dedup"),
        cuda_graphs=("none",), dtypes=("bf16", "fp32"), optimizer_dtypes=("fp32",),
        vp=True, cp=False, etp_rule="any", expert_placement=True, mtp=True,
        uneven_stages=True, default_sharding="none",
        # FSDP2 with MixedPrecisionPolicy(reduce_dtype=float32) (runtime/parallel/fsdp.py)
        fsdp_reduce_dtype="fp32",
    ),
    "megatron": Target(
        name="megatron", engine="Megatron-LM (Megatron-Core)", version="core 0.16",
        bytes_per_param=18, gate_in_activation=True, per_layer_recompute=False,
        recompute=("none", "selective", "full"), recompute_modules=None,
        sharding=("none", "zero", "fsdp"), a2a_overlap=True, dispatchers=("flat", "deepep"),
        cuda_graphs=("none", "partial", "full"),
        # Megatron-LM's recipes: --fp8-recipe delayed/tensorwise/mxfp8/blockwise and
        # --fp4-recipe nvfp4 (megatron/training/arguments.py); no MXFP4 recipe upstream
        dtypes=("bf16", "fp16", "fp8", "mxfp8", "fp8_blockwise", "nvfp4", "fp32"),
        optimizer_dtypes=("fp32", "bf16"), vp=True, cp=True, etp_rule="any",
        expert_placement=False, mtp=True, uneven_stages=True, default_sharding="zero",
    ),
    "torchtitan": Target(
        name="torchtitan", engine="torchtitan", version="0.3.0",
        bytes_per_param=16, gate_in_activation=False, per_layer_recompute=False,
        # activation_checkpoint none | selective (per-op SAC of every block) | full |
        # memory-budget (torchtitan/distributed/activation_checkpoint.py @b5bcd76:
        # SelectiveAC, FullAC, MemoryBudgetAC; the budget exported with torch.compile)
        recompute=("none", "selective", "full"), recompute_modules=("op", *TITAN_BUDGETS),
        sharding=("fsdp",), a2a_overlap=False, dispatchers=("flat",),
        cuda_graphs=("none",), dtypes=("bf16", "fp32"),
        optimizer_dtypes=("fp32", "bf16"), vp=True, cp=True, etp_rule="one_or_tp",
        expert_placement=False, mtp=False, uneven_stages=True, default_sharding="fsdp",
        # torchtitan 0.3's own models (models/*/config_registry.py); other GQA MoE models of
        # these families are composed from its Qwen3 MoE modules (planner/EXPORT.md)
        native_models=(("deepseek_v3", 61, 7168), ("deepseek_v2", 27, 2048),
                       ("qwen3_moe", 48, 2048), ("gpt_oss", 24, 2880), ("gpt_oss", 36, 2880),
                       ("llama", 32, 4096)),
        composed_families=("mixtral", "llama4", "qwen3_moe", "moe"),
        # torchtitan's default reshard policy with pp (torchtitan/distributed/fsdp.py
        # get_fsdp_reshard_after_forward_policy: "For PP, by default do not reshard after
        # forward to avoid per-microbatch all-gathers") on torch pipelining
        fsdp_pp_holds_unsharded=True,
        # FSDP2 MixedPrecisionPolicy(reduce_dtype=float32): torchtitan's only
        # mixed_precision_reduce (torchtitan/config/configs.py:102 @b5bcd76)
        fsdp_reduce_dtype="fp32",
    ),
}  # fmt: skip


def get_target(name: str) -> Target:
    """The Target named `name`; an unknown name is one SpecError line."""
    if name not in TARGETS:
        raise SpecError(f"--target {name} is unknown; use {'|'.join(TARGET_NAMES)}")
    return TARGETS[name]  # type: ignore[index]


def etp_allowed(rule: str, etp: int, tp: int, ep: int) -> bool:
    """Whether an engine with etp `rule` runs expert TP `etp` beside attention TP `tp` and EP
    `ep`. "one_or_tp" (torchtitan 0.3, which has no expert-TP degree of its own): tp without
    expert parallelism (the experts TP-sharded on the dense axis), 1 with it (sharded on the
    expert dimension); torchtitan/models/common/moe_sharding.py:29-68, 194-219
    (planner/EXPORT.md, "Targets")."""
    if rule != "one_or_tp":
        return True
    return etp == (tp if ep == 1 else 1)


def with_conventions(training: TrainingSpec, target: Target) -> TrainingSpec:
    """`training` with the target's state accounting, router-weight convention and recompute
    granularity; an engine without MTP trains none and one without CUDA graphs runs eager
    (where the user left those to the defaults)."""
    mtp = training.mtp_layers
    graphs = training.cuda_graphs
    return replace(
        training,
        bytes_per_param=target.bytes_per_param,
        gate_in_activation=target.gate_in_activation,
        uniform_recompute=not target.per_layer_recompute,
        mtp_layers=0 if mtp is None and not target.mtp else mtp,
        cuda_graphs="none" if graphs is None and target.cuda_graphs == ("none",) else graphs,
        fsdp_hold_unsharded=target.fsdp_pp_holds_unsharded,
        fsdp_reduce_dtype=target.fsdp_reduce_dtype,
    )


def refuse(target: Target, flag: str, value: object, what: str) -> None:
    """Raise one SpecError line when `value` (given as `flag`) is not among `what`."""
    if not target.offers(what, value):
        others = [n for n in TARGET_NAMES if TARGETS[n].offers(what, value)]
        fix = f"use --target {others[0]}" if others else "choose another value"
        raise SpecError(
            f"{flag} {value}: {target.engine} {target.version} does not run it (it offers "
            f"{', '.join(map(str, getattr(target, what)))}); drop it or {fix}"
        )


def check_training(training: TrainingSpec, target: Target) -> None:
    """Refuse training settings the target cannot run (dtype, Adam moments, CUDA graphs,
    MTP), each in one SpecError line naming the flag and the fix."""
    refuse(target, "--dtype", training.dtype, "dtypes")
    refuse(target, "--optimizer-dtype", training.optimizer_dtype, "optimizer_dtypes")
    if training.cuda_graphs is not None:
        refuse(target, "--cuda-graphs", training.cuda_graphs, "cuda_graphs")
    if training.mtp_layers and not target.mtp:
        raise SpecError(
            f"--mtp-layers {training.mtp_layers}: {target.engine} {target.version} trains no "
            "MTP layers; give --mtp-layers 0 or use --target megatron"
        )
    _check_optimizer_state(training, target)


# Memory settings only Megatron-Core runs (HybridDeviceOptimizer, Transformer Engine's
# precision-aware FusedAdam, --grad-reduce-in-bf16, fine-grained activation offloading):
# (flag, TrainingSpec field, default).
MEGATRON_OPTIMIZER_STATE = (
    ("--optimizer-offload-fraction", "optimizer_offload_fraction", 0.0),
    ("--precision-aware-optimizer", "precision_aware_optimizer", False),
    ("--grad-dtype", "grad_dtype", None),
    ("--activation-offload-modules", "activation_offload_modules", ""),
)


def _check_optimizer_state(training: TrainingSpec, target: Target) -> None:
    if target.name == "megatron":
        return
    for flag, name, default in MEGATRON_OPTIMIZER_STATE:
        value = getattr(training, name)
        if value != default:
            raise SpecError(
                f"{flag} {value}: {target.engine} {target.version} does not run it (Megatron-Core "
                "does); drop it or use --target megatron"
            )


# The default memory margin: the memory model's error on runs that reported their peak
# (planner/PLANNING.md, "Memory headroom"; results/memory_margin.md).
DEFAULT_MEMORY_MARGIN = "4%"


def default_target(cluster: ClusterSpec) -> TargetName:
    """The engine a cluster's plans are for when --target is not given: Piper's runtime on an
    emulated (CPU, gloo) cluster, where no GPU engine runs; Megatron-Core elsewhere, the
    engine the presets' constants were fitted on."""
    return "piper" if cluster.topology == "emulated" else "megatron"


def memory_margin_gib(text: str, memory_gib: float, overhead_gib: float = 0.0) -> float:
    """`--memory-margin` as GiB: "4" or "4GiB" is GiB, "5%" a share of device memory. It must
    leave something of the device's memory after the framework overhead (`overhead_gib`)."""
    raw = text.strip()
    try:
        if raw.endswith("%"):
            value = float(raw[:-1]) / 100.0 * memory_gib
        else:
            value = float(raw.removesuffix("GiB").removesuffix("gib").strip())
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < memory_gib:
        raise SpecError(
            f"--memory-margin {text}: give GiB (e.g. 4) or a share of device memory (e.g. "
            f"5%), at least 0 and below the device's {memory_gib:.1f} GiB"
        )
    if value >= memory_gib - overhead_gib:
        raise SpecError(
            f"--memory-margin {text}: {value:.1f} GiB kept free and the cluster's "
            f"{overhead_gib:.1f} GiB framework overhead leave nothing of the device's "
            f"{memory_gib:.1f} GiB; give less than {memory_gib - overhead_gib:.1f} GiB "
            f"({(memory_gib - overhead_gib) / memory_gib:.0%})"
        )
    return value


def not_composable(model: ModelSpec) -> str:
    """Why a torchtitan config module cannot compose `model` from torchtitan's grouped-query
    attention, RMSNorm, SwiGLU and MoE modules ("" when it can): one attention shape, one MoE
    shape and one dense width for every layer, no biases, sinks, sliding windows or MLA."""
    moe = model.first_moe
    if moe is None:
        return "it has no MoE layer"
    first = model.layers[0].attention
    dense = {layer.dense_ffn for layer in model.layers if layer.moe is None}
    for i, layer in enumerate(model.layers):
        a, m = layer.attention, layer.moe
        if a != first or (m is not None and m != moe):
            return f"layer {i} differs from layer 0 in shape"
        if m is not None and layer.dense_ffn:
            return f"layer {i} has a dense MLP beside its experts"
        if a.kind == "mla" or a.bias or a.o_bias or a.sinks or a.sliding_window:
            return f"layer {i}'s attention has MLA, biases, sinks or a sliding window"
        if not layer.dense_gated or (
            m is not None and (not m.gated or m.expert_bias or m.router_bias or m.shared_gate)
        ):
            return f"layer {i} has an ungated MLP, expert or router biases or a shared gate"
    if len(dense) > 1:
        return "its dense layers differ in width"
    return ""


def check_model(model: ModelSpec, target: Target) -> None:
    """Refuse, in one line, a model the target does not build as Piper prices it."""
    if target.native_models is None:
        return
    key = (model.family, model.num_layers, model.hidden_size)
    if key in target.native_models:
        return
    why = (not_composable(model) if model.family in target.composed_families
           else f"its family is none of {', '.join(target.composed_families)}")  # fmt: skip
    if why:
        raise SpecError(
            f"--target {target.name}: {target.engine} {target.version} has no model of its own "
            f"for {model.name} ({model.family}, {model.num_layers} layers, hidden "
            f"{model.hidden_size}) and cannot compose it from its modules ({why}); plan with "
            "--target megatron or --target piper"
        )
