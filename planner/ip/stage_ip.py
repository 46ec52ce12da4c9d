"""Stage IP: split transformer layers into contiguous pipeline stages (FORMULATION.md, section 1).

Entry point `solve_stages(inputs, options) -> StageSolution`. Sections: Data (quantize the
StageCostInputs to integer units), exact dynamic program (warm start, oracle, canonical
tie-break), Variables, Constraints C1..C6, Objective, Decode.

Shape letters: L = layers, S = pipeline stages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from planner.ip import stage_dp
from planner.ip.solvers import LinearModel, SolveReport, SolverOptions, solve
from planner.ip.stage_dp import Split, StageData
from planner.resources.stage_inputs import StageCostInputs

log = logging.getLogger(__name__)

GIB = 2**30


@dataclass(frozen=True)
class StageSolution:
    """Layers and recomputed layers per stage, with per-stage time (s) and memory (bytes).

    Empty tuples and `reason` set when no split fits (report.status == "INFEASIBLE").
    """

    stage_layers: tuple[tuple[int, ...], ...]
    recompute_layers: tuple[tuple[int, ...], ...]
    stage_time_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    bottleneck_s: float
    report: SolveReport
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return self.report.has_solution


def solve_stages(inputs: StageCostInputs, options: SolverOptions) -> StageSolution:
    """Optimal contiguous stage split (min bottleneck stage time) that fits in memory; each
    stage holds at least `inputs.vp` layers (one per interleaved chunk).

    Args:
        inputs: per-layer costs, stage extras, usable memory (bytes), pp, micro-batches.
        options: backend, time limit (s), threads, seed.
    Returns:
        StageSolution; among optimal splits the one with the fewest recomputed layers, then
        the lexicographically smallest stage sizes (unique for the same inputs).
    """
    data = stage_dp.quantize_inputs(inputs)
    dp = stage_dp.solve_dp(data)
    if dp.split is None:
        return _infeasible(inputs, data, options, dp.reason)
    model, decode = _build_model(data, dp.split)
    if dp.exact:
        model.canonical = []  # the DP's canonical split breaks ties (see below)
    sol = solve(model, options)
    if not sol.report.has_solution:
        # Only a time limit gets here (the DP found a feasible split): keep it, with its gap.
        result = _solution(inputs, data, dp.split, sol.report)
        bound = min(_trivial_bound_s(data), result.bottleneck_s)
        gap = max(0.0, result.bottleneck_s - bound) / result.bottleneck_s
        report = replace(
            sol.report, status="FEASIBLE", objective=result.bottleneck_s, bound=bound, gap=gap
        )
        return replace(result, report=report)
    split = decode(sol.values)
    if dp.exact and data.bottleneck(dp.split) <= data.bottleneck(split):
        split = dp.split  # equal optimum: the DP's canonical tie-break makes it unique
    log.debug("stage IP %s: %s", options.backend, sol.report)
    result = _solution(inputs, data, split, sol.report)
    return replace(result, report=_report_in_seconds(sol.report, result.bottleneck_s))


def _trivial_bound_s(data: StageData) -> float:
    """A valid lower bound on the bottleneck: total time without recompute over pp stages."""
    total_q = sum(data.time_q) + data.first_q[0] + data.last_q[0]
    return total_q / data.pp * data.time_unit_s


def _report_in_seconds(report: SolveReport, bottleneck_s: float) -> SolveReport:
    """Objective = the returned split's bottleneck (s), without the tie-break term."""
    if report.status == "OPTIMAL":
        return replace(report, objective=bottleneck_s, bound=bottleneck_s, gap=0.0)
    bound = min(report.bound, bottleneck_s)
    return replace(report, objective=bottleneck_s, bound=bound, gap=report.gap)


def stage_solution_dp(inputs: StageCostInputs) -> StageSolution:
    """The exact dynamic program alone (no IP): fast scoring for the outer search.

    report.backend == "dp"; status OPTIMAL when the DP is exact for these inputs (few
    distinct layer kinds), FEASIBLE when it fell back to a greedy recompute choice.
    """
    data = stage_dp.quantize_inputs(inputs)
    dp = stage_dp.solve_dp(data)
    if dp.split is None:
        return _infeasible(inputs, data, SolverOptions(), dp.reason, backend="dp")
    t = data.bottleneck(dp.split) * data.time_unit_s
    status = "OPTIMAL" if dp.exact else "FEASIBLE"
    gap = 0.0 if dp.exact else float("nan")
    report = SolveReport("dp", status, t, t if dp.exact else float("nan"), gap, dp.wall_s)
    return _solution(inputs, data, dp.split, report)


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class _Vars:
    """Solver variables: ge[s][i] = layer i is in stage >= s (s = 1..S-1; row 0 unused),
    rec[(i, s)] = layer i is recomputed in stage s, bottleneck = the slowest stage's time."""

    ge: list[list[int]]
    rec: dict[tuple[int, int], int]
    bottleneck: int
    num_s: int

    def in_stage(self, i: int, s: int) -> tuple[list[tuple[int, int]], int]:
        """x[i,s] = ge[s][i] - ge[s+1][i] as (terms, constant); ge[0] = 1, ge[S] = 0."""
        terms = []
        if s > 0:
            terms.append((1, self.ge[s][i]))
        if s + 1 < self.num_s:
            terms.append((-1, self.ge[s + 1][i]))
        return terms, int(s == 0)


def _build_model(data: StageData, hint: Split):
    """Data -> Variables -> Constraints -> Objective of the stage IP; returns (model, decode)."""
    num_l, num_s = data.num_layers, data.pp
    weight = num_l + 1  # one time unit outweighs any number of recomputed layers
    model = LinearModel("stage_ip", objective_unit=data.time_unit_s / weight)

    # Variables (see _Vars); the hint is feasible, so T is at most its bottleneck.
    ge = [[-1] * num_l] + [
        [model.bool_var(f"layer{i}_in_stage_ge{s}") for i in range(num_l)] for s in range(1, num_s)
    ]
    rec = {
        (i, s): model.bool_var(f"layer{i}_recompute_in_stage{s}")
        for s in range(num_s)
        for i in range(num_l)
        if data.recompute_allowed and data.dact_q[i] > 0
    }
    v = _Vars(ge, rec, model.num_var(0, data.bottleneck(hint), "bottleneck_time"), num_s)

    _order_constraints(model, data, v)
    _resource_constraints(model, data, v)

    # Objective: bottleneck time, then (tie-break) the number of recomputed layers.
    model.minimize([(weight, v.bottleneck)] + [(1, r) for r in rec.values()])
    _hint(model, data, hint, ge, rec, v.bottleneck)

    def decode(values: tuple[int, ...]) -> Split:
        starts = [0] + [next(i for i in range(num_l) if values[ge[s][i]]) for s in range(1, num_s)]
        recomputed = frozenset(i for (i, _s), r in rec.items() if values[r])
        return Split(tuple(starts), recomputed)

    return model, decode


def _order_constraints(model: LinearModel, data: StageData, v: _Vars) -> None:
    """C1-C4: contiguous, ordered stages of at least min_layers layers; recompute only where
    the layer is."""
    num_l, num_s, ge, n = data.num_layers, data.pp, v.ge, data.min_layers
    # C1: stages are contiguous: once a layer is in stage >= s, every later layer is too.
    for s in range(1, num_s):
        for i in range(num_l - 1):
            model.add([(1, ge[s][i]), (-1, ge[s][i + 1])], "<=", 0, f"C1_s{s}_l{i}")
    # C2: stages are ordered and hold >= n layers: if layer i+n is in stage >= s+1, layer i is
    # in stage >= s (n = 1: non-empty).
    for s in range(1, num_s - 1):
        for i in range(num_l - n):
            model.add([(1, ge[s + 1][i + n]), (-1, ge[s][i])], "<=", 0, f"C2_s{s}_l{i}")
    # C3: the first n layers are in stage 0 and the last n in the last stage.
    for s in range(1, num_s):
        for i in range(min(n, num_l)):
            model.add([(1, ge[s][i])], "==", 0, f"C3_first_s{s}_l{i}")
    if num_s > 1:
        model.add([(1, ge[num_s - 1][num_l - n])], "==", 1, "C3_last")
    # C4: a layer is recomputed only in the stage that holds it.
    for (i, s), r in v.rec.items():
        terms, const = v.in_stage(i, s)
        model.add([(1, r)] + [(-c, x) for c, x in terms], "<=", const, f"C4_l{i}_s{s}")


def _resource_constraints(model: LinearModel, data: StageData, v: _Vars) -> None:
    """C5 memory and C6 time of every stage."""
    # C5: stage memory = state + in_flight(s) x kept activations + extras <= usable memory.
    for s in range(data.pp):
        k = data.in_flight[s]
        terms, total = [], data.extra_mem_q(s)
        for i in range(data.num_layers):
            per = data.state_q[i] + k * data.act_q[i]
            x_terms, x_const = v.in_stage(i, s)
            terms += [(per * c, x) for c, x in x_terms]
            total += per * x_const
            if (i, s) in v.rec:
                terms.append((-k * data.dact_q[i], v.rec[(i, s)]))
        model.add(terms, "<=", data.cap_q - total, f"C5_memory_s{s}")
    # C6: every stage's time (forward + backward, recompute included) is at most the bottleneck.
    for s in range(data.pp):
        terms, total = [(-1, v.bottleneck)], data.extra_time_q(s)
        for i in range(data.num_layers):
            x_terms, x_const = v.in_stage(i, s)
            terms += [(data.time_q[i] * c, x) for c, x in x_terms]
            total += data.time_q[i] * x_const
            if (i, s) in v.rec:
                terms.append((data.dtime_q[i], v.rec[(i, s)]))
        model.add(terms, "<=", -total, f"C6_time_s{s}")


def _hint(model, data: StageData, split: Split, ge, rec, bottleneck) -> None:
    for s in range(1, data.pp):
        for i in range(data.num_layers):
            model.hint(ge[s][i], int(i >= split.starts[s]))
    for (i, s), r in rec.items():
        model.hint(r, int(i in split.recomputed and split.stage_of(i, data.num_layers) == s))
    model.hint(bottleneck, data.bottleneck(split))


# ----------------------------------------------------------------------------- results


def _solution(
    inputs: StageCostInputs, data: StageData, split: Split, report: SolveReport
) -> StageSolution:
    layers, rec, times, mems = [], [], [], []
    for s, (a, b) in enumerate(split.ranges(data.num_layers)):
        stage = tuple(range(a, b))
        kept = tuple(sorted(i for i in stage if i in split.recomputed))
        layers.append(stage)
        rec.append(kept)
        times.append(stage_time_s(inputs, s, stage, kept))
        mems.append(stage_memory_bytes(inputs, s, stage, kept))
    return StageSolution(tuple(layers), tuple(rec), tuple(times), tuple(mems), max(times), report)


def stage_time_s(inputs: StageCostInputs, stage: int, layers, recomputed) -> float:
    """Time of one micro-batch (fwd + bwd) through `layers` of `stage`, in seconds."""
    t = sum(
        inputs.units[i].time_recompute_s if i in recomputed else inputs.units[i].time_s
        for i in layers
    )
    if stage == 0:
        t += inputs.first.time_s
    if stage == inputs.pp - 1:
        t += inputs.last.time_s
    return t


def stage_memory_bytes(inputs: StageCostInputs, stage: int, layers, recomputed) -> float:
    """Peak bytes of `stage` under 1F1B: state + in_flight x kept activations + extras."""
    k = inputs.in_flight(stage)
    mem = 0.0
    for i in layers:
        u = inputs.units[i]
        mem += u.state_bytes + k * (u.act_recompute_bytes if i in recomputed else u.act_bytes)
    for extra, on in ((inputs.first, stage == 0), (inputs.last, stage == inputs.pp - 1)):
        if on:
            mem += extra.state_bytes + k * extra.act_bytes
    return mem


def _infeasible(
    inputs: StageCostInputs,
    data: StageData,
    options: SolverOptions,
    reason: str,
    report: SolveReport | None = None,
    backend: str | None = None,
) -> StageSolution:
    nan = float("nan")
    if report is None:
        report = SolveReport(backend or options.backend, "INFEASIBLE", nan, nan, float("inf"), 0.0)
    return StageSolution((), (), (), (), nan, report, reason or report.message)
