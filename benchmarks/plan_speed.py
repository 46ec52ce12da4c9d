"""Planning wall time of `piper plan` for DeepSeek-V3 on Frontier at growing GPU counts.

Prints, per GPU count: wall time of the whole make_plan() (search + placement + baselines), the
candidates enumerated / solved / pruned, the chosen layout, the stage IP's status and gap
(the winner is always solved by the stage IP), and the targets (1024 GPUs <= 10 s,
16384 <= 60 s). With --compare-ip it also plans with the stage IP on every candidate
(`--score ip`) up to --compare-up-to GPUs and prints the time ratio and whether the plans
agree byte for byte.

    OMP_NUM_THREADS=1 python benchmarks/plan_speed.py [--gpus 64 256 ...] [--compare-ip]

Writes what it prints to results/plan_speed.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import time

from results_md import recorded

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.ip.solvers import SolverOptions
from planner.search.branch_bound import describe
from planner.search.make_plan import make_plan
from planner.specs import TrainingSpec

TARGET_S = {1024: 10.0, 16384: 60.0}


def _one(model, cluster, gpus: int, score: str, options: SolverOptions):
    t0 = time.perf_counter()
    result = make_plan(model, cluster, TrainingSpec(), gpus, None, options, score=score)
    return result, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--cluster", default="frontier")
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384])
    ap.add_argument("--solver", default="cpsat", choices=("cpsat", "cbc"))
    ap.add_argument("--compare-ip", action="store_true", help="also time --score ip")
    ap.add_argument("--compare-up-to", type=int, default=1024)
    ap.add_argument("--results", default="results/plan_speed.md", help="markdown to write")
    ap.add_argument("--no-results", action="store_true", help="print only")
    args = ap.parse_args()
    with recorded(args.results, "Planning wall time", enabled=not args.no_results):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Plan at every GPU count and print one row each."""
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    options = SolverOptions(args.solver, 10.0, 1, 0)
    print(f"{model.name} on {cluster.name}, seq 4096, global batch 1024, solver {args.solver}")
    head = f"{'GPUs':>6} {'wall_s':>7} {'target':>7} {'layouts':>7} {'scored':>6} {'pruned':>6}"
    print(f"{head}  stage IP (status, gap)  plan")
    for gpus in args.gpus:
        result, wall = _one(model, cluster, gpus, "dp", options)
        counts = {s: sum(r.status == s for r in result.rows) for s in ("solved", "pruned")}
        scored = counts["solved"] + sum(
            r.status == "infeasible" and bool(r.solver_status) for r in result.rows
        )
        target = TARGET_S.get(gpus)
        mark = f"{target:>6.0f}s" if target else f"{'-':>7}"
        if result.plan is None:
            tail = f"no fit: {result.message}"
            ip = "-"
        else:
            s = result.plan.solver
            ip = f"{s.status}, gap {s.gap:.2g}"
            e = result.best.estimate
            tail = f"{describe(result.best.parallel)}  {e.tflops_per_gpu:.1f} TFLOPS/GPU"
        print(
            f"{gpus:>6} {wall:>7.2f} {mark} {len(result.rows):>7} {scored:>6} "
            f"{counts['pruned']:>6}  {ip:<22} {tail}"
        )
        if args.compare_ip and gpus <= args.compare_up_to:
            by_ip, wall_ip = _one(model, cluster, gpus, "ip", options)
            same = (by_ip.plan.to_json() if by_ip.plan else None) == (
                result.plan.to_json() if result.plan else None
            )
            print(
                f"{'':>6} --score ip: {wall_ip:.2f} s ({wall_ip / wall:.1f}x the DP-scored "
                f"search), same plan.json: {same}"
            )


if __name__ == "__main__":
    main()
