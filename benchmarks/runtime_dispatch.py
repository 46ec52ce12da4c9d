"""Flat vs HALO vs HALO-dedup inside real training runs (`piper run`, CPU gloo emulation).

Plans tiny-moe on the cpu-gloo cluster (2 ranks per emulated node) with the expert group
spanning every node (pp=1, dp=ep=8 -> 4 nodes), trains the same steps with each
dispatcher (HALO forced onto its three-phase path: direct-send threshold 0) and prints,
side by side: the loss sequence agreement, the dispatch bytes each rank sent per
step within and across nodes, and step time, with ratios to flat. CPU step times only say
how the emulation behaves; the bytes are what the network would carry.

Usage: python benchmarks/runtime_dispatch.py [--steps 10] [--gpus 8] [--out DIR]
Runs go to DIR (default a temporary directory); what it prints goes to
results/runtime_dispatch.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from results_md import recorded


def _piper(*args: str) -> None:
    code = "import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, *args], check=True, stdout=subprocess.DEVNULL)


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--out", default=None, help="directory for the plan and runs")
    p.add_argument("--results", default="results/runtime_dispatch.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="piper-dispatch-"))
    title = "Flat vs HALO vs HALO-dedup in piper run"
    with recorded(args.results, title, enabled=not args.no_results):
        compare(root, args)
    return 0


def compare(root: Path, args: argparse.Namespace) -> None:
    """Plan the same layout once per dispatcher under `root` (a full-size run runs the
    dispatcher its plan priced), train each, print them side by side."""
    results, layouts = {}, {}
    for kind in ("flat", "halo", "halo-dedup"):
        plan_dir = root / f"plan-{kind}"
        _piper(
            "plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", str(args.gpus),
            "--pp", "1", "--tp", "1", "--dp", str(args.gpus), "--ep", str(args.gpus),
            "--vp", "1", "--micro-batch", "2", "--recompute", "none", "--no-fsdp",
            "--seq-len", "128", "--global-batch", str(2 * args.gpus), "--dispatcher", kind,
            "--out", str(plan_dir),
        )  # fmt: skip
        plan = json.loads((plan_dir / "plan.json").read_text())
        layouts[kind] = (plan["parallel"], plan["stages"], plan["experts"])
        out = root / kind
        _piper(
            "run", str(plan_dir / "plan.json"), "--steps", str(args.steps), "--out", str(out),
            "--ranks-per-node", "2",
            "--halo-direct-below-bytes", "0",  # the three-phase path even for these small messages
        )  # fmt: skip
        results[kind] = _lines(out)
    if any(layout != layouts["flat"] for layout in layouts.values()):
        raise SystemExit("runtime_dispatch: the three plans differ beyond the dispatcher")
    plan_dir = root / "plan-flat"
    base = results["flat"]
    print(f"plan: {plan_dir / 'plan.json'}  ({args.gpus} ranks, 2 per node, {args.steps} steps)")
    print(
        f"{'dispatcher':<11} {'max|dloss|':>10} {'intra B/step':>13} {'inter B/step':>13} "
        f"{'inter/flat':>10} {'step s':>8} {'time/flat':>9}"
    )
    for kind, lines in results.items():
        dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(lines, base, strict=True))
        skip = lines[1:] or lines  # step 0 includes warm-up
        intra = sum(x["bytes_by_kind"].get("dispatch_intra", 0) for x in skip) / len(skip)
        inter = sum(x["bytes_by_kind"].get("dispatch_inter", 0) for x in skip) / len(skip)
        b_inter = sum(x["bytes_by_kind"].get("dispatch_inter", 0) for x in base[1:] or base)
        b_inter /= len(base[1:] or base)
        step = sorted(x["step_time_s"] for x in skip)[len(skip) // 2]
        b_step = sorted(x["step_time_s"] for x in base[1:] or base)[len(skip) // 2]
        print(
            f"{kind:<11} {dloss:>10.2e} {intra:>13,.0f} {inter:>13,.0f} "
            f"{inter / b_inter:>10.3f} {step:>8.3f} {step / b_step:>9.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
