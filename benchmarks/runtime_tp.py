"""Tensor parallelism inside real training runs (`piper run`, CPU gloo emulation).

Plans tiny-moe on the cpu-gloo cluster twice with the same pp, dp, ep, micro-batch and
global batch, once with tp = 1 and once with tp = 2 (twice the processes), both fp32, trains
both for the same steps and prints side by side: the loss agreement (the same data and model,
so the loss sequences must agree to fp32 rounding), bytes per step by kind (pipeline sends,
TP collectives, dispatch, gradients), peak memory per rank and step time, with tp=2 / tp=1
ratios. With sequence parallelism the pipeline sends of a TP rank are 1/tp of the tp = 1
rank's, so the stages exchange the same bytes in total. CPU step times only say how the
emulation behaves (8 processes share this machine's cores).

Usage: python benchmarks/runtime_tp.py [--steps 10] [--out DIR] [--results FILE]
Runs go to DIR (default a temporary directory); what it prints goes to
results/runtime_tp.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_md import recorded

KINDS = ("p2p", "tp", "dispatch", "grad_dense", "grad_expert", "grad_tp")


def _piper(*args: str) -> None:
    code = "import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, *args], check=True, stdout=subprocess.DEVNULL)


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _bytes(line: dict, kind: str) -> int:
    by_kind = line["bytes_by_kind"]
    return by_kind.get(f"{kind}_intra", 0) + by_kind.get(f"{kind}_inter", 0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None, help="directory for the plans and runs")
    p.add_argument("--results", default="results/runtime_tp.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="piper-tp-"))
    title = "Tensor parallelism in piper run: tp=2 vs tp=1"
    with recorded(args.results, title, enabled=not args.no_results):
        compare(root, args.steps)
    return 0


def compare(root: Path, steps: int) -> None:
    """Plan and train tp=1 and tp=2 under `root` for `steps` steps; print them side by side."""
    results = {}
    for tp in (1, 2):
        plan_dir, out = root / f"plan-tp{tp}", root / f"run-tp{tp}"
        _piper("plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", str(4 * tp),
               "--pp", "2", "--dp", "2", "--tp", str(tp), "--ep", "2", "--micro-batch", "2",
               "--seq-len", "128", "--global-batch", "16", "--dispatcher", "flat",
               "--dtype", "fp32", "--out", str(plan_dir))  # fmt: skip
        _piper("run", str(plan_dir / "plan.json"), "--steps", str(steps),
               "--ranks-per-node", "2", "--dispatcher", "flat", "--out", str(out))  # fmt: skip
        results[tp] = _lines(out)
    one, two = results[1], results[2]
    dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(one, two, strict=True))
    print(f"tiny-moe, pp=2 dp=2 ep=2, micro-batch 2 x seq 128, {steps} steps; plans in {root}")
    print(f"loss tp=1 {one[0]['loss']:.4f} -> {one[-1]['loss']:.4f}, max |tp=2 - tp=1| {dloss:.2e}")
    last1, last2 = one[-1], two[-1]  # the last step: no shape-inference forward
    print(f"{'bytes/step':<12} {'tp=1':>12} {'tp=2':>12} {'tp2/tp1':>8}")
    for kind in KINDS:
        a, b = _bytes(last1, kind), _bytes(last2, kind)
        ratio = f"{b / a:8.3f}" if a else f"{'-':>8}"
        print(f"{kind:<12} {a:>12,} {b:>12,} {ratio}")

    def per_rank_peak(lines: list[dict]) -> float:
        return max(r["peak_memory_bytes"] for r in lines[-1]["per_rank"]) / 2**20

    def step_s(lines: list[dict]) -> float:
        return statistics.median(x["step_time_s"] for x in lines[1:] or lines)

    m1, m2, s1, s2 = per_rank_peak(one), per_rank_peak(two), step_s(one), step_s(two)
    print(f"{'peak MiB/rank':<12} {m1:>12.0f} {m2:>12.0f} {m2 / m1:8.3f}")
    print(f"{'step s':<12} {s1:>12.3f} {s2:>12.3f} {s2 / s1:8.3f}")


if __name__ == "__main__":
    sys.exit(main())
