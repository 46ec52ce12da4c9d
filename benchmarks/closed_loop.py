"""The closed loop on this machine: profile it, plan a shortlist on the profile, run every
shortlisted layout, and set each prediction beside its measurement.

    OMP_NUM_THREADS=1 python3 benchmarks/closed_loop.py [--nproc 2] [--shortlist 3]
        [--steps 12] [--seq-len 128] [--global-batch 32] [--model tiny-moe] [--repeats N]
        [--work DIR] [--no-results]

1. `piper profile --quick --nproc N --ranks-per-node N`: this machine's GEMM, attention,
   memory, permute and all-to-all tables and the host time per layer (a CPU machine: N gloo
   processes, one node; one process per core keeps run-to-run noise near 10%).
2. `piper plan --model M --cluster <profile> --gpus N ... --shortlist K --trial-steps S`.
3. Every trial's `trial.sh` (`piper run PLAN --steps S`), one after another.
4. Per layout: the plan's predicted tokens/s per GPU and its 80% interval, the measured median
   over the steps after the first (planner.calibrate.runs.run_of_metrics, as `piper calibrate`
   reads a run), predicted / measured. Targets: every layout within +-20% of its prediction;
   the pick (the plan itself, trial 1) measured fastest, or the fastest inside the pick's
   interval.

Nothing is fitted on the runs: the profile alone sets the model's constants. Time only with
nothing else running (the machine has as many cores as processes).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from results_md import ROOT, recorded

from planner.calibrate.compare import estimate_plan, plan_inputs
from planner.calibrate.runs import run_of_metrics
from planner.plan import load_plan

WITHIN = 0.20
PIPER = [sys.executable, "-c", "import sys; from planner.cli import main; sys.exit(main())"]


@dataclass(frozen=True)
class Trial:
    name: str
    predicted: float  # tokens/s per GPU
    lo: float | None  # the plan's 80% interval, when it has one
    hi: float | None
    measured: float
    without_host: float  # predicted with the profile's layer_overhead_us at 0

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured


def _piper(args: list[str], env: dict[str, str], timeout_s: float) -> str:
    proc = subprocess.run([*PIPER, *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"closed_loop: piper {args[0]} failed: {proc.stderr.strip()[-600:]}")
    return proc.stdout


def _trial(folder: Path, gpus: int) -> Trial:
    plan = load_plan(folder / "plan.json")
    run = run_of_metrics(folder / "plan.json", folder / "run" / "metrics.jsonl", skip_steps=1)
    ivs = plan.predicted.intervals
    per_gpu = 1.0 / gpus
    cluster = plan_inputs(plan)[1]
    bare = estimate_plan(plan, replace(cluster, layer_overhead_us=0.0))
    return Trial(
        name=folder.name, predicted=plan.predicted.tokens_per_s * per_gpu,
        lo=ivs.tokens_per_s.lo * per_gpu if ivs else None,
        hi=ivs.tokens_per_s.hi * per_gpu if ivs else None, measured=run.measured,
        without_host=bare.tokens_per_s * per_gpu,
    )  # fmt: skip


def closed_loop(args: argparse.Namespace, work: Path) -> list[Trial]:
    """Profile, plan the shortlist, run every trial; the trials in shortlist order."""
    bin_dir = (
        work / "bin"
    )  # the trials' scripts call `piper`: this checkout's, whatever is installed
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "piper").write_text(f'#!/bin/sh\nexec {shlex.join(PIPER)} "$@"\n')
    (bin_dir / "piper").chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
    profile = work / "profile.yaml"
    _piper(["profile", "--quick", "--nproc", str(args.nproc), "--ranks-per-node",
            str(args.nproc), "--out", str(profile)], env, 600)  # fmt: skip
    out = work / "plan"
    _piper(["plan", "--model", args.model, "--cluster", str(profile), "--gpus", str(args.nproc),
            "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch),
            "--shortlist", str(args.shortlist), "--trial-steps", str(args.steps),
            "--out", str(out)], env, 600)  # fmt: skip
    folders = sorted(p for p in (out / "shortlist").iterdir() if p.is_dir() and p.name[0].isdigit())
    for folder in folders:
        proc = subprocess.run(["bash", str(folder / "trial.sh")], capture_output=True, text=True,
                              env=env, timeout=900)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"closed_loop: {folder.name} failed: {proc.stderr.strip()[-600:]}")
    return [_trial(f, args.nproc) for f in folders]


def verdicts(trials: list[Trial]) -> list[tuple[str, bool, str]]:
    """(criterion, pass, measured) for the two targets (module docstring)."""
    worst = max(trials, key=lambda t: abs(math.log(t.ratio)))
    pick, fastest = trials[0], max(trials, key=lambda t: t.measured)
    inside = pick.lo is not None and pick.lo <= fastest.measured <= (pick.hi or math.inf)
    return [
        (f"every layout within +-{WITHIN:.0%} of its prediction",
         all(abs(t.ratio - 1) <= WITHIN for t in trials),
         f"worst {worst.name} predicted / measured {worst.ratio:.2f}"),
        ("the pick measured fastest, or the fastest inside its interval",
         pick is fastest or inside,
         f"pick {pick.measured:,.0f}, fastest {fastest.name} {fastest.measured:,.0f} tokens/s/GPU"),
    ]  # fmt: skip


def report(trials: list[Trial]) -> None:
    print(f"{'layout':<38} {'predicted':>9} {'80% interval':>17} {'measured':>8} "
          f"{'pred/meas':>9} {'no host':>8}")  # fmt: skip
    for t in trials:
        band = f"[{t.lo:,.0f}, {t.hi:,.0f}]" if t.lo is not None else "-"
        print(f"{t.name:<38} {t.predicted:>9,.0f} {band:>17} {t.measured:>8,.0f} "
              f"{t.ratio:>9.2f} {t.without_host / t.measured:>8.2f}")  # fmt: skip
    print("tokens/s per GPU; measured: median over the steps after the first; no host: pred/meas "
          "with the profile's host time per layer set to 0")  # fmt: skip
    for criterion, ok, figure in verdicts(trials):
        print(f"{'pass' if ok else 'FAIL'}  {criterion}: {figure}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--shortlist", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="whole loops, each from a new profile")
    p.add_argument("--work", default=None, help="folder for the profile, plan and runs")
    p.add_argument("--no-results", action="store_true")
    args = p.parse_args()
    with recorded("results/closed_loop.md", "Closed loop on this machine: profile, plan, run",
                  enabled=not args.no_results):  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(args.work or tmp)
            work.mkdir(parents=True, exist_ok=True)
            print(
                f"{args.model}, {args.nproc} gloo processes, seq {args.seq_len}, global batch "
                f"{args.global_batch}, shortlist {args.shortlist}, {args.steps} steps each"
            )
            for k in range(args.repeats):  # each loop profiles, plans and runs afresh
                print(f"\nloop {k + 1} of {args.repeats}")
                report(closed_loop(args, work / f"loop{k + 1}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
