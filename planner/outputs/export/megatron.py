"""Megatron-LM (Megatron-Core) command-line arguments for a plan, and what they cannot say.

The export is a bash file: the environment Megatron needs (CUDA_DEVICE_MAX_CONNECTIONS) and
an array MEGATRON_ARGS with the layout (tp, pp, cp, ep, etp, vp, batch sizes, sequence
parallel), recompute, the optimizer sharding (distributed optimizer or Megatron-FSDP), the
checkpoint interval (`--save-interval`), the precision recipe, the MoE dispatcher and
all-to-all overlap, and the model (planner.outputs.export.megatron_model). Tokenizer, data and
`--save DIR` flags are the user's.

Pipeline split: an even split needs no flag; an uneven one whose middle stages are equal uses
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`; any other split,
and every interleaved one whose virtual stages differ in size, uses
`--pipeline-model-parallel-layout` (E = embedding, t = layer, m = MTP, L = loss, '|' between
virtual stages in Megatron's order: virtual stage k = c * pp + s is chunk c of rank s).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from planner.outputs.export.describe import noncontiguous_expert_layers, plan_title
from planner.outputs.export.megatron_model import model_args
from planner.outputs.export.model_settings import model_settings
from planner.outputs.export.shell import comment, export_lines
from planner.parallel import memory_budget
from planner.plan.schema import Plan
from planner.run.layout import virtual_stages
from planner.size.checkpoint_interval import interval_or_reason
from planner.specs import ModelSpec, SpecError

# Megatron-Core release that introduced a flag (checked in the core_r0.13.0 .. core_r0.16.0
# branches of Megatron-LM); every other flag exported here exists since 0.13.
FLAG_SINCE = {
    "--overlap-moe-expert-parallel-comm": (0, 14),
    "--use-megatron-fsdp": (0, 14),
    "--softmax-type": (0, 15),
    "--glu-linear-offset": (0, 15),
    "--activation-func-clamp-value": (0, 15),
    "--window-attn-skip-freq": (0, 15),
    "--moe-flex-dispatcher-backend": (0, 16),
    "--cuda-graph-impl": (0, 15),
    "--cuda-graph-scope": (0, 15),
    "--fp4-format": (0, 15),
    "--fp4-recipe": (0, 15),
}
# CUDA graphs (TrainingSpec.cuda_graphs): the static modules per layer with Transformer
# Engine's graphs (the dropless experts stay eager), or the whole iteration with the local one
_CUDA_GRAPHS = {
    "partial": ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn",
                "moe_router", "moe_preprocess"],
    "full": ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
}  # fmt: skip
BASE_VERSION = (0, 13)
MTP_LAYOUT_VERSION = (0, 14)  # 'm' in --pipeline-model-parallel-layout
CHECKED_VERSION = "0.16"  # megatron-core in the tests, Megatron-LM core_r0.16.0 in the benchmark
# Precision recipes (planner/resources/precision.py): fp8 = per-tensor current scaling;
# Megatron-LM `megatron/core/transformer/transformer_config.py` fp8_recipe / fp4_recipe.
_PRECISION = {
    "bf16": ["--bf16"],
    "fp16": ["--fp16"],
    "fp32": [],
    "fp8": ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
    "mxfp8": ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
    "fp8_blockwise": ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
    "nvfp4": ["--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"],
}
# Megatron-Core's fp4_recipe is nvfp4 or custom (`megatron/core/enums.py` Fp4Recipe)
_NO_RECIPE = {
    "mxfp4": "Megatron-LM has no MXFP4 recipe (--fp4-recipe nvfp4|custom); ROCm's Megatron-LM "
    "fork runs it (--fp4-format e2m1 --fp4-recipe mxfp4): re-plan with --dtype nvfp4 or "
    "fp8_blockwise, or launch that fork by hand",
}


@dataclass(frozen=True)
class MegatronArgs:
    """Flags in order (flag, then its value when it takes one), the environment Megatron
    needs, notes for the user (what Megatron runs differently), the oldest Megatron-Core release
    with every flag, and comments for the file (where a value comes from)."""

    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]
    min_version: tuple[int, int]
    comments: tuple[str, ...] = ()


def layout_string(counts: list[int], mtp_layers: int) -> str:
    """Megatron's pipeline layout for layers per (virtual) stage `counts`, in stage order."""
    stages = ["t" * c for c in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_layers + "L"
    return "|".join(stages)


def pipeline_split_args(counts: list[int], mtp_layers: int) -> tuple[list[str], list[str]]:
    """Flags expressing layers per stage `counts` (vp = 1), and notes."""
    pp = len(counts)
    if pp == 1 or len(set(counts)) == 1:
        return [], []
    if pp == 2:
        return ["--decoder-first-pipeline-num-layers", str(counts[0])], []
    middle = counts[1:-1]
    if len(set(middle)) == 1:
        args = []
        if counts[0] != middle[0]:
            args += ["--decoder-first-pipeline-num-layers", str(counts[0])]
        if counts[-1] != middle[0]:
            args += ["--decoder-last-pipeline-num-layers", str(counts[-1])]
        return args, []
    note = f"middle pipeline stages hold unequal layer counts {counts}: a layout string"
    return ["--pipeline-model-parallel-layout", layout_string(counts, mtp_layers)], [note]


def virtual_split_args(plan: Plan, model: ModelSpec, mtp_layers: int) -> list[str]:
    """Interleaved 1F1B (vp > 1): layers per virtual stage, or a layout when they differ."""
    stages = [s.layers for s in sorted(plan.stages, key=lambda s: s.stage)]
    virtual = virtual_stages(stages, plan.parallel.vp, model.num_layers)
    counts = [len(v) for v in virtual]
    if len(set(counts)) == 1:
        return ["--num-layers-per-virtual-pipeline-stage", str(counts[0])]
    return ["--pipeline-model-parallel-layout", layout_string(counts, mtp_layers)]


def recompute_args(plan: Plan) -> tuple[list[str], list[str]]:
    """Recompute flags: the policy, Megatron's modules, per-stage full layers as the block
    method (Megatron applies selective recompute to every layer)."""
    stages = sorted(plan.stages, key=lambda s: s.stage)
    chosen = [len(s.recompute_layers) for s in stages]
    par = plan.parallel
    if par.recompute == "selective":
        modules = list(par.recompute_modules)
        if "op" in modules or memory_budget(tuple(modules)) is not None:
            raise SpecError(
                "plan.json: it recomputes with torchtitan's per-op selective AC or memory "
                f"budget (module '{modules[0]}'), which Megatron-LM does not run as priced; "
                "re-plan with --target megatron"
            )
        args = ["--recompute-granularity", "selective"]
        args += ["--recompute-modules", *modules] if modules else []
        layers = sum(len(s.layers) for s in stages)
        if any(chosen) and sum(chosen) < layers:
            return args, [f"the plan recomputes {modules or ['core_attn']} on {sum(chosen)} of "
                          f"{layers} layers; Megatron recomputes them on every layer"]  # fmt: skip
        return args, []
    every = sum(chosen) == sum(len(s.layers) for s in stages)
    if not any(chosen) or every:
        if par.recompute == "full":
            return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1"], []  # fmt: skip
        return [], []
    n = max(chosen)
    prefix = all(tuple(s.recompute_layers) == tuple(s.layers[: len(s.recompute_layers)])
                 for s in stages)  # fmt: skip
    notes = []
    if not (prefix and len(set(chosen)) == 1):
        notes.append(
            f"the plan recomputes {chosen} layers per stage; Megatron's block method recomputes "
            f"the first {n} layers of every stage (more recompute than planned)"
        )
    return ["--recompute-granularity", "full", "--recompute-method", "block",
            "--recompute-num-layers", str(n)], notes  # fmt: skip


def _parallel_args(plan: Plan) -> list[str]:
    p = plan.parallel
    gbs = p.dp * p.micro_batch * p.num_microbatches
    args = ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size", str(p.pp),
            "--context-parallel-size", str(p.cp), "--expert-model-parallel-size", str(p.ep),
            "--expert-tensor-parallel-size", str(p.etp),
            "--micro-batch-size", str(p.micro_batch), "--global-batch-size", str(gbs)]  # fmt: skip
    if p.tp > 1:  # the resource model splits tokens over tp (and Megatron wants it with MoE)
        args.append("--sequence-parallel")
    return args


def _optimizer_args(plan: Plan) -> list[str]:
    """Distributed optimizer or Megatron-FSDP (ZeRO-3) with the overlapped gradient reduction
    and parameter all-gather the plan was priced with, the Adam moments' dtype, the
    precision-aware optimizer, optimizer offload to the host, the gradient buffer's dtype and
    fine-grained activation offloading."""
    t = plan.training
    args = []
    if t.get("fsdp"):
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                 "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]  # fmt: skip
    elif t.get("zero"):
        args.append("--use-distributed-optimizer")
    if (t.get("fsdp") or t.get("zero")) and t.get("grad_overlap", True):
        # priced overlapped (resources/schedule.py); Megatron-LM's defaults are off
        args += ["--overlap-grad-reduce", "--overlap-param-gather"]
    offload = t.get("optimizer_offload_fraction") or 0.0
    bf16_moments = t.get("optimizer_dtype") == "bf16"
    if bf16_moments or offload or t.get("precision_aware_optimizer"):
        args.append("--use-precision-aware-optimizer")  # offload needs it (arguments.py)
    if bf16_moments:
        args += ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    if offload:
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", f"{offload:g}",
                 "--overlap-cpu-optimizer-d2h-h2d"]  # fmt: skip
    if t.get("grad_dtype") == "bf16":
        args.append("--grad-reduce-in-bf16")
    if t.get("activation_offload_modules"):
        modules = t["activation_offload_modules"].split(",")
        args += ["--fine-grained-activation-offloading", "--offload-modules", *modules]
    return args


def _checkpoint_args(plan: Plan) -> tuple[list[str], list[str], list[str]]:
    """(flags, notes, comments): `--save-interval N`, the interval that minimises lost time
    with Megatron's blocking save (planner.size.checkpoint_interval), and the comment naming
    its inputs; without an interval (a plan with no step time) no flag and a note saying why.
    The megatron target is priced blocking, Megatron-LM's default, so `--async-save` is not
    written (it runs with --ckpt-format torch_dist only, and Megatron-LM main turns it off
    without --use-persistent-ckpt-worker: arguments.py validate_args)."""
    interval, why = interval_or_reason(plan, target="megatron")
    if interval is None:
        return [], [f"no --save-interval: {why}"], []
    line = (f"--save-interval {interval.steps}: the checkpoint interval that minimises lost time, "
            f"{interval.inputs()}; Megatron saves only with --save DIR (yours to add)")  # fmt: skip
    return ["--save-interval", str(interval.steps)], [], [line]


def _moe_comm_args(plan: Plan, model: ModelSpec) -> tuple[list[str], list[str]]:
    """The token dispatcher (plan.extra['dispatcher']) and the 1F1B all-to-all overlap."""
    if model.first_moe is None:
        return [], []
    dispatcher = plan.extra.get("dispatcher", "flat")
    notes = []
    if dispatcher == "deepep":
        args = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
    else:
        args = ["--moe-token-dispatcher-type", "alltoall"]
        if dispatcher in ("halo", "halo-dedup"):
            notes.append(
                f"Piper's {dispatcher} dispatch is not in Megatron: alltoall is exported; the "
                "flex dispatcher with DeepEP is its node-deduplicated counterpart"
            )
    if plan.training.get("a2a_overlap"):
        refused = _overlap_refused(plan)
        if refused:
            notes.append(f"Megatron refuses the 1F1B all-to-all overlap with {refused}: "
                         "exported without it (the plan's step time assumes it)")  # fmt: skip
        else:
            args += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
        if plan.parallel.pp > 1 and plan.parallel.vp == 1:
            notes.append("Megatron overlaps the all-to-all with pp > 1 only under interleaved "
                         "1F1B (vp > 1); re-plan with --vp or drop --a2a-overlap")  # fmt: skip
    return args, notes


def _overlap_refused(plan: Plan) -> str:
    """What in the plan Megatron's overlap refuses (transformer_config.py: no full recompute,
    no 'moe' module recompute), or ''."""
    par = plan.parallel
    if par.recompute == "full" or (par.recompute != "selective" and
                                   any(s.recompute_layers for s in plan.stages)):  # fmt: skip
        return "full recompute"
    if par.recompute == "selective" and "moe" in par.recompute_modules:
        return "the 'moe' recompute module"
    return ""


def megatron_env(plan: Plan) -> tuple[tuple[str, str], ...]:
    """CUDA_DEVICE_MAX_CONNECTIONS: 1 keeps TP/CP communication ahead of compute (Megatron's
    validate_args asserts it on Hopper); FSDP and the all-to-all overlap need more streams
    (32, as Megatron's MoE recipes set for --overlap-moe-expert-parallel-comm)."""
    t = plan.training
    many = t.get("fsdp") or (t.get("a2a_overlap") and plan.parallel.ep > 1)
    return (("CUDA_DEVICE_MAX_CONNECTIONS", "32" if many else "1"),)


def min_version(args: list[str]) -> tuple[int, int]:
    """The oldest Megatron-Core release that has every flag in `args`."""
    versions = [FLAG_SINCE.get(a, BASE_VERSION) for a in args if a.startswith("--")]
    layout = [args[i + 1] for i, a in enumerate(args) if a == "--pipeline-model-parallel-layout"]
    if any("m" in lay for lay in layout):
        versions.append(MTP_LAYOUT_VERSION)
    return max(versions, default=BASE_VERSION)


def megatron_args(plan: Plan, model: ModelSpec) -> MegatronArgs:
    """All Megatron-LM flags for `plan` (layout, recompute, optimizer, precision, MoE, model)."""
    p, training = plan.parallel, plan.training
    gbs = p.dp * p.micro_batch * p.num_microbatches
    notes = []
    if training.get("global_batch") not in (None, gbs):
        notes.append(f"global batch is dp*micro_batch*num_microbatches = {gbs} as planned, not "
                     f"the requested {training['global_batch']}")  # fmt: skip
    mtp = training.get("mtp_layers")
    mtp_layers = model.num_mtp_layers if mtp is None else int(mtp)
    if p.vp > 1:
        split, split_notes = virtual_split_args(plan, model, mtp_layers), []
    else:
        counts = [len(s.layers) for s in sorted(plan.stages, key=lambda s: s.stage)]
        split, split_notes = pipeline_split_args(counts, mtp_layers)
    rc, rc_notes = recompute_args(plan)
    seq_len = int(training.get("seq_len", 4096))
    settings = model_settings(plan, model)
    margs, mnotes = model_args(model, settings, seq_len, mtp_layers)
    if not settings.source:
        notes.append(f"no HF config found for '{plan.model.source or plan.model.name}': rotary, "
                     "norm and router settings are the family's defaults")  # fmt: skip
    comm, comm_notes = _moe_comm_args(plan, model)
    precision = precision_args(plan, model)
    graphs = _CUDA_GRAPHS.get(str(training.get("cuda_graphs")), [])
    save, save_notes, save_lines = _checkpoint_args(plan)
    args = _parallel_args(plan) + split + rc + _optimizer_args(plan) + save + precision + comm
    args += graphs + margs
    notes += split_notes + rc_notes + comm_notes + mnotes + _placement_notes(plan) + save_notes
    notes.append(f"tokenizer and data flags are yours to add (vocab_size {model.vocab_size})")
    return MegatronArgs(
        tuple(args), megatron_env(plan), tuple(notes), min_version(args), tuple(save_lines)
    )


def precision_args(plan: Plan, model: ModelSpec) -> list[str]:
    """The precision recipe's flags and the layers it keeps in bf16 (`--first-last-layers-bf16`,
    at most num_layers // pp at each end: Megatron's TransformerConfig check); SpecError for a
    dtype Megatron-LM has no recipe for."""
    t = plan.training
    dtype = str(t.get("dtype", "bf16"))
    if dtype in _NO_RECIPE:
        raise SpecError(f"plan.json: it is priced in {dtype}; {_NO_RECIPE[dtype]}")
    args = list(_PRECISION.get(dtype, ["--bf16"]))
    start, end = int(t.get("bf16_layers_start", 0)), int(t.get("bf16_layers_end", 0))
    if not (start or end):
        return args
    most = model.num_layers // plan.parallel.pp
    if max(start, end) > most:
        raise SpecError(
            f"plan.json: it keeps {start} first and {end} last layers in bf16 and Megatron "
            f"allows at most num_layers // pp = {most} at each end; re-plan with fewer"
        )
    return args + ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(start),
                   "--num-layers-at-end-in-bf16", str(end)]  # fmt: skip


def _placement_notes(plan: Plan) -> list[str]:
    notes = []
    p = plan.parallel
    permuted = noncontiguous_expert_layers(plan)
    if permuted:
        notes.append(
            f"{permuted} of {len(plan.experts)} MoE layers use a non-contiguous expert placement; "
            "Megatron puts expert e on EP rank e // (E/ep): permute the experts in the checkpoint"
        )
    moved = [r.rank for r in plan.ranks
             if r.rank != r.tp + p.tp * (r.cp + p.cp * (r.dp + p.dp * r.stage))]  # fmt: skip
    if moved:
        notes.append(
            f"{len(moved)} ranks differ from Megatron's tp-cp-dp-pp rank order; launch with "
            "the slurm export's hostfile so each rank lands on the node the plan chose"
        )
    return notes


def megatron_script(plan: Plan, model: ModelSpec) -> tuple[str, tuple[str, ...]]:
    """The bash file of Megatron-LM flags for `plan` (notes as comments) and the notes."""
    m = megatron_args(plan, model)
    return render_megatron(plan, m), m.notes


def render_megatron(plan: Plan, m: MegatronArgs) -> str:
    """A bash file exporting Megatron's environment and defining MEGATRON_ARGS; use: source
    it, then `torchrun ... pretrain_gpt.py "${MEGATRON_ARGS[@]}" <tokenizer and data flags>`."""
    version = ".".join(map(str, m.min_version))
    lines = [
        comment(f"Megatron-LM arguments for {plan_title(plan)}"),
        "# generated by 'piper export'; source it, then run",
        '#   torchrun ... pretrain_gpt.py "${MEGATRON_ARGS[@]}" <tokenizer and data flags>',
        f"# needs Megatron-Core >= {version} (checked with {CHECKED_VERSION})",
    ]
    lines += [comment(f"NOTE: {n}") for n in m.notes]
    lines += [comment(c) for c in m.comments]
    lines += export_lines(dict(m.env), "export: Megatron environment")
    lines.append("MEGATRON_ARGS=(")
    args = m.args
    i = 0
    while i < len(args):
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        lines.append("  " + " ".join(shlex.quote(v) for v in args[i:j]))
        i = j
    lines.append(")")
    return "\n".join(lines) + "\n"
