"""Optimality of the stage and expert IPs: brute force vs CP-SAT vs CBC, side by side.

Runs N random small instances of each IP, counts how often each backend's optimum equals
brute-force enumeration, compares CP-SAT and CBC objectives and wall times, and times the
stage IP on a DeepSeek-V3-shaped instance (61 layers, recompute on) for several pp and vp.
Stage instances with room for it are mostly interleaved (vp = 2 or 3: live chunk counts of
interleaved 1F1B, every stage at least vp layers).

    python benchmarks/ip_optimality.py [--instances 120] [--seed 0] [--results FILE]

Writes what it prints to results/ip_optimality.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import time

from results_md import recorded

from planner.ip.expert_ip import solve_experts
from planner.ip.solvers import SolverOptions
from planner.ip.stage_ip import solve_stages, stage_memory_bytes, stage_solution_dp, stage_time_s
from planner.resources.stage_inputs import StageCostInputs, StageExtras, UnitCost

GIB = 2**30
OPTS = {b: SolverOptions(backend=b, time_limit_s=30, threads=1, seed=0) for b in ("cpsat", "cbc")}


def random_stage(rng: random.Random) -> StageCostInputs:
    n = rng.randint(2, 7)
    pp = rng.randint(1, min(n, 4))
    kinds = [
        (rng.uniform(1, 5), rng.uniform(0, 2), rng.uniform(0.5, 3), rng.uniform(0.2, 2))
        for _ in range(rng.choice([1, 2, 3, n]))
    ]
    units = []
    for i in range(n):
        t, dt, state, act = kinds[rng.randrange(len(kinds))]
        units.append(UnitCost(i, "moe", t, t + dt, state * GIB, act * GIB, act * GIB * 0.2))
    first = StageExtras(rng.uniform(0, 2), rng.uniform(0, 2) * GIB, rng.uniform(0, 1) * GIB)
    last = StageExtras(rng.uniform(0, 3), rng.uniform(0, 2) * GIB, rng.uniform(0, 1) * GIB)
    vp = rng.choice([2, 3]) if pp > 1 and n >= 2 * pp and rng.random() < 0.8 else 1
    vp = vp if n >= vp * pp else 2
    m = rng.choice([1, 4, 16]) * (pp if vp > 1 else 1)
    total = sum(u.state_bytes + pp * u.act_bytes for u in units)
    cap = total / pp * rng.uniform(0.6, 2.0)
    return StageCostInputs(tuple(units), first, last, cap, pp, m, rng.random() < 0.7, vp)


def brute_stage(inputs: StageCostInputs) -> float:
    n, best = len(inputs.units), math.inf
    recs = (
        [frozenset(i for i in range(n) if mask >> i & 1) for mask in range(2**n)]
        if inputs.recompute_allowed
        else [frozenset()]
    )
    for cuts in itertools.combinations(range(1, n), inputs.pp - 1):
        stages = [tuple(range(a, b)) for a, b in itertools.pairwise((0, *cuts, n))]
        if any(len(stage) < inputs.vp for stage in stages):
            continue
        for rec in recs:
            if all(
                stage_memory_bytes(inputs, s, lay, rec) <= inputs.usable_memory_bytes
                for s, lay in enumerate(stages)
            ):
                best = min(
                    best, max(stage_time_s(inputs, s, lay, rec) for s, lay in enumerate(stages))
                )
    return best


def random_experts(rng: random.Random) -> tuple[list[float], int]:
    """Mildly skewed loads, so the LPT warm start rarely meets the lower bound by itself."""
    ep = rng.choice([2, 3, 4])
    num_e = ep * rng.randint(2, 8 // ep) if ep < 4 else 8
    return [rng.uniform(50, 150) for _ in range(num_e)], ep


def brute_experts(load: list[float], ep: int) -> float:
    size = len(load) // ep

    def parts(items):
        if not items:
            yield []
            return
        for others in itertools.combinations(items[1:], size - 1):
            left = [e for e in items[1:] if e not in others]
            for tail in parts(left):
                yield [(items[0], *others), *tail]

    return min(max(sum(load[e] for e in g) for g in p) for p in parts(list(range(len(load)))))


def close(a: float, b: float) -> bool:
    return (math.isinf(a) and math.isinf(b)) or abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-12)


def run_family(name, instances, solve_fn, brute_fn) -> None:
    equal = {b: 0 for b in OPTS}
    walls = {b: [] for b in OPTS}
    agree = infeasible = 0
    for inst in instances:
        want = brute_fn(inst)
        infeasible += math.isinf(want)
        got = {}
        for b, opts in OPTS.items():
            start = time.perf_counter()
            got[b] = solve_fn(inst, opts)
            walls[b].append(time.perf_counter() - start)
            equal[b] += close(got[b], want)
        agree += close(got["cpsat"], got["cbc"])
    n = len(instances)
    print(f"\n{name}: {n} random instances ({infeasible} infeasible, by brute force)")
    print(f"  {'backend':8} {'= brute force':>14} {'median ms':>10} {'total s':>8}")
    for b in OPTS:
        print(
            f"  {b:8} {equal[b]:>8}/{n:<5} {statistics.median(walls[b]) * 1e3:>10.1f}"
            f" {sum(walls[b]):>8.2f}"
        )
    ratio = sum(walls["cbc"]) / sum(walls["cpsat"])
    print(f"  CP-SAT and CBC objectives agree on {agree}/{n}; CBC/CP-SAT time ratio {ratio:.2f}")


def stage_objective(inputs, opts) -> float:
    sol = solve_stages(inputs, opts)
    return sol.bottleneck_s if sol.feasible else math.inf


SHORTCUTS = {"n": 0}  # instances proven by the warm start meeting the bound (no solve)


def expert_objective(inst, opts) -> float:
    sol = solve_experts(inst[0], inst[1], opts)
    SHORTCUTS["n"] += "lower bound" in sol.report.message
    return sol.max_rank_load


def dsv3_like(pp: int, vp: int = 1) -> StageCostInputs:
    """61 layers (3 dense + 58 MoE) with DeepSeek-V3-like relative costs, recompute on."""
    units = tuple(
        UnitCost(i, "dense", 0.010, 0.013, 0.8 * GIB, 1.0 * GIB, 0.1 * GIB)
        if i < 3
        else UnitCost(i, "moe", 0.030, 0.040, 2.6 * GIB * 4 / pp, 1.5 * GIB, 0.15 * GIB)
        for i in range(61)
    )
    first, last = StageExtras(0.005, 1.8 * GIB, 0.3 * GIB), StageExtras(0.02, 1.8 * GIB, 0.8 * GIB)
    return StageCostInputs(units, first, last, 50 * GIB, pp, 32, True, vp)


def time_dsv3() -> None:
    print("\nDeepSeek-V3-shaped stage IP (61 layers, 32 micro-batches, recompute on, 50 GiB)")
    print(
        f"  {'pp':>3} {'vp':>3} {'DP ms':>7} {'CP-SAT s':>9} {'status':>9} {'CBC s':>7} "
        f"{'status':>9} {'bottleneck s':>12}"
    )
    for pp, vp in ((4, 1), (8, 1), (16, 1), (8, 2), (16, 2), (16, 3)):
        inputs = dsv3_like(pp, vp)
        start = time.perf_counter()
        dp = stage_solution_dp(inputs)
        dp_ms = (time.perf_counter() - start) * 1e3
        row = []
        for b in ("cpsat", "cbc"):
            start = time.perf_counter()
            sol = solve_stages(inputs, OPTS[b])
            row.append((time.perf_counter() - start, sol.report.status, sol.bottleneck_s))
        assert close(row[0][2], dp.bottleneck_s) or not dp.feasible
        print(
            f"  {pp:>3} {vp:>3} {dp_ms:>7.1f} {row[0][0]:>9.2f} {row[0][1]:>9} "
            f"{row[1][0]:>7.2f} {row[1][1]:>9} {row[0][2]:>12.4f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=120, help="per IP (default 120)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default="results/ip_optimality.md", help="markdown to write")
    ap.add_argument("--no-results", action="store_true", help="print only")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    stage_cases = [random_stage(rng) for _ in range(args.instances)]
    expert_cases = [random_experts(rng) for _ in range(args.instances)]
    title = "Stage and expert IPs: brute force vs CP-SAT vs CBC"
    with recorded(args.results, title, enabled=not args.no_results):
        interleaved = sum(c.vp > 1 for c in stage_cases)
        name = f"stage IP ({interleaved} interleaved, vp > 1)"
        run_family(name, stage_cases, stage_objective, brute_stage)
        run_family("expert IP", expert_cases, expert_objective, lambda i: brute_experts(*i))
        print(
            f"  solved by the IP: {2 * len(expert_cases) - SHORTCUTS['n']} of "
            f"{2 * len(expert_cases)} backend runs (the rest: LPT met the lower bound)"
        )
        time_dsv3()


if __name__ == "__main__":
    main()
