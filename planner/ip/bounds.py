"""Cheap bounds on a candidate layout, computed from its StageCostInputs before any IP solve.

Both bounds relax the stage IP (planner/FORMULATION.md) by allowing empty stages, which can
only make it easier, so they are valid:
- `min_peak_memory_bytes`: the smallest per-device capacity for which some contiguous split
  fits (every layer at its smallest activation, i.e. recomputed when recompute is allowed).
  If it exceeds usable memory, the candidate is infeasible without solving anything.
- `bottleneck_time_lower_bound_s`: the smallest possible slowest-stage time per micro-batch
  (every layer at its fastest, memory ignored). The 1F1B step is at least
  (num_microbatches + pp - 1) times it, so a candidate whose bound is not below the best
  step time found so far cannot win and is not solved.

A greedy that fills each stage with the longest prefix that fits decides the relaxed
problems exactly: stage costs are monotone in the set of layers, so a greedy stage never ends
before the same stage of any feasible split (exchange argument).
"""

from __future__ import annotations

from collections.abc import Callable

from planner.resources.units import StageCostInputs, UnitCost

_BISECT_STEPS = 60


def _unit_act(u: UnitCost, recompute: bool) -> float:
    return min(u.act_bytes, u.act_recompute_bytes) if recompute else u.act_bytes


def _unit_time(u: UnitCost, recompute: bool) -> float:
    return min(u.time_s, u.time_recompute_s) if recompute else u.time_s


def _greedy_fits(inputs: StageCostInputs, cap: float, cost: Callable[[int, int], float]) -> bool:
    """Longest-prefix greedy over stages; cost(stage, unit) is the unit's cost on that stage."""
    n = len(inputs.units)
    start = 0
    for stage in range(inputs.pp):
        used = _extras_cost(inputs, stage, cost)
        if stage == inputs.pp - 1:
            used += sum(cost(stage, i) for i in range(start, n))
            return used <= cap
        if used > cap:
            return False
        while start < n and used + cost(stage, start) <= cap:
            used += cost(stage, start)
            start += 1
    return start == n


def _extras_cost(inputs: StageCostInputs, stage: int, cost: Callable[[int, int], float]) -> float:
    total = 0.0
    if stage == 0:
        total += cost(stage, -1)
    if stage == inputs.pp - 1:
        total += cost(stage, -2)
    return total


def _bisect_min(
    inputs: StageCostInputs, hi: float, cost: Callable[[int, int], float]
) -> tuple[float, float]:
    """(largest infeasible, smallest feasible) capacity found by bisection on [0, hi]."""
    lo = 0.0
    if _greedy_fits(inputs, lo, cost):
        return lo, lo
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        if _greedy_fits(inputs, mid, cost):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    return lo, hi


def _memory_cost(inputs: StageCostInputs) -> Callable[[int, int], float]:
    rc = inputs.recompute_allowed

    def cost(stage: int, unit: int) -> float:
        flight = inputs.in_flight(stage)
        if unit == -1:
            return inputs.first.state_bytes + flight * inputs.first.act_bytes
        if unit == -2:
            return inputs.last.state_bytes + flight * inputs.last.act_bytes
        u = inputs.units[unit]
        return u.state_bytes + flight * _unit_act(u, rc)

    return cost


def _time_cost(inputs: StageCostInputs) -> Callable[[int, int], float]:
    rc = inputs.recompute_allowed

    def cost(stage: int, unit: int) -> float:
        if unit == -1:
            return inputs.first.time_s
        if unit == -2:
            return inputs.last.time_s
        return _unit_time(inputs.units[unit], rc)

    return cost


def min_peak_memory_bytes(inputs: StageCostInputs) -> float:
    """Lower bound (bytes) on the fullest stage's memory over all contiguous splits."""
    cost = _memory_cost(inputs)
    hi = sum(cost(0, i) for i in range(len(inputs.units))) + cost(0, -1) + cost(0, -2)
    return _bisect_min(inputs, max(hi, 1.0), cost)[1]


def memory_may_fit(inputs: StageCostInputs) -> bool:
    """False only when no contiguous split can fit usable memory (then no IP is needed)."""
    return _greedy_fits(inputs, inputs.usable_memory_bytes, _memory_cost(inputs))


def bottleneck_time_lower_bound_s(inputs: StageCostInputs) -> float:
    """Lower bound (s) on the slowest stage's time per micro-batch, memory ignored."""
    cost = _time_cost(inputs)
    hi = sum(cost(0, i) for i in range(len(inputs.units))) + cost(0, -1) + cost(0, -2)
    return _bisect_min(inputs, max(hi, 1e-30), cost)[0]


def step_time_lower_bound_s(inputs: StageCostInputs) -> float:
    """Lower bound (s) on the 1F1B step: (num_microbatches + pp - 1) x bottleneck bound."""
    return (inputs.num_microbatches + inputs.pp - 1) * bottleneck_time_lower_bound_s(inputs)


def even_split(num_layers: int, pp: int) -> tuple[tuple[int, ...], ...]:
    """Layers split as evenly as possible; the first `num_layers % pp` stages get one more."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        out.append(tuple(range(start, start + size)))
        start += size
    return tuple(out)


def split_cost(
    inputs: StageCostInputs, stage_layers: tuple[tuple[int, ...], ...], recompute: bool
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(memory bytes, time s per micro-batch) of each stage for a given split.

    `stage_layers` holds unit indices (positions in inputs.units); `recompute` recomputes
    every layer (the uniform baselines' all-or-nothing policy).
    """
    mem, time = [], []
    for stage, layers in enumerate(stage_layers):
        flight = inputs.in_flight(stage)
        m = sum(
            inputs.units[i].state_bytes
            + flight
            * (inputs.units[i].act_recompute_bytes if recompute else inputs.units[i].act_bytes)
            for i in layers
        )
        t = sum(
            inputs.units[i].time_recompute_s if recompute else inputs.units[i].time_s
            for i in layers
        )
        for extra, on in (
            (inputs.first, stage == 0),
            (inputs.last, stage == len(stage_layers) - 1),
        ):
            if on:
                m += extra.state_bytes + flight * extra.act_bytes
                t += extra.time_s
        mem.append(m)
        time.append(t)
    return tuple(mem), tuple(time)
