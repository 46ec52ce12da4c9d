"""What `piper model-info` reports: parameter counts with their basis, FLOPs, layer kinds.

FLOPs per token are in Megatron-Core's convention (planner.resources.flops), the same count
`piper estimate` and `piper plan` divide by step time for TFLOPS/GPU and MFU.

`describe_model(name_or_path, seq_len)` returns a plain dict (JSON-ready, deterministic);
`counts_on_basis` converts Piper's counts to the basis a publication used, so published
totals can be compared like for like.
"""

from __future__ import annotations

from typing import Any

from planner.inputs.models import (
    PublishedCounts,
    model_from_config,
    published_counts,
    resolve_model,
)
from planner.resources.flops import FLOPS_CONVENTION, FLOPS_FORMULA, flops_per_token
from planner.resources.params import ParamCounts, count_params
from planner.specs import LayerSpec, ModelSpec

COUNTING_BASIS = (
    "total_params: every weight of the main model (input embedding, untied output head, "
    "attention, dense MLPs, all routed and shared experts, routers, norms, biases), MTP "
    "modules excluded; mtp_params: the multi-token-prediction modules (embedding and head "
    "shared, not counted again); active_params: the weights one token uses: embedding, head, "
    "attention, dense MLPs, shared experts, routers and top_k routed experts per MoE layer"
)


def counts_on_basis(model: ModelSpec, counts: ParamCounts, basis: str) -> int:
    """Piper's counts restated on a publication's basis (see models.PublishedCounts)."""
    head_proj = counts.head - model.hidden_size  # head_params includes the final norm
    if basis == "total":
        return counts.total
    if basis == "total_with_mtp":
        return counts.total + counts.mtp
    if basis == "no_embeddings":
        return counts.total - counts.embedding - head_proj
    if basis == "active":
        return counts.active
    if basis == "active_no_input_embedding":
        return counts.active - counts.embedding
    if basis == "active_no_embeddings":
        return counts.active - counts.embedding - head_proj
    raise ValueError(f"unknown counting basis '{basis}'")


def _signature(layer: LayerSpec) -> str:
    att = layer.attention
    text = f"{att.kind} {att.num_heads}h/{att.num_kv_heads}kv"
    if att.sliding_window:
        text += f" window {att.sliding_window}"
    if layer.moe is None:
        return f"dense: ffn {layer.dense_ffn}{'' if layer.dense_gated else ' (2-matrix)'}, {text}"
    moe = layer.moe
    text = f"moe: E={moe.num_experts} k={moe.top_k} expert ffn {moe.expert_ffn}, {text}"
    if not moe.gated:
        text += ", 2-matrix experts"
    if moe.num_shared_experts:
        text += f", {moe.num_shared_experts} shared ffn {moe.shared_ffn}"
    if layer.dense_ffn:
        text += f", residual dense ffn {layer.dense_ffn}"
    return text


def compress_indices(indices: list[int]) -> str:
    """'3-60' for a run, '1-47 step 2' for a stride, else a comma list."""
    if len(indices) == 1:
        return str(indices[0])
    steps = {b - a for a, b in zip(indices, indices[1:], strict=False)}
    if len(steps) == 1:
        step = steps.pop()
        suffix = "" if step == 1 else f" step {step}"
        return f"{indices[0]}-{indices[-1]}{suffix}"
    return ",".join(str(i) for i in indices)


def layer_kinds(model: ModelSpec) -> list[dict[str, Any]]:
    """Layers grouped by identical structure, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, layer in enumerate(model.layers):
        groups.setdefault(_signature(layer), []).append(i)
    return [
        {"layers": compress_indices(idx), "count": len(idx), "kind": sig}
        for sig, idx in groups.items()
    ]


def _published(model: ModelSpec, counts: ParamCounts, pub: PublishedCounts) -> dict[str, Any]:
    out: dict[str, Any] = {"source": pub.source, "note": pub.note}
    for label, value, basis in (
        ("total", pub.total_params, pub.total_basis),
        ("active", pub.active_params, pub.active_basis),
    ):
        if value is None:
            continue
        computed = counts_on_basis(model, counts, basis)
        out[label] = {
            "published": value,
            "computed": computed,
            "basis": basis,
            "error_pct": round(100.0 * (computed / value - 1.0), 3),
        }
    return out


def describe_model(name_or_path: str, seq_len: int = 4096) -> dict[str, Any]:
    """Everything `piper model-info` prints, as a JSON-ready dict."""
    cfg, name, source = resolve_model(name_or_path)
    model = model_from_config(cfg, name, source)
    counts = count_params(model)
    flops = flops_per_token(model, seq_len)
    info: dict[str, Any] = {
        "name": model.name,
        "family": model.family,
        "source": model.source,
        "hidden_size": model.hidden_size,
        "vocab_size": model.vocab_size,
        "num_layers": model.num_layers,
        "num_moe_layers": len(model.moe_layers),
        "tie_word_embeddings": model.tie_word_embeddings,
        "total_params": counts.total,
        "active_params": counts.active,
        "mtp_params": counts.mtp,
        "embedding_params": counts.embedding,
        "head_params": counts.head,
        "flops_per_token": flops.total,
        "mtp_flops_per_token": flops.mtp,
        "flops_breakdown": {
            "mlp": flops.mlp,
            "attention_linear": flops.attention_linear,
            "attention_core": flops.attention_core,
            "logits": flops.logits,
            "mtp": flops.mtp,
        },
        "flops_seq_len": seq_len,
        "flops_convention": FLOPS_CONVENTION,
        "flops_formula": FLOPS_FORMULA,
        "counting_basis": COUNTING_BASIS,
        "layers": layer_kinds(model),
    }
    pub = published_counts(cfg, source)
    if pub is not None and (pub.total_params or pub.active_params):
        info["published"] = _published(model, counts, pub)
    return info
