"""`piper model-info M [--json] [--seq-len S]`: parameter counts, FLOPs per token, layer kinds."""

from __future__ import annotations

import argparse
import json
from typing import Any

from planner.inputs.models import list_model_presets
from planner.outputs.console import print_table
from planner.resources.model_info import describe_model
from planner.specs import SpecError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "model-info",
        help="parameter counts (total/active/MTP, with basis), FLOPs per token, layer kinds",
        description="Describe a model preset or an HF config.json / YAML file.",
    )
    p.add_argument("model", nargs="?", help="preset name or path to config.json / .yaml")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length for FLOPs")
    p.add_argument("--list", action="store_true", help="list the model presets and exit")
    p.set_defaults(func=run)


def _b(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n:,.0f}"


def _embedding_head(info: dict[str, Any]) -> str:
    """Both counts; a tied head reuses the embedding, and only its final norm counts apart."""
    emb, head = _b(info["embedding_params"]), _b(info["head_params"])
    if info["tie_word_embeddings"]:
        return f"{emb} / tied to the embedding (its final norm: {head})"
    return f"{emb} / {head}"


def print_report(info: dict[str, Any]) -> None:
    """The human-readable report: a table of counts, one of layer kinds, the bases."""
    rows = [
        ("model", f"{info['name']}  (family {info['family']}, {info['source']})"),
        ("shape", f"hidden {info['hidden_size']}, vocab {info['vocab_size']}, "
                  f"{info['num_layers']} layers ({info['num_moe_layers']} MoE)"),
        ("total_params", _b(info["total_params"])),
        ("active_params", _b(info["active_params"])),
        ("mtp_params", _b(info["mtp_params"])),
        ("embedding / head", _embedding_head(info)),
        ("flops_per_token", f"{info['flops_per_token'] / 1e9:.4g} GFLOP at seq_len "
                            f"{info['flops_seq_len']} ({info['flops_convention']} convention"
                            + (f", MTP {info['mtp_flops_per_token'] / 1e9:.4g} included"
                               if info["mtp_flops_per_token"] else "") + ")"),
    ]  # fmt: skip
    for label in ("total", "active"):
        pub = info.get("published", {}).get(label)
        if pub:
            rows.append((f"published {label}", f"{_b(pub['published'])} on basis "
                         f"'{pub['basis']}': computed {_b(pub['computed'])}, "
                         f"error {pub['error_pct']:+.2f}%"))  # fmt: skip
    print_table("", ("", "value"), rows)
    print_table("layers", ("layers", "kind"), [(g["layers"], g["kind"]) for g in info["layers"]])
    print(f"counting basis: {info['counting_basis']}")
    print(f"flops formula: {info['flops_formula']}")
    if info.get("published", {}).get("source"):
        print(f"published source: {info['published']['source']}")


def run(args: argparse.Namespace) -> int:
    if args.list:
        names = list_model_presets()
        print(json.dumps(names, indent=2) if args.json else "\n".join(names))
        return 0
    if not args.model:
        raise SpecError("model-info: give a preset name or a config path (see --list)")
    if args.seq_len < 1:
        raise SpecError(f"model-info: --seq-len must be >= 1, got {args.seq_len}")
    info = describe_model(args.model, args.seq_len)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print_report(info)
    return 0
