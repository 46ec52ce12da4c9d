"""Cheap bounds on a candidate layout, computed from its StageCostInputs before any IP solve.

Both bounds relax the stage IP (planner/FORMULATION.md) by allowing empty stages, which can
only make it easier, so they are valid:
- `min_peak_memory_bytes`: the smallest per-device capacity for which some contiguous split
  fits (every layer at its smallest activation, i.e. recomputed when recompute is allowed).
  If it exceeds usable memory, the candidate is infeasible without solving anything.
- `bottleneck_time_lower_bound_s`: the smallest possible slowest-stage time per micro-batch
  (every layer at its fastest, memory ignored). The step is at least
  `pipeline_slots` = m + (pp - 1) / vp times it (1F1B: m + pp - 1; interleaved with vp
  chunks per rank: the bubble shrinks by vp; StageCostInputs.pipeline_slots), so a
  candidate whose bound is not below the best step time found so far cannot win and is not
  solved. With the all-to-all overlap the units' times are the steady phase's paired times,
  the shortest a micro-batch takes, so the bound still holds.

A greedy that fills each stage with the longest prefix that fits decides the relaxed
problems exactly: stage costs are monotone in the set of layers, so a greedy stage never ends
before the same stage of any feasible split (exchange argument).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.resources.stage_inputs import StageCostInputs

_REL_TOL = 1e-7  # bisection stops when the bracket is this tight (relative)


@dataclass(frozen=True)
class _Costs:
    """Stage s holding units [a, b) costs (pa[b] - pa[a]) + w[s] (pb[b] - pb[a]) + extra[s]."""

    pa: tuple[float, ...]  # prefix sums, length n + 1
    pb: tuple[float, ...]
    w: tuple[float, ...]  # per stage
    extra: tuple[float, ...]  # per stage

    def stage(self, s: int, a: int, b: int) -> float:
        return self.pa[b] - self.pa[a] + self.w[s] * (self.pb[b] - self.pb[a]) + self.extra[s]

    def fits(self, cap: float) -> bool:
        """Longest-prefix greedy: can every stage stay within `cap` (empty stages allowed)?"""
        n, pp = len(self.pa) - 1, len(self.w)
        start = 0
        for s in range(pp - 1):
            if self.extra[s] > cap:
                return False
            lo, hi = start, n  # largest end in [start, n] with stage cost <= cap
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.stage(s, start, mid) <= cap:
                    lo = mid
                else:
                    hi = mid - 1
            start = lo
        return self.stage(pp - 1, start, n) <= cap

    def minimum(self) -> tuple[float, float]:
        """(largest infeasible, smallest feasible) capacity, by bisection."""
        n, pp = len(self.pa) - 1, len(self.w)
        hi = max(self.stage(s, 0, n) for s in range(pp)) + max(self.extra)
        lo = max(self.extra) if pp == 1 else 0.0
        if self.fits(lo):
            return lo, lo
        while hi - lo > _REL_TOL * hi:
            mid = 0.5 * (lo + hi)
            if self.fits(mid):
                hi = mid
            else:
                lo = mid
        return lo, hi


def _prefix(values) -> tuple[float, ...]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)


def _extras(inputs: StageCostInputs, first: float, last: float) -> tuple[float, ...]:
    pp = inputs.pp
    return tuple((first if s == 0 else 0.0) + (last if s == pp - 1 else 0.0) for s in range(pp))


def _memory(inputs: StageCostInputs) -> _Costs:
    rc = inputs.recompute_allowed
    acts = [min(u.act_bytes, u.act_recompute_bytes) if rc else u.act_bytes for u in inputs.units]
    flight = tuple(float(inputs.in_flight(s)) for s in range(inputs.pp))
    f, la = inputs.first, inputs.last
    extra = tuple(
        (f.state_bytes + k * f.act_bytes if s == 0 else 0.0)
        + (la.state_bytes + k * la.act_bytes if s == inputs.pp - 1 else 0.0)
        for s, k in enumerate(flight)
    )
    return _Costs(_prefix(u.state_bytes for u in inputs.units), _prefix(acts), flight, extra)


def _time(inputs: StageCostInputs) -> _Costs:
    rc = inputs.recompute_allowed
    times = [min(u.time_s, u.time_recompute_s) if rc else u.time_s for u in inputs.units]
    zeros = (0.0,) * (len(times) + 1)
    return _Costs(
        _prefix(times),
        zeros,
        (0.0,) * inputs.pp,
        _extras(inputs, inputs.first.time_s, inputs.last.time_s),
    )


def min_peak_memory_bytes(inputs: StageCostInputs) -> float:
    """Lower bound (bytes) on the fullest stage's memory over all contiguous splits."""
    return _memory(inputs).minimum()[0]


def memory_may_fit(inputs: StageCostInputs) -> bool:
    """False only when no contiguous split can fit usable memory (then no IP is needed)."""
    return _memory(inputs).fits(inputs.usable_memory_bytes)


def bottleneck_time_lower_bound_s(inputs: StageCostInputs) -> float:
    """Lower bound (s) on the slowest stage's time per micro-batch, memory ignored."""
    return max(_time(inputs).minimum()[0], _quick_bottleneck_s(inputs))


def _quick_bottleneck_s(inputs: StageCostInputs) -> float:
    """The largest of the average stage (all work over pp stages), the slowest layer and the
    first and last stages' extras: each a stage's time at least."""
    rc = inputs.recompute_allowed
    times = [min(u.time_s, u.time_recompute_s) if rc else u.time_s for u in inputs.units]
    ends = (inputs.first.time_s, inputs.last.time_s)
    return max((sum(times) + sum(ends)) / inputs.pp, max(times, default=0.0), *ends)


def step_time_lower_bound_s(inputs: StageCostInputs) -> float:
    """Lower bound (s) on the step: pipeline_slots (m + (pp - 1) / vp) x bottleneck bound."""
    return inputs.pipeline_slots * bottleneck_time_lower_bound_s(inputs)


def quick_step_time_bound_s(inputs: StageCostInputs) -> float:
    """A weaker lower bound (s) on the step in O(layers), no bisection: pipeline_slots x the
    largest of the average stage (all work over pp stages), the slowest layer and the first
    and last stages' extras. Never above step_time_lower_bound_s."""
    return inputs.pipeline_slots * _quick_bottleneck_s(inputs)


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
