"""`piper trace synth ...` makes a synthetic expert-load trace; `piper trace check FILE`
validates one and prints its shape."""

from __future__ import annotations

import argparse
import json

from planner.migration.synth import SynthOptions, synth_trace
from planner.migration.trace import load_trace, trace_to_csv
from planner.outputs.files import write_atomic


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trace", help="make or check expert-load traces (interval,layer,expert,tokens CSV)"
    )
    sub = p.add_subparsers(dest="trace_command", metavar="ACTION")
    s = sub.add_parser(
        "synth",
        help="synthetic trace: skewed, drifting popularity with regime shifts, top-k counts",
    )
    d = SynthOptions()
    s.add_argument("--layers", type=int, default=d.layers, help=f"MoE layers (default {d.layers})")
    s.add_argument("--experts", type=int, default=d.experts, help=f"default {d.experts}")
    s.add_argument("--intervals", type=int, default=d.intervals, help=f"default {d.intervals}")
    s.add_argument(
        "--tokens", type=int, default=d.tokens, help=f"tokens per interval (default {d.tokens})"
    )
    s.add_argument("--topk", type=int, default=d.top_k, help=f"experts per token ({d.top_k})")
    s.add_argument("--skew", type=float, default=d.skew, help=f"Zipf exponent ({d.skew})")
    s.add_argument(
        "--drift", type=float, default=d.drift, help=f"logit step std per interval ({d.drift})"
    )
    s.add_argument(
        "--revert", type=float, default=d.revert, help=f"pull back to the base ({d.revert})"
    )
    s.add_argument(
        "--shift-prob", type=float, default=d.shift_prob, help=f"regime shifts ({d.shift_prob})"
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True, help="CSV file to write")
    s.set_defaults(func=run_synth)
    c = sub.add_parser("check", help="validate a trace file and print its shape")
    c.add_argument("file")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=run_check)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_synth(args: argparse.Namespace) -> int:
    opts = SynthOptions(
        layers=args.layers,
        experts=args.experts,
        intervals=args.intervals,
        tokens=args.tokens,
        top_k=args.topk,
        skew=args.skew,
        drift=args.drift,
        revert=args.revert,
        shift_prob=args.shift_prob,
        seed=args.seed,
    )
    write_atomic(args.out, trace_to_csv(synth_trace(opts)))
    print(
        f"wrote {args.out}: {opts.intervals} intervals x {opts.layers} layers x "
        f"{opts.experts} experts ({opts.tokens} tokens, top-{opts.top_k} per interval)"
    )
    return 0


def run_check(args: argparse.Namespace) -> int:
    trace = load_trace(args.file)
    info = {
        "file": args.file,
        "intervals": trace.num_intervals,
        "layers": list(trace.layer_ids),
        "experts": trace.num_experts,
        "tokens_per_interval_mean": float(trace.tokens_ILE.sum(axis=2).mean()),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(
            f"{args.file}: ok, {info['intervals']} intervals, layers {info['layers']}, "
            f"{info['experts']} experts, {info['tokens_per_interval_mean']:.0f} tokens per "
            f"interval and layer"
        )
    return 0
