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

`can_beat(inputs, step_s)` tightens the step bound where memory forces recompute: a stage's
time is its layers' plus the cheapest *fractional* recompute that brings its memory within
usable memory (layers recomputed in order of extra time per byte saved; a fraction of a
layer allowed), which is at most what any real recompute choice costs. When no split (empty
stages allowed) keeps every stage within step_s / pipeline_slots that way, the candidate
cannot beat step_s.

A greedy that fills each stage with the longest prefix that fits decides the relaxed
problems exactly: stage costs are monotone in the set of layers (adding a layer adds its
time and at least the bytes its recompute could save), so a greedy stage never ends before
the same stage of any feasible split (exchange argument).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from planner.resources.stage_inputs import StageCostInputs

_REL_TOL = 1e-7  # bisection stops when the bracket is this tight (relative)


@dataclass(frozen=True)
class _Costs:
    """Stage s holding units [a, b) costs (pa[b] - pa[a]) + w[s] (pb[b] - pb[a]) + extra[s];
    pa and pb are prefix sums (length n + 1) of non-negative values."""

    pa: tuple[float, ...]
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
            # the largest end in [start, n] with stage cost <= cap (costs grow with the end)
            if self.pb[-1] == 0.0:  # times: the stage cost is a difference of pa
                limit = self.pa[start] + (cap - self.extra[s])
                start = max(start, bisect.bisect_right(self.pa, limit, lo=start) - 1)
                continue
            end = bisect.bisect_right(
                range(start, n + 1), cap, key=lambda b, s=s, a=start: self.stage(s, a, b)
            )
            start += max(end - 1, 0)
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
    extra = _extras(inputs, inputs.first.time_s, inputs.last.time_s)
    return _Costs(_prefix(times), zeros, (0.0,) * inputs.pp, extra)


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


@dataclass(frozen=True)
class _Fractional:
    """Stage times with the cheapest fractional recompute that fits memory (inf: none).
    Layers with identical costs form a class; counts_C are prefix counts per class."""

    classes: tuple[tuple[float, float, float, float, float], ...]  # t, dt, state, act, dact
    by_ratio: tuple[int, ...]  # recomputable classes, least extra time per byte saved first
    counts_C: tuple[tuple[int, ...], ...]
    flight: tuple[int, ...]  # per stage
    extra_time: tuple[float, ...]  # per stage
    extra_mem: tuple[float, ...]  # per stage: extras' state + in-flight activations
    cap: float

    def stage(self, s: int, a: int, b: int) -> float:
        k = self.flight[s]
        n_C = [cnt[b] - cnt[a] for cnt in self.counts_C]
        time = self.extra_time[s] + sum(n * c[0] for n, c in zip(n_C, self.classes, strict=True))
        mem = self.extra_mem[s] + sum(
            n * (c[2] + k * c[3]) for n, c in zip(n_C, self.classes, strict=True)
        )
        need = mem - self.cap
        for c in self.by_ratio:
            if need <= 0:
                break
            _, dt, _, _, dact = self.classes[c]
            save = n_C[c] * k * dact
            if save >= need:
                return time + need / (k * dact) * dt
            time, need = time + n_C[c] * dt, need - save
        return time if need <= 0 else math.inf

    def fits(self, limit_s: float) -> bool:
        """Can every stage stay within limit_s (empty stages allowed)?"""
        pp, n = len(self.flight), len(self.counts_C[0]) - 1 if self.counts_C else 0
        start = 0
        for s in range(pp - 1):
            end = bisect.bisect_right(
                range(start, n + 1), limit_s, key=lambda b, s=s, a=start: self.stage(s, a, b)
            )
            if end == 0:
                return False
            start += end - 1
        return self.stage(pp - 1, start, n) <= limit_s


def _fractional(inputs: StageCostInputs) -> _Fractional:
    keys = [
        (
            u.time_s,
            max(0.0, u.time_recompute_s - u.time_s) if inputs.recompute_allowed else 0.0,
            u.state_bytes,
            u.act_bytes,
            max(0.0, u.act_bytes - u.act_recompute_bytes) if inputs.recompute_allowed else 0.0,
        )
        for u in inputs.units
    ]
    classes = tuple(dict.fromkeys(keys))
    of = [classes.index(k) for k in keys]
    counts = tuple(_prefix(float(c == j) for c in of) for j in range(len(classes)))
    savers = [j for j, c in enumerate(classes) if c[4] > 0]
    flight = tuple(inputs.in_flight(s) for s in range(inputs.pp))
    f, la = inputs.first, inputs.last
    return _Fractional(
        classes,
        tuple(sorted(savers, key=lambda j: (classes[j][1] / classes[j][4], j))),
        tuple(tuple(int(x) for x in cnt) for cnt in counts),
        flight,
        _extras(inputs, f.time_s, la.time_s),
        tuple(
            (f.state_bytes + k * f.act_bytes if s == 0 else 0.0)
            + (la.state_bytes + k * la.act_bytes if s == inputs.pp - 1 else 0.0)
            for s, k in enumerate(flight)
        ),
        inputs.usable_memory_bytes,
    )


def can_beat(inputs: StageCostInputs, step_s: float) -> bool:
    """False only when no split, even with the cheapest fractional recompute that fits
    memory, keeps the slowest stage below step_s / pipeline_slots: then the candidate's step
    is at least step_s."""
    return _fractional(inputs).fits(step_s / inputs.pipeline_slots)


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
