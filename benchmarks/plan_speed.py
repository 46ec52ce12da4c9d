"""Wall time of the whole `piper plan` command for DeepSeek-V3, on Frontier and on H100s.

Runs `piper plan --model deepseek-v3 --cluster C --gpus N --out TMP` as a user does (a fresh
process: start-up, search, placement, baselines, every output file and plot) --repeats times
per case and prints the median wall time with each run, the median CPU time of the process
(user + sys; the command is single-threaded, so on an idle machine it is the wall time), the
targets (1024 GPUs <= 10 s on either
cluster, 16384 <= 60 s), the 1-minute load average around each case (the machine is
shared), and from the last run's timings.json and plan.json: the candidates enumerated,
costed by the resource model, scored (split solved and predicted) and pruned, the chosen
layout and the stage IP's status and gap. The planner is this checkout's (PYTHONPATH), not
whichever `piper` is on PATH.

--tree DIR also times another checkout (e.g. the commit before a change: `git worktree add
/tmp/before COMMIT`), its runs alternating with this one's so both see the same load, and
prints its median, the ratio and whether its plan.json (and every other output but
timings.json) is byte-identical. With --compare-ip it also plans with the stage IP on every
candidate (`--score ip`) up to --compare-up-to GPUs and prints the time ratio and whether
plan.json is byte-identical.

    OMP_NUM_THREADS=1 python3 benchmarks/plan_speed.py [--repeats 3] [--tree DIR]
        [--cases h100:1024:megatron ...] [--compare-ip]

Writes what it prints to results/plan_speed.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import recorded

TARGET_S = {1024: 10.0, 16384: 60.0}
DEFAULT_CASES = ("frontier:64", "frontier:256", "frontier:1024", "h100:1024:megatron",
                 "h100:1024:torchtitan", "h100:1024:piper", "frontier:4096",
                 "frontier:16384")  # fmt: skip


ROOT = Path(__file__).resolve().parent.parent
CODE = "import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))"


def _command(model: str, cluster: str, gpus: int, out: Path, extra: list[str]) -> list[str]:
    args = ["plan", "--model", model, "--cluster", cluster, "--gpus", str(gpus)]
    return [sys.executable, "-c", CODE, *args, "--out", str(out), *extra]


def _run(cmd: list[str], tree: Path = ROOT) -> tuple[float, float, int, str]:
    """(wall s, CPU s of the child (user + sys: steadier than the wall on a shared machine),
    exit code, the last line of stderr) of one command with the planner of checkout `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=tree, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    err = done.stderr.strip().splitlines()
    return wall, cpu, done.returncode, err[-1] if err else ""


def _describe_tree(tree: Path) -> str:
    """The checkout's commit and the files it changes from it (git status)."""
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True)  # fmt: skip
    changed = [line[3:] for line in status.stdout.splitlines()]
    head_line = head.stdout.strip()[:70] or "not a git checkout"
    return head_line + (f"; changed: {', '.join(changed)}" if changed else "")


def _same_outputs(a: Path, b: Path) -> bool:
    """Every output file but timings.json byte-identical in run directories a and b."""
    names = sorted(p.name for p in a.iterdir() if p.name != "timings.json")
    if names != sorted(p.name for p in b.iterdir() if p.name != "timings.json"):
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def _summary(out: Path) -> tuple[dict, str, str]:
    """(timings.json, the stage IP's 'STATUS, gap G', the plan's layout) of a finished run."""
    timings = json.loads((out / "timings.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    s = plan["solver"]
    p, t = plan["parallel"], plan["training"]
    sharding = "fsdp" if t.get("fsdp") else "zero" if t["zero"] else "none"
    layout = (
        f"pp={p['pp']} vp={p['vp']} dp={p['dp']} tp={p['tp']} cp={p['cp']} ep={p['ep']} "
        f"etp={p['etp']} mb={p['micro_batch']} m={p['num_microbatches']} "
        f"recompute={p['recompute']}{_modules(p['recompute_modules'])} "
        f"{sharding} overlap={int(t['a2a_overlap'])} {plan['extra']['dispatcher']}"
    )
    tflops = plan["predicted"]["tflops_per_gpu"]
    step = plan["predicted"]["step_time_s"]
    return (
        timings,
        f"{s['status']}, gap {s['gap']:.2g}",
        f"{layout}; {step:.4g} s, {tflops:.1f} TFLOPS/GPU",
    )


def _modules(names: list[str]) -> str:
    return f"({','.join(names)})" if names else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                    help="CLUSTER:GPUS[:TARGET] (TARGET: the --target engine; default the "
                    "cluster's)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="runs per case (median reported)")
    ap.add_argument("--solver", default="cpsat", choices=("cpsat", "cbc"))
    ap.add_argument("--tree", type=Path, help="another checkout to time alternately (before)")
    ap.add_argument("--compare-ip", action="store_true", help="also time --score ip")
    ap.add_argument("--compare-up-to", type=int, default=1024)
    ap.add_argument("--results", default="results/plan_speed.md", help="markdown to write")
    ap.add_argument("--no-results", action="store_true", help="print only")
    args = ap.parse_args()
    with recorded(args.results, "Planning wall time", enabled=not args.no_results):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Plan every case --repeats times and print one row each."""
    print(f"{args.model}, seq 4096, global batch 1024, solver {args.solver}, "
          f"{args.repeats} runs per case; whole `piper plan` command")  # fmt: skip
    head = (f"{'cluster':>8} {'engine':>10} {'GPUs':>6} {'median_s':>8} {'cpu_s':>6} "
            f"{'target':>6}  {'runs (s)':<20} {'load':>9} {'cands':>6} {'costed':>6} {'scored':>6} "
            f"{'pruned':>6}")  # fmt: skip
    print(f"{head}  stage IP (status, gap)  plan")
    print(f"this checkout: {_describe_tree(ROOT)}")
    if args.tree:
        print(f"--tree {args.tree}: {_describe_tree(args.tree)}")
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            cluster, gpus, *engine = case.split(":")
            _case(args, cluster, int(gpus), engine, Path(tmp) / case.replace(":", "-"))


def _case(args: argparse.Namespace, cluster: str, gpus: int, engine: list[str], out: Path) -> None:
    extra = ["--solver", args.solver, *(["--target", engine[0]] if engine else [])]
    other = out.with_name(out.name + "-tree")
    load_before = os.getloadavg()[0]
    walls, cpus, code, err, tree_walls, tree_cpus = [], [], 0, "", [], []
    for _ in range(args.repeats):
        wall, cpu, code, err = _run(_command(args.model, cluster, gpus, out, extra))
        walls.append(wall)
        cpus.append(cpu)
        if args.tree:
            cmd = _command(args.model, cluster, gpus, other, extra)
            tree_wall, tree_cpu, _, _ = _run(cmd, args.tree.resolve())
            tree_walls.append(tree_wall)
            tree_cpus.append(tree_cpu)
    load = f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"
    median, cpu = statistics.median(walls), statistics.median(cpus)
    target = TARGET_S.get(gpus)
    mark = f"{target:>5.0f}s" if target else f"{'-':>6}"
    runs = " ".join(f"{w:.2f}" for w in walls)
    name = engine[0] if engine else "default"
    row = f"{cluster:>8} {name:>10} {gpus:>6} {median:>8.2f} {cpu:>6.2f} {mark}  {runs:<20}"
    row += f" {load:>9}"
    if code != 0:
        print(f"{row} {'':>27}  -                       exit {code}: {err}")
        return
    t, ip, layout = _summary(out)
    counts = (t["layouts"], t["costed"], t["candidates_scored"], t["candidates_pruned"])
    print(f"{row} " + " ".join(f"{int(c):>6}" for c in counts) + f"  {ip:<22} {layout}")
    if args.tree:
        before, before_cpu = statistics.median(tree_walls), statistics.median(tree_cpus)
        same = other.is_dir() and _same_outputs(out, other)
        print(f"{'':>15} --tree {args.tree}: median {before:.2f} s, CPU {before_cpu:.2f} s "
              f"(runs {' '.join(f'{w:.2f}' for w in tree_walls)}); this checkout "
              f"{median / before:.2f}x its wall, {cpu / before_cpu:.2f}x its CPU time; same "
              f"outputs: {same}")  # fmt: skip
    if args.compare_ip and gpus <= args.compare_up_to:
        wall_ip, _, _, _ = _run(_command(args.model, cluster, gpus, out.with_name(out.name + "-ip"),
                                      [*extra, "--score", "ip"]))  # fmt: skip
        same = (out / "plan.json").read_bytes() == (
            out.with_name(out.name + "-ip") / "plan.json"
        ).read_bytes()
        print(f"{'':>15} --score ip: {wall_ip:.2f} s ({wall_ip / median:.1f}x the DP-scored "
              f"search), same plan.json: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
