"""`piper a2a-sim`: flat all-to-all vs HALO on a modeled topology (flow-level simulator)."""

from __future__ import annotations

import argparse
import json
import re

from planner.outputs.console import print_table
from planner.sim.a2a import ALGOS
from planner.sim.halo import SimResult, simulate_all_to_all
from planner.specs import SpecError

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9}


def parse_bytes(text: str) -> float:
    """'4096', '64KiB', '1.5MiB', '2MB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise SpecError(f"--bytes-per-rank {text!r}: write a number with an optional KiB/MiB/GiB")
    try:
        value = float(m.group(1)) * _UNITS[unit]
    except ValueError:
        raise SpecError(f"--bytes-per-rank {text!r}: not a number") from None
    if not value < MAX_BYTES:
        raise SpecError(f"--bytes-per-rank {text!r}: give less than 1 PiB per rank")
    return value


MAX_BYTES = 2.0**50  # 1 PiB


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "a2a-sim",
        help="simulate flat all-to-all vs HALO on a cluster topology",
        description="Flow-level simulation (max-min fair links, per-message overhead) of one "
        "all-to-all: flat vs HALO vs HALO with dedup. See planner/SIMULATOR.md.",
    )
    p.add_argument("--cluster", default="frontier", help="preset name or cluster YAML")
    p.add_argument("--nodes", type=int, required=True, help="nodes in the allocation")
    p.add_argument("--bytes-per-rank", required=True, help="bytes each rank sends, e.g. 1MiB")
    p.add_argument("--topk", type=int, default=8, help="experts per token (dedup model)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (default: ranks)")
    p.add_argument("--algo", default="all", choices=[*ALGOS, "all"])
    p.add_argument(
        "--overhead-us",
        type=float,
        default=None,
        help="per-message software cost in us (default: the cluster's msg_overhead_us)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _print_table(results: list[SimResult]) -> None:
    rows = [
        (r.algo, f"{r.time_s * 1e6:.1f}", f"{r.messages_per_rank:.0f}",
         f"{sum(lv.bytes for lv in r.levels if lv.level == 'nic') / 1e6:.2f}",
         f"{r.dedup_ratio:.2f}", r.bottleneck)
        for r in results
    ]  # fmt: skip
    columns = ("algo", "time_us", "msgs/rank", "net_MB", "dedup", "bottleneck")
    print_table("", columns, rows)


def run(args: argparse.Namespace) -> int:
    from planner.inputs.clusters import load_cluster

    cluster = load_cluster(args.cluster)
    nbytes = parse_bytes(args.bytes_per_rank)
    algos = list(ALGOS) if args.algo == "all" else [args.algo]
    results = [
        simulate_all_to_all(
            cluster, args.nodes, nbytes, a, args.topk, args.experts, args.overhead_us
        )
        for a in algos
    ]
    by_algo = {r.algo: r for r in results}
    ratios = {
        f"flat_over_{a.replace('-', '_')}": by_algo["flat"].time_s / by_algo[a].time_s
        for a in ("halo", "halo-dedup")
        if "flat" in by_algo and a in by_algo
    }
    if args.json:
        if len(results) == 1:
            out = results[0].to_dict()
        else:
            out = {"results": {r.algo: r.to_dict() for r in results}, "ratios": ratios}
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    r0 = results[0]
    print(
        f"{r0.cluster}: {r0.nodes} nodes x {r0.ranks // r0.nodes} ranks, "
        f"{nbytes:.0f} B per rank, top-{r0.topk}, {r0.experts} experts"
    )
    _print_table(results)
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    return 0
