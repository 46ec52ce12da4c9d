"""Each plan's priced settings against what each engine parsed from its export.

Six plans (issue 24): Mixtral-8x7B on 64 Frontier GCDs, DeepSeek-V3 on 1024 H100s, Qwen3-30B-A3B
on 64 H100s, Llama-4 Scout on 32 H100s (the search may choose full recompute), GPT-OSS-20B on 16
H100s and Llama-4 Maverick on 256 GB200s, each planned once per target with `piper plan --target
megatron|torchtitan|piper`. A plan that no layout of the target fits is a row, not a crash. For
each (plan, target):
- the export (`piper export --to megatron|torchtitan`; the Slurm script's `python -m
  runtime.launch ...` for piper) is made, or refused in one line (planner/plan/priced.py);
- the engine's own parser reads it unedited:
  - Megatron-LM (`--megatron-lm PATH`, run by `--python PY`): `parse_args` + `validate_args` +
    `core_transformer_config_from_args` on MEGATRON_ARGS plus only tokenizer and data flags, in
    the export's environment (WORLD_SIZE = the plan's world); its num-microbatches calculator;
    its `get_num_layers_to_build` / `get_transformer_layer_offset` per pipeline rank and virtual
    chunk. The GPU is emulated as an H100 (compute capability 9.0) and Transformer Engine as
    present, the two things a CPU lacks.
  - torchtitan 0.3 (run by `--torchtitan-python PY`, a Python with torchtitan 0.3 and
    triton): `piper export --to torchtitan --out DIR/torchtitan_args.sh` is sourced in bash
    as a user would (TORCHTITAN_ARGS, and PYTHONPATH for the config module the export writes
    beside it for a model torchtitan has no config function of its own for: Mixtral, Llama-4),
    then, from another folder, `ConfigManager().parse_args(TORCHTITAN_ARGS)`, the model
    config's `update_from_config`, the trainer's CUDA-graph check and the model built on the
    meta device (its parameter count compared with the plan's model, within 1%).
  - piper: the launcher's own argument parser (`python -m runtime.launch`'s flags) on the Slurm
    export's command, then `planner.run.spec.checked_spec`, what `piper run` checks before it
    starts processes;
- every priced setting (plan.json: tp, pp, vp, cp, ep, etp, dp, micro-batch, global batch,
  micro-batches, sequence, the pipeline split per virtual stage, recompute policy, modules and
  layers, sharding, the overlapped data-parallel reduction, all-to-all overlap, dispatcher,
  dtype / FP8 recipe, Adam moments, CUDA graphs, MTP layers) is printed against the value the
  engine parsed, and mismatches counted;
- the Slurm script for the target's trainer: `bash -n`, `shellcheck` when installed, its dry
  run outside an allocation.
The export tests' every-knob plan (FP8 or bf16, FSDP, bf16 moments, the overlap, DeepEP, MTP,
partial CUDA graphs, vp, cp, etp), priced for Megatron, is checked against Megatron-LM too.
Exits 1 when any check fails or any setting mismatches.

    python benchmarks/export_check.py [--megatron-lm PATH ...] [--python PY ...]
        [--torchtitan-python PY] [--no-results]

Writes what it prints to results/export_check.md (--results FILE elsewhere).

The engines, outside the repository (this machine reaches PyPI and the search tool's `fetch`):
    python3 -m venv /tmp/venv_tt
    /tmp/venv_tt/bin/pip install torch==2.13.0      # the CPU wheel (pip's find-links here)
    /tmp/venv_tt/bin/pip install torchtitan==0.3.0 triton transformers   # tyro, spmd_types, ...
  (torchtitan 0.3 imports triton; the CPU torch wheel runs the meta-device build).
  Megatron-LM: `fetch github:NVIDIA/Megatron-LM` gives a bare git dir;
    git --git-dir=/work/.mirror/NVIDIA+Megatron-LM/... worktree add /tmp/mlm-main-<sha> <sha>
  (and core_r0.16.0 the same way), run by /tmp/venv_tt/bin/python (core 0.16, Python 3.11) and
  a Python >= 3.12 venv with torch for main.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from results_md import ROOT, recorded

from planner.cli import main as piper_main
from planner.outputs.export import export_plan
from planner.plan import Plan, load_plan
from planner.resources.params import count_params
from planner.run.layout import virtual_stages
from planner.specs import SpecError

TARGETS = ("megatron", "torchtitan", "piper")
CASES = {
    "mixtral-8x7b frontier 64": ["--model", "mixtral-8x7b", "--cluster", "frontier",
                                 "--gpus", "64"],
    "deepseek-v3 h100 1024": ["--model", "deepseek-v3", "--cluster", "h100", "--gpus", "1024"],
    "qwen3-30b-a3b h100 64": ["--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "64"],
    # full recompute allowed: the search may choose it (nothing is forced)
    "llama4-scout h100 32": ["--model", "llama4-scout", "--cluster", "h100", "--gpus", "32"],
    "gpt-oss-20b h100 16": ["--model", "gpt-oss-20b", "--cluster", "h100", "--gpus", "16"],
    "llama4-maverick gb200 256": ["--model", "llama4-maverick", "--cluster", "gb200-nvl72",
                                  "--gpus", "256"],
    # pipelining held fixed: every target's pp x vp export is parsed (the search alone may
    # choose pp 1 everywhere, as it does for torchtitan's FSDP held through the micro-batches)
    "qwen3-30b-a3b h100 64 pp4 vp4": ["--model", "qwen3-30b-a3b", "--cluster", "h100",
                                      "--gpus", "64", "--pp", "4", "--vp", "4"],
    # the newer accelerators' presets: each target's export of their plans
    "deepseek-v3 b200 256": ["--model", "deepseek-v3", "--cluster", "b200", "--gpus", "256"],
    "deepseek-v3 h800 256": ["--model", "deepseek-v3", "--cluster", "h800", "--gpus", "256"],
    "qwen3-30b-a3b mi355x 64": ["--model", "qwen3-30b-a3b", "--cluster", "mi355x",
                                "--gpus", "64"],
}  # fmt: skip
# The priced settings compared, in table order.
SETTINGS = ("tp", "pp", "vp", "cp", "ep", "etp", "dp", "micro_batch", "global_batch",
            "num_microbatches", "seq_len", "pipeline_split", "recompute", "recompute_modules",
            "recompute_layers", "sharding", "grad_overlap", "a2a_overlap", "dispatcher", "dtype",
            "optimizer_dtype", "cuda_graphs", "mtp_layers")  # fmt: skip
# What a user adds to the Megatron export: a tokenizer and data (mock data here).
DATA_FLAGS = ["--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "10",
              "--lr", "1e-4"]  # fmt: skip

# Runs inside the checkout's Python: Megatron-LM's own argument code on the exported flags.
MEGATRON_DRIVER = r"""
import json, sys
checkout, argv = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, checkout)
import torch
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # an H100
import megatron.core.utils as core_utils
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import transformer_config
from megatron.training import arguments
for module in (core_utils, transformer_config, arguments):  # Transformer Engine present
    if hasattr(module, "is_te_min_version"):
        module.is_te_min_version = lambda *a, **k: True
rope_utils.fused_apply_rotary_pos_emb = lambda *a, **k: None
arguments.get_device_arch_version = lambda: 9
sys.argv = ["pretrain_gpt.py", *argv]
args = arguments.parse_args()
arguments.validate_args(args)
config = arguments.core_transformer_config_from_args(args)
names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
         "expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size",
         "virtual_pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
         "seq_length", "num_layers", "recompute_granularity", "recompute_method",
         "recompute_num_layers", "recompute_modules", "use_distributed_optimizer",
         "use_megatron_fsdp", "data_parallel_sharding_strategy", "overlap_grad_reduce",
         "overlap_param_gather",
         "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "num_moe_experts",
         "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "bf16", "fp16", "fp8",
         "fp8_recipe", "fp4", "use_precision_aware_optimizer", "exp_avg_dtype",
         "exp_avg_sq_dtype", "cuda_graph_impl", "cuda_graph_scope", "cuda_graph_modules",
         "mtp_num_layers", "decoder_first_pipeline_num_layers",
         "decoder_last_pipeline_num_layers", "num_layers_per_virtual_pipeline_stage",
         "pipeline_model_parallel_layout", "num_layers_in_first_pipeline_stage",
         "num_layers_in_last_pipeline_stage")
missing = object()
def value(obj, name):
    v = getattr(obj, name, missing)
    return "<absent>" if v is missing else v
out = {"args": {n: value(args, n) for n in names}, "config": {n: value(config, n) for n in names}}
out["config_class"] = type(config).__name__
from megatron.core import num_microbatches_calculator as nmc
nmc.init_num_microbatches_calculator(0, args.rampup_batch_size, args.global_batch_size,
                                     args.micro_batch_size, args.data_parallel_size)
out["num_microbatches"] = nmc.get_num_microbatches()
from megatron.core import parallel_state
from megatron.core.transformer import transformer_block, transformer_layer
pp = config.pipeline_model_parallel_size
vp = config.virtual_pipeline_model_parallel_size or 1
chunks = []
try:
    for rank in range(pp):
        parallel_state.get_pipeline_model_parallel_rank = lambda rank=rank: rank
        parallel_state.get_pipeline_model_parallel_world_size = lambda: pp
        vp_size = vp if vp > 1 else None
        parallel_state.get_virtual_pipeline_model_parallel_world_size = lambda: vp_size
        for c in range(vp):
            stage = c if vp > 1 else None
            n = transformer_block.get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank)
            off = transformer_layer.get_transformer_layer_offset(config, stage, rank)
            chunks.append([c * pp + rank, int(off), int(n)])
    out["chunks"] = sorted(chunks)
except Exception as exc:
    out["chunks_error"] = f"{type(exc).__name__}: {exc}"
print("PIPER_RESULT " + json.dumps(out, default=str))
"""

# Runs inside a Python with torchtitan 0.3: its ConfigManager on the exported flags, then the
# model config's update_from_config, the trainer's CUDA-graph check and a meta-device build.
TITAN_DRIVER = r"""
import json, sys
argv = json.loads(sys.argv[1])
import torch
from torchtitan.config.manager import ConfigManager
try:
    config = ConfigManager().parse_args(argv)
except BaseException as exc:  # tyro exits on a bad flag
    print("PIPER_ERROR " + json.dumps(f"{type(exc).__name__}: {exc}"))
    raise SystemExit(0)
par, tr = config.parallelism, config.training
out = {
    "parallelism": {k: getattr(par, k) for k in (
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
        "context_parallel_degree", "pipeline_parallel_degree", "pipeline_parallel_schedule",
        "pipeline_parallel_microbatch_size", "expert_parallel_degree",
        "module_fqns_per_model_part")},
    "training": {k: getattr(tr, k) for k in (
        "local_batch_size", "global_batch_size", "seq_len", "dtype", "mixed_precision_param",
        "disable_cuda_graphs")},
    "activation_checkpoint": (type(config.activation_checkpoint).__qualname__
                              if config.activation_checkpoint is not None else None),
    "memory_budget": getattr(config.activation_checkpoint, "memory_budget", None),
    "optimizer_implementation": getattr(config.optimizer, "implementation", None),
    "model": config.model_spec.name if config.model_spec else None,
}
try:
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    out["dispatchers"] = sorted({type(c).__qualname__ for _, c, _, _ in
                                 config.model_spec.traverse(LocalTokenDispatcher.Config)})
    try:
        from torchtitan.models.deepseek_v3.mtp import MTPTransformerBlock
        out["mtp_layers"] = sum(1 for _ in config.model_spec.traverse(MTPTransformerBlock.Config))
    except ImportError:
        out["mtp_layers"] = 0
    converters = getattr(getattr(config, "model_converters", None), "converters", None)
    out["converters"] = [type(c).__qualname__ for c in (converters or [])]
    config._validate_cuda_graphs()
    out["cuda_graph_check"] = "ok"
    with torch.device("meta"):
        model = model_config.build()
    model.verify_module_protocol()
    out["params"] = sum(p.numel() for p in model.parameters())
    out["build"] = f"ok ({out['params']:,} params on meta)"
except BaseException as exc:
    out["build"] = f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
print("PIPER_RESULT " + json.dumps(out, default=str))
"""


def quiet_piper(argv: list[str]) -> tuple[int, str]:
    """`piper ARGV` with its printed summary kept off the report: (exit code, last stderr
    line)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = piper_main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
    lines = err.getvalue().strip().splitlines()
    return code, lines[-1] if lines else ""


def bash_array(text: str, name: str) -> list[str]:
    script = f'{text}\nprintf "%s\\n" "${{{name}[@]}}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          check=True).stdout.splitlines()  # fmt: skip


def bash_env(text: str) -> list[str]:
    """NAME=VALUE of the variables the export exports."""
    names = [ln.split()[1].split("=")[0] for ln in text.splitlines() if ln.startswith("export ")]
    script = text + "\n" + "".join(f'echo "{n}=${{{n}}}"\n' for n in names)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          check=True).stdout.splitlines()  # fmt: skip


# ---- priced settings and what each engine parsed, in one vocabulary (pure functions) ----


def layer_set_text(layers: Iterable[int], total: int) -> str:
    """A set of layer indices as 'all 32', 'none' or '5 of 32: 0-3,7'."""
    ids = sorted(set(layers))
    if not ids:
        return "none"
    if len(ids) == total and ids == list(range(total)):
        return f"all {total}"
    runs, start = [], ids[0]
    for prev, cur in zip(ids, [*ids[1:], None], strict=True):
        if cur != prev + 1:
            runs.append(f"{start}-{prev}" if prev > start else str(start))
            start = cur
    return f"{len(ids)} of {total}: {','.join(runs)}"


def priced_settings(
    plan: Plan, num_layers: int, model_mtp_layers: int, total_params: int | None = None
) -> dict[str, object]:
    """Every setting `plan` was priced with, in this script's vocabulary.

    recompute_layers: the layer indices recomputed (a frozenset); pipeline_split: layers per
    virtual stage in virtual order (k = c * pp + s); recompute_modules: Megatron's names,
    sorted, with the empty list of a selective plan read as core attention (what the resource
    model prices); cuda_graphs None reads the cluster's setting; mtp_layers None the model's;
    model_params (when `total_params` is given): the model's weights, MTP modules excluded.
    """
    p, t = plan.parallel, plan.training
    stages = sorted(plan.stages, key=lambda s: s.stage)
    virtual = virtual_stages([tuple(s.layers) for s in stages], p.vp, num_layers)
    recomputed = frozenset(i for s in stages for i in s.recompute_layers)
    if p.recompute == "none":
        recomputed = frozenset()
    modules = tuple(sorted(p.recompute_modules or ("core_attn",)))
    mtp = t.get("mtp_layers")
    graphs = t.get("cuda_graphs") or ("full" if plan.cluster.to_dict().get("cuda_graphs")
                                      else "none")  # fmt: skip
    extra = {} if total_params is None else {"model_params": total_params}
    return extra | {
        "tp": p.tp, "pp": p.pp, "vp": p.vp, "cp": p.cp, "ep": p.ep, "etp": p.etp, "dp": p.dp,
        "micro_batch": p.micro_batch,
        "global_batch": p.dp * p.micro_batch * p.num_microbatches,
        "num_microbatches": p.num_microbatches,
        "seq_len": int(t.get("seq_len", 4096)),
        "pipeline_split": tuple(len(v) for v in virtual),
        "recompute": p.recompute,
        "recompute_modules": modules if p.recompute == "selective" else (),
        "recompute_layers": recomputed,
        "sharding": "fsdp" if t.get("fsdp") else "zero" if t.get("zero") else "none",
        # the resource model: FSDP overlapped, the distributed optimizer as grad_overlap says,
        # a plain all-reduce after the backward (resources/schedule.py _grad_sync_all)
        "grad_overlap": bool(t.get("fsdp")
                             or (t.get("zero") and t.get("grad_overlap", True))),
        "a2a_overlap": bool(t.get("a2a_overlap")),
        "dispatcher": str(plan.extra.get("dispatcher", "flat")),
        "dtype": str(t.get("dtype", "bf16")),
        "optimizer_dtype": str(t.get("optimizer_dtype", "fp32")),
        "cuda_graphs": str(graphs),
        "mtp_layers": model_mtp_layers if mtp is None else int(mtp),
    }  # fmt: skip


Parsed = dict[str, tuple[object, str]]  # setting -> (value, the engine's field(s) it came from)


def megatron_parsed(out: dict, num_layers: int) -> Parsed:
    """The MEGATRON_DRIVER's output (Megatron's args namespace, TransformerConfig, the
    microbatch calculator, layers per chunk) in this script's vocabulary."""
    a, c = out["args"], out["config"]

    def get(name):  # TransformerConfig first, then the args namespace
        v = c.get(name, "<absent>")
        v = a.get(name) if v == "<absent>" else v
        return None if v == "<absent>" else v

    pp = int(get("pipeline_model_parallel_size"))
    vp = int(get("virtual_pipeline_model_parallel_size") or 1)
    chunks = [tuple(x) for x in out.get("chunks", [])]
    split = tuple(n for _, _, n in chunks) if chunks else ("error: " + out.get("chunks_error", ""),)
    granularity = get("recompute_granularity") or "none"
    method, n_rc = get("recompute_method"), get("recompute_num_layers")
    modules = tuple(sorted(get("recompute_modules") or ("core_attn",)))
    if granularity == "selective":
        layers = frozenset(range(num_layers))
    elif granularity == "full" and method == "block":
        layers = frozenset(i for _, off, n in chunks for i in range(off, off + min(n, n_rc or 0)))
    elif granularity == "full":  # uniform: every layer, in groups of recompute_num_layers
        layers = frozenset(range(num_layers))
    else:
        layers = frozenset()
    if get("use_megatron_fsdp"):
        strategy = get("data_parallel_sharding_strategy")
        sharding = "fsdp" if strategy == "optim_grads_params" else f"megatron-fsdp {strategy}"
    else:
        sharding = "zero" if get("use_distributed_optimizer") else "none"
    kind, backend = get("moe_token_dispatcher_type"), get("moe_flex_dispatcher_backend")
    dispatcher = {"alltoall": "flat"}.get(kind, kind)
    if kind == "flex":
        dispatcher = "deepep" if backend == "deepep" else f"flex-{backend}"
    if not get("num_moe_experts"):
        dispatcher = "flat"  # a dense model dispatches nothing
    recipe = get("fp8_recipe")
    if get("fp8"):
        dtype = {"tensorwise": "fp8", "mxfp8": "mxfp8"}.get(recipe, f"fp8-{recipe}")
    elif get("fp4"):
        dtype = "fp4"
    else:
        dtype = "bf16" if get("bf16") else "fp16" if get("fp16") else "fp32"
    moments = {str(get("exp_avg_dtype")), str(get("exp_avg_sq_dtype"))}
    bf16_moments = get("use_precision_aware_optimizer") and moments == {"torch.bfloat16"}
    impl = get("cuda_graph_impl") or "none"
    scope = get("cuda_graph_scope") or get("cuda_graph_modules") or []
    scope = scope if isinstance(scope, list) else [scope]
    scope_text = " ".join(str(s).split(".")[-1] for s in scope)
    graphs = ("none" if impl == "none" else "full" if "full_iteration" in scope_text
              else "partial")  # fmt: skip
    rc_field = f"recompute_granularity={granularity}"
    if granularity == "full":
        rc_field += f" method={method} num_layers={n_rc}"
    return {
        "tp": (get("tensor_model_parallel_size"), "tensor_model_parallel_size"),
        "pp": (pp, "pipeline_model_parallel_size"),
        "vp": (vp, "virtual_pipeline_model_parallel_size"),
        "cp": (get("context_parallel_size"), "context_parallel_size"),
        "ep": (get("expert_model_parallel_size"), "expert_model_parallel_size"),
        "etp": (get("expert_tensor_parallel_size"), "expert_tensor_parallel_size"),
        "dp": (a.get("data_parallel_size"), "args.data_parallel_size"),
        "micro_batch": (get("micro_batch_size"), "micro_batch_size"),
        "global_batch": (a.get("global_batch_size"), "args.global_batch_size"),
        "num_microbatches": (out.get("num_microbatches"), "get_num_microbatches()"),
        "seq_len": (a.get("seq_length"), "args.seq_length"),
        "pipeline_split": (split, "get_num_layers_to_build per (pp rank, vp chunk)"),
        "recompute": (granularity, "recompute_granularity"),
        "recompute_modules": (modules if granularity == "selective" else (),
                              f"recompute_modules={get('recompute_modules')}"),
        "recompute_layers": (layers, rc_field),
        "sharding": (sharding, f"use_distributed_optimizer={get('use_distributed_optimizer')} "
                               f"use_megatron_fsdp={get('use_megatron_fsdp')}"),
        "grad_overlap": (bool(get("overlap_grad_reduce")) and (
            sharding != "zero" or bool(get("overlap_param_gather"))),
            f"overlap_grad_reduce={get('overlap_grad_reduce')} "
            f"overlap_param_gather={get('overlap_param_gather')}"),
        "a2a_overlap": (bool(get("overlap_moe_expert_parallel_comm")),
                        "overlap_moe_expert_parallel_comm"),
        "dispatcher": (dispatcher, f"moe_token_dispatcher_type={kind}"
                       + (f" backend={backend}" if kind == "flex" else "")),
        "dtype": (dtype, f"bf16={get('bf16')} fp8={get('fp8')} fp8_recipe={recipe}"),
        "optimizer_dtype": ("bf16" if bf16_moments else "fp32",
                            f"exp_avg_dtype={get('exp_avg_dtype')}"),
        "cuda_graphs": (graphs, f"cuda_graph_impl={impl} scope={scope_text or '-'}"),
        "mtp_layers": (int(get("mtp_num_layers") or 0), "mtp_num_layers"),
    }  # fmt: skip


def titan_parsed(out: dict, num_layers: int) -> Parsed:
    """The TITAN_DRIVER's output (torchtitan's JobConfig and built model config) in this
    script's vocabulary. torchtitan's rules: etp = tp when ep = 1, else 1; stages per rank =
    model parts / pp; with pp = 1 a micro-batch is local_batch_size and the step accumulates
    global / (local * dp) of them."""
    par, tr = out["parallelism"], out["training"]
    pp, tp, ep = (par[k] for k in ("pipeline_parallel_degree", "tensor_parallel_degree",
                                   "expert_parallel_degree"))  # fmt: skip
    rep, shard = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    dp = rep * shard
    parts = par["module_fqns_per_model_part"]
    if parts:
        split = tuple(sum(1 for m in part if m.startswith("layers.")) for part in parts)
    else:
        split = (num_layers,) if pp == 1 else ("even split by torchtitan",)
    vp = len(parts) // pp if parts else 1
    local, gbs = tr["local_batch_size"], tr["global_batch_size"]
    gbs = gbs if gbs > 0 else local * dp
    mb = par["pipeline_parallel_microbatch_size"] if pp > 1 else local
    m = local // mb if pp > 1 else gbs // (local * dp)
    ac = (out["activation_checkpoint"] or "none").split(".")[0]
    # Piper's plan holds memory-budget AC as selective recompute of the one module budget:<b>
    recompute = {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "selective",
                 "NoAC": "none", "none": "none"}.get(ac, ac)  # fmt: skip
    budget = out.get("memory_budget") if ac == "MemoryBudgetAC" else None
    modules = (f"budget:{budget:g}",) if budget is not None else ("op",)
    layers = frozenset(range(num_layers)) if recompute != "none" else frozenset()
    names = out.get("dispatchers")
    if names is None:
        dispatcher = "unread: " + out.get("build", "")
    else:
        kinds = {{"LocalTokenDispatcher": "flat", "AllToAllTokenDispatcher": "flat",
                  "TorchAOTokenDispatcher": "flat", "DeepEPTokenDispatcher": "deepep",
                  "HybridEPTokenDispatcher": "hybridep",
                  "MinimalAsyncEPTokenDispatcher": "minimal_async_ep"}.get(n.split(".")[0], n)
                 for n in names}  # fmt: skip
        dispatcher = "/".join(sorted(kinds)) if kinds else "none in the model config"
    precision = {"bfloat16": "bf16", "float32": "fp32"}[tr["mixed_precision_param"]]
    if out.get("converters"):
        precision += "+" + "+".join(out["converters"])
    impl = out.get("optimizer_implementation")
    built = {} if "params" not in out else {"model_params": (out["params"], "model built on meta")}
    return built | {
        "tp": (tp, "parallelism.tensor_parallel_degree"),
        "pp": (pp, "parallelism.pipeline_parallel_degree"),
        "vp": (vp, f"{len(parts) if parts else 1} model parts, "
                   f"{par['pipeline_parallel_schedule']}"),
        "cp": (par["context_parallel_degree"], "parallelism.context_parallel_degree"),
        "ep": (ep, "parallelism.expert_parallel_degree"),
        "etp": (tp if ep == 1 else 1, "torchtitan: tp when ep = 1, else 1"),
        "dp": (dp, f"replicate {rep} x shard {shard}"),
        "micro_batch": (mb, "pipeline_parallel_microbatch_size" if pp > 1
                        else "training.local_batch_size"),
        "global_batch": (gbs, "training.global_batch_size"),
        "num_microbatches": (m, "local / microbatch" if pp > 1 else "global / (local x dp)"),
        "seq_len": (tr["seq_len"], "training.seq_len"),
        "pipeline_split": (split, "module_fqns_per_model_part"),
        "recompute": (recompute, f"activation_checkpoint={ac}"),
        "recompute_modules": (modules if recompute == "selective" else (),
                              f"{ac} memory_budget={budget}" if budget is not None else ac),
        "recompute_layers": (layers, f"{ac} on every block"),
        "sharding": ("fsdp" if rep == 1 else f"hsdp {rep}x{shard}",
                     f"FSDP2 over shard {shard}, replicate {rep}"),
        "grad_overlap": (True, "FSDP2: prefetched all-gathers, reduce-scatter in backward"),
        "a2a_overlap": (False, "torchtitan has none"),
        "dispatcher": (dispatcher, ",".join(names or []) or "-"),
        "dtype": (precision, f"training.mixed_precision_param={tr['mixed_precision_param']}"),
        "optimizer_dtype": ("bf16" if impl == "fused_opt_states_bf16" else "fp32",
                            f"optimizer.implementation={impl}"),
        "cuda_graphs": ("none" if tr["disable_cuda_graphs"] else "full",
                        f"training.disable_cuda_graphs={tr['disable_cuda_graphs']}"),
        "mtp_layers": (int(out.get("mtp_layers", 0)), "MTPTransformerBlock configs"),
    }  # fmt: skip


def piper_parsed(spec, dispatcher: str, dtype: str) -> Parsed:
    """Piper's RunSpec (planner.run.spec) and the launcher's --dispatcher and --precision in
    this script's vocabulary. The runtime keeps fp32 weights, gradients and Adam moments and
    computes in `dtype` (bf16: autocast), eagerly, with no MTP, overlap or context
    parallelism (a plan with cp > 1 is refused)."""
    virtual = spec.chunk_layers or spec.stage_layers
    total = sum(len(v) for v in virtual)
    return {
        "tp": (spec.tp, "RunSpec.tp"), "pp": (spec.pp, "RunSpec.pp"),
        "vp": (spec.vp, "RunSpec.vp"), "cp": (1, "runtime: cp > 1 refused"),
        "ep": (spec.ep, "RunSpec.ep"), "etp": (spec.etp, "RunSpec.etp"),
        "dp": (spec.dp, "RunSpec.dp"), "micro_batch": (spec.micro_batch, "RunSpec.micro_batch"),
        "global_batch": (spec.dp * spec.micro_batch * spec.num_microbatches, "dp x mb x m"),
        "num_microbatches": (spec.num_microbatches, "RunSpec.num_microbatches"),
        "seq_len": (spec.seq_len, "RunSpec.seq_len"),
        "pipeline_split": (tuple(len(v) for v in virtual), "RunSpec.chunk_layers/stage_layers"),
        "recompute": (spec.recompute, "RunSpec.recompute"),
        "recompute_modules": (("core_attn",) if spec.recompute == "selective" else (),
                              "runtime: selective = core attention"),
        "recompute_layers": (frozenset(spec.recompute_layers) if spec.recompute != "none"
                             else frozenset(), f"RunSpec.recompute_layers ({total} layers)"),
        "sharding": ("fsdp" if spec.fsdp else "none", "RunSpec.fsdp"),
        "grad_overlap": (spec.fsdp, "FSDP2 fully_shard" if spec.fsdp
                         else "sync_gradients: one all-reduce after the backward"),
        "a2a_overlap": (False, "runtime has none"),
        "dispatcher": (dispatcher, "--dispatcher (RunOptions)"),
        "dtype": (dtype, "--precision (RunOptions.compute_dtype)"),
        "optimizer_dtype": ("fp32", "runtime: torch Adam, fp32 moments"),
        "cuda_graphs": ("none", "runtime: eager"),
        "mtp_layers": (spec.model.num_mtp_layers, "RunSpec.model.num_mtp_layers"),
    }  # fmt: skip


def show(value: object, num_layers: int, setting: str = "") -> str:
    """A setting's value as the table prints it."""
    if setting == "model_params" and isinstance(value, int):
        return f"{value / 1e9:,.2f}B params"
    if isinstance(value, frozenset):
        return layer_set_text(value, num_layers)
    if isinstance(value, tuple):
        return "/".join(map(str, value)) if value else "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def compare(
    priced: dict[str, object], parsed: Parsed
) -> list[tuple[str, object, object, str, bool]]:
    """(setting, priced, parsed, engine field, equal) for every setting in SETTINGS, then the
    model's parameters where the engine built it (equal within 1%: the engines count norms and
    biases their own way)."""
    rows = []
    for name in SETTINGS:
        value, where = parsed.get(name, ("<not parsed>", "-"))
        rows.append((name, priced[name], value, where, priced[name] == value))
    if "model_params" in parsed and "model_params" in priced:
        value, where = parsed["model_params"]
        want = priced["model_params"]
        rows.append(("model_params", want, value, where, abs(value - want) <= 0.01 * want))
    return rows


# ---- the engines' parsers, run on the exports ----


def run_megatron(plan: Plan, checkout: str, python: str) -> dict | str:
    """MEGATRON_DRIVER on the export: its output, or one line saying why it failed."""
    text = export_plan(plan, "megatron").text
    argv = bash_array(text, "MEGATRON_ARGS") + DATA_FLAGS
    argv += ["--vocab-size", str(plan.model_spec().vocab_size)]
    p = plan.parallel
    env = {**os.environ, "WORLD_SIZE": str(p.pp * p.dp * p.tp * p.cp), "RANK": "0"}
    env.update(line.split("=", 1) for line in bash_env(text))
    run = subprocess.run([python, "-c", MEGATRON_DRIVER, checkout, json.dumps(argv)],
                         capture_output=True, text=True, env=env, cwd=checkout)  # fmt: skip
    result = [ln for ln in run.stdout.splitlines() if ln.startswith("PIPER_RESULT ")]
    if run.returncode or not result:
        lines = (run.stderr or run.stdout).strip().splitlines()
        return "FAIL " + (lines[-1] if lines else f"exit {run.returncode}")
    return json.loads(result[0].removeprefix("PIPER_RESULT "))


def run_titan(plan_path: Path, python: str) -> dict | str:
    """TITAN_DRIVER on the export as a user runs it: `piper export --to torchtitan --out` into
    a fresh folder, the args file sourced in bash (TORCHTITAN_ARGS and the PYTHONPATH it sets
    for its config module), the driver run from another folder. Its output, or one line
    saying why it failed."""
    folder = Path(tempfile.mkdtemp(prefix="titan_export_"))
    args_file = folder / "torchtitan_args.sh"
    code, err = quiet_piper(["export", str(plan_path), "--to", "torchtitan", "--out",
                             str(args_file)])  # fmt: skip
    if code:
        return f"FAIL export: {err}"
    script = (f"source {shlex.quote(str(args_file))}\n"
              'printf "%s\\n" "${PYTHONPATH:-}" "${TORCHTITAN_ARGS[@]}"')  # fmt: skip
    lines = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                           ).stdout.splitlines()  # fmt: skip
    env = {**os.environ, "PYTHONPATH": lines[0], "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([python, "-c", TITAN_DRIVER, json.dumps(lines[1:])], env=env,
                         capture_output=True, text=True, cwd=tempfile.gettempdir())  # fmt: skip
    shutil.rmtree(folder, ignore_errors=True)
    for line in run.stdout.splitlines():
        if line.startswith("PIPER_RESULT "):
            return json.loads(line.removeprefix("PIPER_RESULT "))
        if line.startswith("PIPER_ERROR "):
            return "FAIL " + json.loads(line.removeprefix("PIPER_ERROR "))
    lines = (run.stderr or run.stdout).strip().splitlines()
    return "FAIL " + (lines[-1] if lines else f"exit {run.returncode}")


def run_piper(plan: Plan, path: Path):
    """The launcher's parser on the Slurm export's command, then the RunSpec `piper run`
    checks: (RunSpec, --dispatcher, the compute dtype --precision gives)."""
    from planner.run.options import LAUNCH_MODULE, RunOptions, add_run_arguments
    from planner.run.spec import checked_spec

    text = export_plan(plan, "slurm", plan_path=str(path), trainer="piper").text
    line = next(ln for ln in text.splitlines() if ln.startswith("CMD=("))
    argv = shlex.split(line.removeprefix("CMD=(").removesuffix(")"))
    argv = argv[argv.index(LAUNCH_MODULE) + 1 :]
    parser = argparse.ArgumentParser(prog="python -m runtime.launch", exit_on_error=False)
    add_run_arguments(parser, launcher=True)
    options = RunOptions.from_args(parser.parse_args(argv))
    options.check()
    return checked_spec(options), options.dispatcher, options.compute_dtype(plan.training)


def check_slurm(plan_path: Path, folder: Path, trainer: str) -> str:
    """bash -n, shellcheck and the dry run outside an allocation of the sbatch script."""
    script = folder / f"{trainer}.sbatch"
    argv = ["export", str(plan_path), "--to", "slurm", "--trainer", trainer, "--out", str(script)]
    if trainer != "piper":
        args_file = folder / f"{trainer}_args.sh"
        quiet_piper(["export", str(plan_path), "--to", trainer, "--out", str(args_file)])
        argv += ["--args-file", str(args_file)]
    code, err = quiet_piper(argv)
    if code:
        return f"FAIL export: {err}"
    steps = [("bash -n", ["bash", "-n", str(script)])]
    if shutil.which("shellcheck"):
        steps.append(("shellcheck", ["shellcheck", str(script)]))
    done = []
    for name, cmd in steps:
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            return f"FAIL {name}: {(run.stdout + run.stderr).strip().splitlines()[0]}"
        done.append(name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PIPER_HOSTFILE"] = str(folder / f"{trainer}.hosts")
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    if run.returncode or "srun" not in run.stdout:
        return f"FAIL dry run: {(run.stderr or run.stdout).strip()}"
    hosts = (folder / f"{trainer}.hosts").read_text().split()
    return f"ok: {', '.join(done)}, dry run ({len(hosts)} ranks in the hostfile)"


# ---- the report ----


def layout_line(plan: Plan) -> str:
    p, t = plan.parallel, plan.training
    sharding = "fsdp" if t.get("fsdp") else "zero" if t.get("zero") else "no sharding"
    return (f"pp={p.pp} vp={p.vp} dp={p.dp} tp={p.tp} cp={p.cp} ep={p.ep} etp={p.etp} "
            f"mb={p.micro_batch} m={p.num_microbatches} recompute={p.recompute} {sharding} "
            f"dispatcher={plan.extra.get('dispatcher', 'flat')}")  # fmt: skip


def print_table(rows, num_layers: int, engine: str) -> int:
    """The priced-vs-parsed table; returns the number of mismatches."""
    header = ("setting", "priced (plan.json)", f"parsed by {engine}", "engine field", "")
    cells = [(n, show(a, num_layers, n), show(b, num_layers, n), where, "ok" if ok else "MISMATCH")
             for n, a, b, where, ok in rows]  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(4)]
    for row in [header, *cells]:
        print("    " + "  ".join(f"{c:{w}s}" for c, w in zip(row[:4], widths, strict=True))
              + "  " + row[4])  # fmt: skip
    return sum(not ok for *_, ok in rows)


class Tally:
    """Outcome per (plan, target) and the failures and mismatches counted."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], str] = {}
        self.failed = 0
        self.mismatches: list[str] = []


def check_engine(name: str, target: str, plan: Plan, path: Path, args, tally: Tally) -> None:
    """Export `plan` for `target`, parse it with the engine, print the table, tally."""
    model = plan.model_spec()
    total = count_params(model).total
    priced = priced_settings(plan, model.num_layers, model.num_mtp_layers, total)
    runs: dict[str, object] = {}
    build_failed = False
    try:
        if target == "megatron":
            export_plan(plan, "megatron")
            pythons = args.python * len(args.megatron_lm) if len(args.python) == 1 else args.python
            for root, python in zip(args.megatron_lm, pythons, strict=True):
                out = run_megatron(plan, root, python)
                runs[f"Megatron-LM {Path(root).name}"] = (
                    out if isinstance(out, str) else megatron_parsed(out, model.num_layers)
                )
            if not args.megatron_lm:
                runs["Megatron-LM"] = "skipped (no --megatron-lm checkout)"
        elif target == "torchtitan":
            export_plan(plan, "torchtitan")
            if args.torchtitan_python:
                out = run_titan(path, args.torchtitan_python)
                if isinstance(out, str):
                    runs["torchtitan"] = out
                else:
                    runs["torchtitan"] = titan_parsed(out, model.num_layers)
                    print(f"  torchtitan model build on meta: {out.get('build')}")
                    if str(out.get("build", "")).startswith("FAIL"):
                        tally.failed += 1
                        build_failed = True
            else:
                runs["torchtitan"] = "skipped (no --torchtitan-python)"
        else:
            spec, dispatcher, dtype = run_piper(plan, path)
            runs["piper runtime.launch"] = piper_parsed(spec, dispatcher, dtype)
    except (SpecError, argparse.ArgumentError) as exc:
        print(f"  {target}: REFUSED {exc}")
        tally.cells[(name, target)] = "refused"
        tally.failed += 1
        return
    worst = "meta build FAIL" if build_failed else "ok"
    for engine, parsed in runs.items():
        if isinstance(parsed, str):
            print(f"  {engine}: {parsed}")
            if parsed.startswith("FAIL"):
                tally.failed += 1
                worst = "parser failed"
            elif worst == "ok":
                worst = "skipped"
            continue
        print(f"  {engine}:")
        rows = compare(priced, parsed)
        bad = print_table(rows, model.num_layers, engine)
        for setting, a, b, _, ok in rows:
            if not ok:
                tally.mismatches.append(f"{name} / {target} / {engine}: {setting} priced "
                                        f"{show(a, model.num_layers, setting)}, parsed "
                                        f"{show(b, model.num_layers, setting)}")  # fmt: skip
        if bad and worst in ("ok", "skipped"):
            worst = f"{bad} mismatches"
        elif bad:
            worst += f", {bad} mismatches"
    trainer = target
    slurm = check_slurm(path, path.parent, trainer)
    print(f"  slurm {trainer}: {slurm}")
    tally.failed += slurm.startswith("FAIL")
    tally.cells[(name, target)] = worst if not slurm.startswith("FAIL") else f"{worst}; slurm FAIL"


def make_plans(folder: Path) -> dict[tuple[str, str], tuple[Path | None, str]]:
    """`piper plan --target T` for every case and target: (plan.json or None, the error)."""
    out = {}
    for name, argv in CASES.items():
        for target in TARGETS:
            where = folder / f"{name.replace(' ', '_')}-{target}"
            code, err = quiet_piper(["plan", *argv, "--target", target, "--out", str(where)])
            out[(name, target)] = (where / "plan.json" if code == 0 else None, err)
    return out


VERSIONS = {
    "megatron": "import sys; sys.path.insert(0, sys.argv[1]); "
    "from megatron.core import package_info as p; import torch; "
    "print(f'megatron-core {p.__version__}, torch {torch.__version__}, "
    "Python {sys.version.split()[0]}')",
    "torchtitan": "import sys, importlib.metadata as m; "
    "print(', '.join(f'{n} {m.version(n)}' for n in ('torchtitan', 'torch', 'triton', "
    "'transformers')) + f', Python {sys.version.split()[0]}')",
}


def print_versions(args: argparse.Namespace) -> None:
    """The engines' versions and the Pythons that ran them."""
    pythons = args.python * len(args.megatron_lm) if len(args.python) == 1 else args.python
    for root, python in zip(args.megatron_lm, pythons, strict=True):
        run = subprocess.run([python, "-c", VERSIONS["megatron"], root], capture_output=True,
                             text=True)  # fmt: skip
        print(f"Megatron-LM {Path(root).name}: {(run.stdout or run.stderr).strip()}")
    if args.torchtitan_python:
        run = subprocess.run([args.torchtitan_python, "-c", VERSIONS["torchtitan"]],
                             capture_output=True, text=True)  # fmt: skip
        print(f"torchtitan: {(run.stdout or run.stderr).strip()}")


def run(args: argparse.Namespace) -> int:
    from tests.planner.outputs.export_plans import knob_plan, priced_for

    print_versions(args)
    tally = Tally()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plans = make_plans(folder)
        for name in CASES:
            print(f"== {name}")
            for target in TARGETS:
                path, err = plans[(name, target)]
                if path is None:
                    fits = "fit" in err
                    print(f"  --target {target}: {'DOES NOT FIT' if fits else 'FAIL'}: {err}")
                    tally.cells[(name, target)] = "does not fit" if fits else "plan failed"
                    tally.failed += not fits
                    continue
                plan = load_plan(path)
                print(f"  --target {target}: {layout_line(plan)}")
                check_engine(name, target, plan, path, args, tally)
        for dtype in ("fp8", "bf16"):
            name = f"every knob ({dtype})"
            path = folder / f"every_knob_{dtype}" / "plan.json"
            path.parent.mkdir()
            plan = priced_for(knob_plan(dtype), "megatron")
            path.write_text(plan.to_json())
            print(f"== {name}")
            print(f"  --target megatron: {layout_line(plan)}")
            check_engine(name, "megatron", load_plan(path), path, args, tally)
    names = [*CASES, "every knob (fp8)", "every knob (bf16)"]
    width = max(map(len, names))
    print("\nsummary (plan x target)")
    print(f"  {'plan':{width}s}  " + "  ".join(f"{t:22s}" for t in TARGETS))
    for name in names:
        print(f"  {name:{width}s}  "
              + "  ".join(f"{tally.cells.get((name, t), '-'):22s}" for t in TARGETS))  # fmt: skip
    print(f"{len(tally.mismatches)} mismatches" + (":" if tally.mismatches else ""))
    for line in tally.mismatches:
        print(f"  {line}")
    print(f"{tally.failed} checks failed")
    return 1 if tally.failed or tally.mismatches else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron-lm", nargs="+", default=[], metavar="PATH",
                    help="Megatron-LM checkouts to run the parser of")  # fmt: skip
    ap.add_argument("--python", nargs="+", default=[sys.executable], metavar="PY",
                    help="the Python (with torch) that runs each checkout, or one for all "
                    "(main needs Python >= 3.12)")  # fmt: skip
    ap.add_argument(
        "--torchtitan-python",
        default=None,
        metavar="PY",
        help="a Python with torchtitan 0.3, triton and transformers",
    )
    ap.add_argument("--results", default=str(ROOT / "results/export_check.md"))
    ap.add_argument("--no-results", action="store_true", help="print only")
    args = ap.parse_args()
    code = 0
    with recorded(args.results, "Exports checked by each engine's parser",
                  enabled=not args.no_results):  # fmt: skip
        code = run(args)
    sys.exit(code)


if __name__ == "__main__":
    main()
