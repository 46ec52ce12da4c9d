"""A torchtitan job config (TOML) for a plan, and what it cannot say.

torchtitan builds its meshes from data-parallel replicate x shard (HSDP), tensor, context,
pipeline and expert degrees; Piper's layout (world = pp * dp * tp, ep inside dp * tp) maps
onto them with the FSDP shard degree chosen so that ep divides shard * tp. Pipeline stages
become `module_fqns_per_model_part`; per-layer recompute becomes torchtitan's mode 'full'.
"""

from __future__ import annotations

import json
from typing import Any

from planner.outputs.export.describe import noncontiguous_expert_layers, plan_title
from planner.parallel import divisors
from planner.plan.schema import Plan
from planner.specs import ModelSpec

# Piper family -> torchtitan model name (torchtitan/models/*); others need a custom model.
TORCHTITAN_MODELS = {
    "llama": "llama3",
    "deepseek_v2": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "qwen3_moe": "qwen3",
    "llama4": "llama4",
}


def _stage_fqns(plan: Plan) -> list[list[str]]:
    """torchtitan module names per pipeline stage (embedding first, norm + output last)."""
    parts = []
    last = len(plan.stages) - 1
    for stage in sorted(plan.stages, key=lambda s: s.stage):
        fqns = [f"layers.{i}" for i in stage.layers]
        if stage.stage == 0:
            fqns.insert(0, "tok_embeddings")
        if stage.stage == last:
            fqns += ["norm", "output"]
        parts.append(fqns)
    return parts


def _shard_degree(dp: int, tp: int, ep: int, zero: bool) -> int:
    """FSDP degree: all of dp with ZeRO, else the least that lets ep fit in shard x tp.

    torchtitan builds its expert-parallel mesh from the shard (and, with expert TP 1, the
    tensor-parallel) dimensions, so ep must divide shard * tp.
    """
    if zero:
        return dp
    return next((s for s in divisors(dp) if (s * tp) % ep == 0), dp)


def torchtitan_config(plan: Plan, model: ModelSpec) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The torchtitan job config as nested dicts (one per TOML table) and the notes."""
    p, training = plan.parallel, plan.training
    notes = []
    zero = bool(training.get("zero", False))
    shard = _shard_degree(p.dp, p.tp, p.ep, zero)
    replicate = p.dp // shard
    if not zero and shard > 1:
        notes.append(
            f"torchtitan shards parameters with FSDP (ZeRO-3) over {shard} data-parallel ranks "
            f"and replicates over {replicate} (HSDP); Piper planned no ZeRO"
        )
    name = TORCHTITAN_MODELS.get(model.family)
    if name is None:
        name = "custom"
        notes.append(f"torchtitan has no model for family '{model.family}'; register one")
    any_rc = any(s.recompute_layers for s in plan.stages)
    mode = "full" if any_rc else p.recompute
    if any_rc:
        notes.append(
            "per-layer recompute becomes mode 'full' on every layer (torchtitan cannot choose "
            "layers); memory is lower and compute higher than planned"
        )
    doc: dict[str, Any] = {
        "job": {"description": plan_title(plan)},
        "model": {"name": name, "flavor": plan.model.name or model.name},
        "training": {
            "local_batch_size": p.micro_batch * p.num_microbatches,
            "global_batch_size": p.dp * p.micro_batch * p.num_microbatches,
            "seq_len": int(training.get("seq_len", 4096)),
            "mixed_precision_param": _TITAN_DTYPES.get(
                str(training.get("dtype", "bf16")), "bfloat16"
            ),
        },
        "parallelism": _titan_parallelism(plan, shard, replicate),
        "activation_checkpoint": {"mode": mode},
    }
    permuted = noncontiguous_expert_layers(plan)
    if permuted:
        notes.append(
            f"{permuted} MoE layers use a non-contiguous expert placement; torchtitan places "
            "experts contiguously, so permute the experts in the checkpoint to match"
        )
    return doc, tuple(notes)


def _titan_parallelism(plan: Plan, shard: int, replicate: int) -> dict[str, Any]:
    p = plan.parallel
    interleaved = plan.training.get("schedule") == "interleaved"
    out: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": p.tp,
        "context_parallel_degree": 1,
        "pipeline_parallel_degree": p.pp,
        "pipeline_parallel_schedule": "Interleaved1F1B" if interleaved else "1F1B",
        "pipeline_parallel_microbatch_size": p.micro_batch,
        "expert_parallel_degree": p.ep,
        "expert_tensor_parallel_degree": 1,
    }
    if p.pp > 1:
        out["module_fqns_per_model_part"] = _stage_fqns(plan)
    return out


_TITAN_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # TOML basic strings share JSON's escapes
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def render_toml(doc: dict[str, dict[str, Any]], notes: tuple[str, ...], title: str) -> str:
    """TOML text of a two-level document (tables of scalars and lists), notes as comments."""
    lines = [f"# torchtitan job config for {title}", "# generated by 'piper export'"]
    lines += [f"# NOTE: {n}" for n in notes]
    for table, values in doc.items():
        lines += ["", f"[{table}]"]
        lines += [f"{key} = {_toml_value(v)}" for key, v in values.items()]
    return "\n".join(lines) + "\n"


def torchtitan_toml(plan: Plan, model: ModelSpec) -> tuple[str, tuple[str, ...]]:
    """The torchtitan TOML text for `plan` (notes as comments inside it) and the notes."""
    doc, notes = torchtitan_config(plan, model)
    return render_toml(doc, notes, plan_title(plan)), notes
