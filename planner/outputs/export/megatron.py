"""Megatron-LM (Megatron-Core) command-line arguments for a plan, and what they cannot say.

Pipeline split: an even split needs no flag; an uneven one whose middle stages are equal uses
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`; any other split
uses `--pipeline-model-parallel-layout` (Megatron-Core >= 0.13, E = embedding, t = layer,
m = MTP, L = loss, '|' between stages), with a note.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from planner.outputs.export.describe import noncontiguous_expert_layers, plan_title
from planner.plan.schema import Plan
from planner.specs import ModelSpec

_DTYPE_FLAGS = {"bf16": "--bf16", "fp16": "--fp16"}


@dataclass(frozen=True)
class MegatronArgs:
    """Flags in order (flag, then its value when it takes one) and notes for the user."""

    args: tuple[str, ...]
    notes: tuple[str, ...]


def pipeline_split_args(counts: list[int], mtp_layers: int) -> tuple[list[str], list[str]]:
    """Flags expressing layers per stage `counts`, and notes."""
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
    stages = ["t" * c for c in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_layers + "L"
    note = (
        "middle pipeline stages hold unequal layer counts "
        f"{counts}; expressed with --pipeline-model-parallel-layout (Megatron-Core >= 0.13)"
    )
    return ["--pipeline-model-parallel-layout", "|".join(stages)], [note]


def recompute_args(plan: Plan) -> tuple[list[str], list[str]]:
    """Recompute flags: per-stage layer choices as Megatron's block method when it fits."""
    stages = sorted(plan.stages, key=lambda s: s.stage)
    chosen = [len(s.recompute_layers) for s in stages]
    if not any(chosen):
        if plan.parallel.recompute == "full":
            return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1"], []  # fmt: skip
        if plan.parallel.recompute == "selective":
            return ["--recompute-granularity", "selective"], []
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


def _attention_args(model: ModelSpec) -> tuple[list[str], list[str]]:
    att = model.layers[0].attention
    args = ["--num-attention-heads", str(att.num_heads)]
    notes = []
    if att.kind == "mla":
        args += ["--multi-latent-attention", "--kv-lora-rank", str(att.kv_lora_rank),
                 "--qk-head-dim", str(att.qk_nope_head_dim),
                 "--qk-pos-emb-head-dim", str(att.qk_rope_head_dim),
                 "--v-head-dim", str(att.v_head_dim)]  # fmt: skip
        if att.q_lora_rank:
            args += ["--q-lora-rank", str(att.q_lora_rank)]
        return args, notes
    if att.num_kv_heads < att.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(att.num_kv_heads)]
    if att.head_dim * att.num_heads != model.hidden_size:
        args += ["--kv-channels", str(att.head_dim)]
    if att.qk_norm:
        args.append("--qk-layernorm")
    if att.bias and not att.o_bias:
        args.append("--add-qkv-bias")
    if att.sinks or any(layer.attention.sliding_window for layer in model.layers):
        notes.append("attention sinks / sliding windows are not exported; add them by hand")
    return args, notes


def _moe_args(model: ModelSpec) -> tuple[list[str], list[str]]:
    moe = model.first_moe
    if moe is None:
        return [], []
    args = ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.top_k),
            "--moe-ffn-hidden-size", str(moe.expert_ffn),
            "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]  # fmt: skip
    notes = []
    pattern = [1 if layer.kind == "moe" else 0 for layer in model.layers]
    freq = "1" if all(pattern) else "[" + ",".join(map(str, pattern)) + "]"
    args += ["--moe-layer-freq", freq]
    if moe.num_shared_experts:
        shared = moe.num_shared_experts * moe.shared_ffn
        args += ["--moe-shared-expert-intermediate-size", str(shared)]
    if moe.router_bias and model.family in ("deepseek_v3", "kimi_k2"):
        args.append("--moe-router-enable-expert-bias")
    if moe.shared_gate or moe.expert_bias or (moe.router_bias and "--moe-router-enable-expert-bias"
                                              not in args):  # fmt: skip
        notes.append("shared-expert gate / expert biases / router bias are not exported")
    if any(layer.kind == "moe" and layer.dense_ffn for layer in model.layers):
        notes.append("Arctic's dense residual MLP beside the MoE has no Megatron flag")
    return args, notes


def model_args(model: ModelSpec, seq_len: int) -> tuple[list[str], list[str]]:
    """Architecture flags of `model` for Megatron-Core's GPT model."""
    dense = next((layer.dense_ffn for layer in model.layers if layer.kind == "dense"), 0)
    gated = model.layers[0].moe.gated if model.layers[0].moe else model.layers[0].dense_gated
    ffn = dense or (model.first_moe.expert_ffn if model.first_moe else 0)
    args = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--ffn-hidden-size", str(ffn),
            "--seq-length", str(seq_len), "--max-position-embeddings",
            str(max(seq_len, model.max_position_embeddings)),
            "--position-embedding-type", "rope", "--normalization", "RMSNorm"]  # fmt: skip
    att_args, notes = _attention_args(model)
    args += att_args
    if gated:
        args.append("--swiglu")
    if not model.tie_word_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not model.layers[0].attention.bias:
        args.append("--disable-bias-linear")
    moe_args, moe_notes = _moe_args(model)
    args += moe_args
    notes += moe_notes
    if model.num_mtp_layers:
        args += ["--mtp-num-layers", str(model.num_mtp_layers)]
    notes.append(f"tokenizer flags are yours to add (the model's vocab_size is {model.vocab_size})")
    return args, notes


def _placement_notes(plan: Plan) -> list[str]:
    notes = []
    p = plan.parallel
    permuted = noncontiguous_expert_layers(plan)
    if permuted:
        notes.append(
            f"{permuted} of {len(plan.experts)} MoE layers use a non-contiguous expert placement; "
            "Megatron puts expert e on EP rank e // (E/ep): permute the experts in the checkpoint"
        )
    moved = [r.rank for r in plan.ranks if r.rank != r.tp + p.tp * (r.dp + p.dp * r.stage)]
    if moved:
        notes.append(
            f"{len(moved)} ranks differ from Megatron's tp-cp-ep-dp-pp rank order; launch with "
            "the slurm export's hostfile so each rank lands on the node the plan chose"
        )
    return notes


def megatron_args(plan: Plan, model: ModelSpec) -> MegatronArgs:
    """All Megatron-LM flags for `plan` (parallel sizes, batch, recompute, model, MoE)."""
    p, training = plan.parallel, plan.training
    gbs = p.dp * p.micro_batch * p.num_microbatches
    args = ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size", str(p.pp),
            "--expert-model-parallel-size", str(p.ep), "--expert-tensor-parallel-size", "1",
            "--micro-batch-size", str(p.micro_batch), "--global-batch-size", str(gbs)]  # fmt: skip
    if p.tp > 1:  # the resource model splits tokens over tp (and Megatron wants it with MoE)
        args.append("--sequence-parallel")
    notes = []
    if training.get("global_batch") not in (None, gbs):
        notes.append(f"global batch is dp*micro_batch*num_microbatches = {gbs} as planned, not "
                     f"the requested {training['global_batch']}")  # fmt: skip
    counts = [len(s.layers) for s in sorted(plan.stages, key=lambda s: s.stage)]
    split, split_notes = pipeline_split_args(counts, model.num_mtp_layers)
    rc, rc_notes = recompute_args(plan)
    margs, mnotes = model_args(model, int(training.get("seq_len", 4096)))
    args += split + rc + margs
    dtype_flag = _DTYPE_FLAGS.get(str(training.get("dtype", "bf16")))
    if dtype_flag:
        args.append(dtype_flag)
    if training.get("zero"):
        args.append("--use-distributed-optimizer")
    notes += split_notes + rc_notes + mnotes + _placement_notes(plan)
    return MegatronArgs(tuple(args), tuple(notes))


def megatron_script(plan: Plan, model: ModelSpec) -> tuple[str, tuple[str, ...]]:
    """The bash snippet of Megatron-LM flags for `plan` (notes as comments) and the notes."""
    m = megatron_args(plan, model)
    return render_megatron(plan, m.args, m.notes), m.notes


def render_megatron(plan: Plan, args: tuple[str, ...], notes: tuple[str, ...]) -> str:
    """A bash snippet defining MEGATRON_ARGS; use: source it, then pretrain_gpt.py "${...[@]}"."""
    lines = [f"# Megatron-LM arguments for {plan_title(plan)}", "# generated by 'piper export'"]
    lines += [f"# NOTE: {n}" for n in notes]
    lines.append("MEGATRON_ARGS=(")
    i = 0
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        lines.append(f"  {flag}" + (f" {shlex.quote(value)}" if value is not None else ""))
        i += 2 if value is not None else 1
    lines.append(")")
    return "\n".join(lines) + "\n"
