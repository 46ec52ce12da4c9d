"""Where the wall time of `piper plan` goes, and whether timings.json accounts for all of it.

Issue 27's case: OLMoE's layer shape with 24 layers (64 experts, top-8) on 32 H100s, planned
for Piper's runtime without FSDP so the plan gets redundant expert slots (the expert IP with
replicas), once with equal loads and once with a synthetic trace whose 24 MoE layers all
differ (24 replica solves sharing --time-limit-s). Each case runs --repeats times as a fresh
process, as a user runs it; the table gives the median wall time measured outside the
process, the CPU seconds of the child (user + sys: steadier than the wall on a shared
machine), the medians of timings.json's phases, `total_s` (their sum) and the wall time
outside every phase (wall - total_s: the interpreter's exit and the launcher), the 1-minute
load average, and the predicted tokens/s from plan.json.

    OMP_NUM_THREADS=1 python3 benchmarks/plan_phases.py [--repeats 3] [--tree DIR] [--cases ...]

--tree DIR runs the planner of another checkout (PYTHONPATH=DIR), e.g. an older commit
unpacked with `git archive`, to compare before and after. Writes what it prints to
results/plan_phases.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import recorded

REPO = Path(__file__).resolve().parent.parent
PHASES = ("startup_s", "inputs_s", "search_s", "redundant_slots_s", "render_s")
CASES = ("equal loads", "trace, 24 distinct layers")


def _inputs(tmp: Path) -> tuple[Path, Path]:
    """The 24-layer OLMoE-shaped config.json and a trace with a different skew per layer."""
    config = json.loads((REPO / "profiles" / "models" / "olmoe-1b-7b.json").read_text())
    config["num_hidden_layers"] = 24
    config.pop("_piper", None)
    (tmp / "olmoe-24l").mkdir(exist_ok=True)
    model = tmp / "olmoe-24l" / "config.json"
    model.write_text(json.dumps(config))
    rng = random.Random(27)
    rows = ["interval,layer,expert,tokens"]
    for layer in range(24):
        skew = rng.uniform(0.3, 1.2)
        rows += [f"0,{layer},{e},{int(1e6 / (e + 1) ** skew)}" for e in range(64)]
    trace = tmp / "trace.csv"
    trace.write_text("\n".join(rows) + "\n")
    return model, trace


def _run(args: argparse.Namespace, argv: list[str]) -> tuple[float, float, int]:
    """(wall s, child CPU s, exit code) of one fresh `piper` process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.tree:
        env["PYTHONPATH"] = str(Path(args.tree).resolve())
    cmd = [sys.executable, "-c", "import sys; from planner.cli import main; sys.exit(main())"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # run outside the checkout: `python -c` puts the working directory ahead of PYTHONPATH
    done = subprocess.run([*cmd, *argv], capture_output=True, text=True, check=False, env=env,
                          cwd=tempfile.gettempdir())  # fmt: skip
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode:
        print(done.stderr.strip().splitlines()[-1], file=sys.stderr)
    return wall, cpu, done.returncode


def _case(args: argparse.Namespace, name: str, model: Path, trace: Path, out: Path) -> None:
    argv = ["plan", "--model", str(model), "--cluster", "h100", "--gpus", "32", "--target",
            "piper", "--no-fsdp", "--time-limit-s", str(args.time_limit_s),
            "--out", str(out)]  # fmt: skip
    if name.startswith("trace"):
        argv += ["--trace", str(trace)]
    walls, cpus, timings, load = [], [], [], os.getloadavg()[0]
    for _ in range(args.repeats):
        wall, cpu, code = _run(args, argv)
        if code:
            print(f"{name:<26} exit {code}")
            return
        walls.append(wall)
        cpus.append(cpu)
        timings.append(json.loads((out / "timings.json").read_text()))
    plan = json.loads((out / "plan.json").read_text())
    med = {k: statistics.median(t.get(k, float("nan")) for t in timings) for k in PHASES}
    total = statistics.median(t["total_s"] for t in timings)
    slots = plan["extra"]["redundant_slots"]["redundant_slots"]
    report = plan["extra"]["expert_solver"]
    print(
        f"{name:<26} {statistics.median(walls):>7.2f} {statistics.median(cpus):>6.2f}  "
        + " ".join(f"{med[k]:>7.2f}" for k in PHASES)
        + f" {total:>7.2f} {statistics.median(walls) - total:>7.2f} {load:>5.1f}"
        f"  {plan['predicted']['tokens_per_s']:>12,.0f} {slots:>5}  "
        f"{report['status']} gap {report['gap']:.3g}  runs {', '.join(f'{w:.1f}' for w in walls)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per case (median reported)")
    ap.add_argument("--time-limit-s", type=float, default=10.0)
    ap.add_argument("--tree", default=None, help="run the planner of this checkout instead")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--results", default="results/plan_phases.md", help="markdown to write")
    ap.add_argument("--no-results", action="store_true", help="print only")
    args = ap.parse_args()
    with recorded(args.results, "Where piper plan's time goes", enabled=not args.no_results):
        print(f"OLMoE shape, 24 layers x 64 experts, 32 H100s, --target piper --no-fsdp, "
              f"--time-limit-s {args.time_limit_s:g}, {args.repeats} runs per case, medians; "
              f"planner: {args.tree or 'this checkout'}")  # fmt: skip
        head = " ".join(f"{k:>7}" for k in ("wall_s", "cpu_s", *(p[:-2][:7] for p in PHASES)))
        print(f"{'case':<26} {head} {'total_s':>7} {'outside':>7} {'load':>5}  "
              f"{'tokens/s':>12} {'slots':>5}  expert IP (replicas)")  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            model, trace = _inputs(Path(tmp))
            for name in args.cases:
                _case(args, name, model, trace, Path(tmp) / "out")


if __name__ == "__main__":
    main()
