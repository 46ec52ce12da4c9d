"""torchtitan 0.3 command-line arguments for a plan, and what they cannot say.

torchtitan 0.3 reads its job from `--module M --config F` (a model package and one of its
`config_registry` functions, which fix the model's shapes) plus `--section.key value`
overrides, parsed by its ConfigManager (`torchtitan/config/manager.py`, tyro). The export is
a bash file defining `TORCHTITAN_ARGS=( ... )`; use: `torchrun ... -m torchtitan.train
"${TORCHTITAN_ARGS[@]}"`.

Mapping (torchtitan's ParallelismConfig / TrainingConfig, `torchtitan/config/configs.py`):
- dp = data_parallel_replicate_degree x data_parallel_shard_degree; torchtitan shards
  parameters with FSDP (ZeRO-3). With ZeRO or FSDP the whole dp is sharded; without, the
  shard degree is the least divisor of dp with ep | shard * cp * tp (torchtitan borrows its
  expert-parallel ranks from shard, cp and tp) and the rest is replicated (HSDP).
- local_batch_size is per data-parallel rank per gradient-accumulation step; with pp > 1 it
  holds all of a step's micro-batches (split by pipeline_parallel_microbatch_size), with
  pp = 1 it is one micro-batch and torchtitan accumulates num_microbatches of them.
- Pipeline stages become module_fqns_per_model_part (tok_embeddings on the first, norm and
  lm_head on the last), pp * vp parts in virtual order for Interleaved1F1B.
- A memory budget (the plan's recompute module "budget:<b>", planner.resources.memory_budget)
  becomes `activation_checkpoint:memory-budget --activation_checkpoint.memory_budget b` with
  `--compile.enable --compile.components model,loss`: torchtitan's Trainer.Config refuses the
  policy unless the model is compiled (torchtitan/trainer.py:159-165); the compiled region's
  fusions are not priced (the target is priced eager), only the partitioner's choice.
- Checkpoints are on, every N steps (`--checkpoint.enable --checkpoint.interval N`,
  torchtitan's checkpoint Config in components/checkpointer/base.py; off by default), N the
  interval that minimises lost time with torchtitan's blocking save
  (planner.size.checkpoint_interval; `checkpoint.async_mode` stays "disabled", as the
  torchtitan target is priced); a comment names its inputs. A plan without a predicted step
  time gets neither flag, and a note saying why.
- CUDA graphs are turned off (`--training.disable_cuda_graphs`): torchtitan captures the whole
  forward and backward by default where it can (pp = 1, and ep = 1 with the standard
  all-to-all: torchtitan/trainer.py `_validate_cuda_graphs`), but the torchtitan target is
  priced eager (planner/targets.py: its cuda_graphs are "none").
- A model torchtitan 0.3 has no config function for (Mixtral, Llama-4, other shapes of
  Qwen3 MoE) is composed from torchtitan's own modules by a config module the export writes
  beside the args file (planner/outputs/export/torchtitan_model.py); the args file names it
  with `--module` and puts its folder on PYTHONPATH. Other models are refused in one line
  (planner/targets.py, `check_model`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from planner.outputs.export.describe import noncontiguous_expert_layers, plan_title
from planner.outputs.export.shell import comment
from planner.outputs.export.torchtitan_model import TORCHTITAN_VERSION, composed_module
from planner.parallel import divisors, memory_budget
from planner.plan.schema import Plan
from planner.run.layout import virtual_stages
from planner.size.checkpoint_interval import interval_or_reason
from planner.specs import ModelSpec, SpecError
from planner.targets import TARGETS, check_model


@dataclass(frozen=True)
class TitanModel:
    """A torchtitan model package and its config function for one model (shapes fixed)."""

    module: str
    config: str
    fp8_config: str = ""  # the config function with FP8 converters, where one exists


# (Piper family, layers, hidden) -> torchtitan 0.3's own model (models/*/config_registry.py).
TITAN_MODELS = {
    ("deepseek_v3", 61, 7168): TitanModel(
        "deepseek_v3", "deepseek_v3_671b", "deepseek_v3_671b_float8"
    ),  # fmt: skip
    ("deepseek_v2", 27, 2048): TitanModel("deepseek_v3", "deepseek_v3_16b"),
    ("qwen3_moe", 48, 2048): TitanModel("qwen3", "qwen3_30b_a3b"),
    ("gpt_oss", 24, 2880): TitanModel("gpt_oss", "gpt_oss_20b"),
    ("gpt_oss", 36, 2880): TitanModel("gpt_oss", "gpt_oss_120b"),
    ("llama", 32, 4096): TitanModel("llama3", "llama3_8b"),
}
_TITAN_DTYPES = {"fp32": "float32"}  # everything else trains with bf16 parameters


def titan_model(plan: Plan, model: ModelSpec) -> tuple[list[str], list[str], dict[str, str]]:
    """`--module/--config` for the plan's model, notes, and the files the export writes beside
    the args file (file name -> text: the config module of a composed model)."""
    native = TITAN_MODELS.get((model.family, model.num_layers, model.hidden_size))
    fp8 = str(plan.training.get("dtype", "bf16")) in ("fp8", "mxfp8")
    if native is not None:
        config = native.fp8_config if fp8 and native.fp8_config else native.config
        notes = []
        if fp8 and not native.fp8_config:
            notes.append("torchtitan sets FP8 in the config function's model converters and "
                         f"{native.module} has none for this model: it trains in bf16")  # fmt: skip
        elif fp8:
            notes.append("torchtitan's FP8 converter scales row-wise, not Megatron's recipe")
        return ["--module", native.module, "--config", config], notes, {}
    check_model(model, TARGETS["torchtitan"])
    module, function, text, notes = composed_module(plan, model)
    return ["--module", module, "--config", function], list(notes), {f"{module}.py": text}


def shard_degree(dp: int, cp: int, tp: int, ep: int, sharded: bool) -> int:
    """FSDP degree: all of dp when Piper shards (ZeRO / FSDP), else the least that lets ep
    fit in shard * cp * tp (torchtitan's rule dp_shard * cp * tp == efsdp * ep)."""
    if sharded:
        return dp
    return next((s for s in divisors(dp) if (s * cp * tp) % ep == 0), dp)


def _stage_fqns(plan: Plan, model: ModelSpec) -> list[list[str]]:
    """torchtitan module names per (virtual) pipeline stage, in stage order."""
    stages = [s.layers for s in sorted(plan.stages, key=lambda s: s.stage)]
    virtual = virtual_stages(stages, plan.parallel.vp, model.num_layers)
    parts = [[f"layers.{i}" for i in layers] for layers in virtual]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "lm_head"]
    return parts


def _parallelism(plan: Plan, model: ModelSpec, shard: int) -> list[str]:
    p = plan.parallel
    schedule = "Interleaved1F1B" if p.vp > 1 else "1F1B"
    args = ["--parallelism.data_parallel_replicate_degree", str(p.dp // shard),
            "--parallelism.data_parallel_shard_degree", str(shard),
            "--parallelism.tensor_parallel_degree", str(p.tp),
            "--parallelism.context_parallel_degree", str(p.cp),
            "--parallelism.pipeline_parallel_degree", str(p.pp),
            "--parallelism.pipeline_parallel_schedule", schedule,
            "--parallelism.pipeline_parallel_microbatch_size", str(p.micro_batch),
            "--parallelism.expert_parallel_degree", str(p.ep)]  # fmt: skip
    if p.pp > 1:
        args += ["--parallelism.module_fqns_per_model_part"]
        args += [",".join(part) for part in _stage_fqns(plan, model)]
    return args


def _training(plan: Plan) -> list[str]:
    p, t = plan.parallel, plan.training
    per_step = p.micro_batch * p.num_microbatches
    local = per_step if p.pp > 1 else p.micro_batch
    args = ["--training.local_batch_size", str(local),
            "--training.global_batch_size", str(p.dp * per_step),
            "--training.seq_len", str(int(t.get("seq_len", 4096))),
            "--training.mixed_precision_param",
            _TITAN_DTYPES.get(str(t.get("dtype", "bf16")), "bfloat16")]  # fmt: skip
    args.append("--training.disable_cuda_graphs")  # priced eager (the module docstring)
    if t.get("optimizer_dtype") == "bf16":
        args += ["--optimizer.implementation", "fused_opt_states_bf16"]
    return args


def _checkpoint(plan: Plan) -> tuple[list[str], list[str], list[str]]:
    """(flags, notes, comments): the checkpoint flags (module docstring) and the comment
    naming the interval's inputs, or no flags and the note saying why there is no interval."""
    interval, why = interval_or_reason(plan, target="torchtitan")
    if interval is None:
        return [], [f"checkpoints stay off: {why}"], []
    line = (f"--checkpoint.interval {interval.steps}: the checkpoint interval that minimises "
            f"lost time, {interval.inputs()}")  # fmt: skip
    return ["--checkpoint.enable", "--checkpoint.interval", str(interval.steps)], [], [line]


# torch.compile of the model, which memory-budget AC needs (torchtitan/config/configs.py
# CompileConfig: enable, components; trainer.py:159-165)
_COMPILE = ["--compile.enable", "--compile.components", "model,loss"]


def _recompute(plan: Plan) -> tuple[str, list[str]]:
    """The activation-checkpoint subcommand and notes: tyro's `activation_checkpoint:none`,
    `:selective` (per-op SAC, the plan's "op" module), `:full` or `:memory-budget` (its
    "budget:<b>" module; the budget flag follows the subcommand)
    (torchtitan/distributed/activation_checkpoint.py @b5bcd76, ActivationCheckpointingConfig)."""
    par = plan.parallel
    budget = memory_budget(par.recompute_modules)
    if par.recompute == "selective" and budget is not None:
        return f"memory-budget --activation_checkpoint.memory_budget {budget:g}", []
    every = all(tuple(s.recompute_layers) == tuple(s.layers) for s in plan.stages)
    if par.recompute == "full" and every:
        return "full", []
    if par.recompute != "selective" and any(s.recompute_layers for s in plan.stages):
        return "full", [
            "per-layer recompute becomes torchtitan's full AC on every layer (it cannot choose "
            "layers); memory is lower and compute higher than planned"
        ]
    if par.recompute == "selective" and par.recompute_modules != ("op",):
        modules = ",".join(par.recompute_modules or ("core_attn",))
        raise SpecError(
            f"plan.json: it recomputes the modules {modules}, which torchtitan "
            f"{TORCHTITAN_VERSION} does not run as priced (its selective AC is per-op SAC, "
            "module 'op'); re-plan with --target torchtitan"
        )
    return par.recompute, []


def _knob_notes(plan: Plan, model: ModelSpec, shard: int) -> list[str]:
    p, t = plan.parallel, plan.training
    notes = []
    if not (t.get("zero") or t.get("fsdp")) and shard > 1:
        notes.append(f"torchtitan shards parameters with FSDP (ZeRO-3) over {shard} data-parallel "
                     f"ranks and replicates over {p.dp // shard} (HSDP); Piper planned no "
                     "sharding")  # fmt: skip
    if p.etp > 1:
        notes.append(f"torchtitan {TORCHTITAN_VERSION} has no expert tensor parallelism: "
                     f"etp={p.etp} is not exported")  # fmt: skip
    if t.get("a2a_overlap"):
        notes.append("torchtitan has no 1F1B all-to-all overlap; the all-to-all is exposed")
    if plan.extra.get("dispatcher") in ("deepep", "halo", "halo-dedup"):
        notes.append(f"the '{plan.extra['dispatcher']}' dispatcher is chosen in torchtitan's "
                     "model definition (config functions such as qwen3_moe_deepep), not by a "
                     "flag: the config's own dispatcher is used")  # fmt: skip
    mtp = t.get("mtp_layers")
    if (model.num_mtp_layers if mtp is None else mtp) and model.family != "deepseek_v3":
        notes.append("torchtitan trains multi-token prediction for deepseek_v3 only")
    permuted = noncontiguous_expert_layers(plan)
    if permuted:
        notes.append(
            f"{permuted} MoE layers use a non-contiguous expert placement; torchtitan "
            "places experts contiguously, so permute the experts in the checkpoint"
        )
    return notes


@dataclass(frozen=True)
class TitanExport:
    """torchtitan 0.3's arguments for a plan (the AC subcommand last), the notes, the files
    written beside the args file (name -> text; empty for torchtitan's own models) and
    comments for the file (where a value comes from)."""

    args: tuple[str, ...]
    notes: tuple[str, ...]
    files: dict[str, str]
    comments: tuple[str, ...] = ()


def torchtitan_args(plan: Plan, model: ModelSpec) -> TitanExport:
    """torchtitan 0.3's arguments for `plan`, the notes and the config module it needs."""
    t = plan.training
    p = plan.parallel
    shard = shard_degree(p.dp, p.cp, p.tp, p.ep, bool(t.get("zero") or t.get("fsdp")))
    head, notes, files = titan_model(plan, model)
    mode, rc_notes = _recompute(plan)
    save, save_notes, save_lines = _checkpoint(plan)
    args = head + _parallelism(plan, model, shard) + _training(plan) + save
    if mode.startswith("memory-budget"):
        args += _COMPILE
    args += f"activation_checkpoint:{mode}".split()
    notes += rc_notes + _knob_notes(plan, model, shard) + save_notes
    return TitanExport(tuple(args), tuple(notes), files, tuple(save_lines))


# Sourcing the args file puts its own folder (where the config module is) on PYTHONPATH.
_PYTHONPATH = [
    "# the config module named by --module lies beside this file",
    'PIPER_TITAN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
    'export PYTHONPATH="${PIPER_TITAN_DIR}${PYTHONPATH:+:${PYTHONPATH}}"',
]


def torchtitan_script(plan: Plan, model: ModelSpec) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """The bash file defining TORCHTITAN_ARGS (notes as comments), the notes, and the files
    to write beside it."""
    export = torchtitan_args(plan, model)
    args, notes = export.args, export.notes
    lines = [
        comment(f"torchtitan {TORCHTITAN_VERSION} arguments for {plan_title(plan)}"),
        "# generated by 'piper export'; source it, then run",
        '#   torchrun ... -m torchtitan.train "${TORCHTITAN_ARGS[@]}"',
    ]
    lines += [comment(f"NOTE: {n}") for n in notes]
    lines += [comment(c) for c in export.comments]
    if export.files:
        lines += _PYTHONPATH
    for name in export.files:  # a missing module is one line before torchtitan starts
        path = f'"$PIPER_TITAN_DIR"/{shlex.quote(name)}'
        lines += [
            f"if [[ ! -f {path} ]]; then",
            f"  echo piper: {path} is missing: write it with piper export --to torchtitan "
            '--out "${BASH_SOURCE[0]}" >&2',
            "  return 1",
            "fi",
        ]
    lines.append("TORCHTITAN_ARGS=(")
    i = 0
    while i < len(args):
        j = i + 1
        while j < len(args) and not args[j].startswith("--") and ":" not in args[j]:
            j += 1
        lines.append("  " + " ".join(shlex.quote(a) for a in args[i:j]))
        i = j
    lines.append(")")
    return "\n".join(lines) + "\n", notes, export.files
