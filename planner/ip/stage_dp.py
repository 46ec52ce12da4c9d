"""Exact dynamic program for the stage split: the stage IP's warm start, oracle and tie-break.

The stage IP's data quantized to integers (`StageData`), and a DP over (stage, first layer)
that minimizes the bottleneck stage time (FORMULATION.md, section 1.4). Inside one stage the
recompute choice is a small selection problem; layers with identical costs form a *class*
and only the number recomputed per class matters, so the DP enumerates counts per class.
That is exact while the enumeration stays small (real models have 2-4 layer classes); past
`MAX_COMBOS` it falls back to a greedy choice and says so (`DPResult.exact = False`).

Shape letters: L = layers, S = stages, C = layer classes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import lru_cache

from planner.ip.solvers import quantize, unit_for
from planner.resources.stage_inputs import StageCostInputs, StageExtras

GIB = 2**30
MAX_COMBOS = 4096  # recompute-count combinations enumerated per interval before going greedy
RESOLUTION = 1_000_000  # integer units per max time / usable memory


@dataclass(frozen=True)
class Split:
    """A split: first layer of every stage (starts[0] == 0) and the recomputed layers."""

    starts: tuple[int, ...]
    recomputed: frozenset[int]

    def ranges(self, num_layers: int) -> list[tuple[int, int]]:
        ends = self.starts[1:] + (num_layers,)
        return list(zip(self.starts, ends, strict=True))

    def stage_of(self, layer: int, num_layers: int) -> int:
        return max(s for s, a in enumerate(self.starts) if a <= layer)


@dataclass(frozen=True)
class StageData:
    """StageCostInputs in integer units: time in `time_unit_s`, memory in `mem_unit_bytes`.

    Demands are rounded up and the capacity down, so a quantized-feasible split is feasible.
    """

    num_layers: int
    pp: int
    in_flight: tuple[int, ...]  # S
    time_q: tuple[int, ...]  # L: fwd+bwd without recompute
    dtime_q: tuple[int, ...]  # L: extra time when recomputed (>= 0)
    state_q: tuple[int, ...]  # L
    act_q: tuple[int, ...]  # L: kept activations per in-flight micro-batch
    dact_q: tuple[int, ...]  # L: activations saved per micro-batch by recompute (>= 0)
    first_q: tuple[int, int, int]  # (time, state, act) of stage 0's extras
    last_q: tuple[int, int, int]  # (time, state, act) of the last stage's extras
    cap_q: int
    time_unit_s: float
    mem_unit_bytes: float
    recompute_allowed: bool
    max_time_q: int
    class_of: tuple[int, ...]  # L: layer class id
    min_layers: int = 1  # per stage: a rank's vp interleaved chunks hold a layer each

    def starts(self, s: int) -> range:
        """Where stage s may start: s earlier stages and pp - s stages from it need
        min_layers layers each."""
        n = self.min_layers
        return range(s * n, self.num_layers - (self.pp - s) * n + 1)

    def ends(self, s: int, a: int) -> range:
        """Where stage s starting at layer a may end (exclusive): the later stages need room."""
        n = self.min_layers
        return range(a + n, self.num_layers - (self.pp - 1 - s) * n + 1)

    def extra_time_q(self, s: int) -> int:
        return (self.first_q[0] if s == 0 else 0) + (self.last_q[0] if s == self.pp - 1 else 0)

    def extra_mem_q(self, s: int) -> int:
        k, mem = self.in_flight[s], 0
        for (_, state, act), on in ((self.first_q, s == 0), (self.last_q, s == self.pp - 1)):
            if on:
                mem += state + k * act
        return mem

    def stage_time_q(self, s: int, a: int, b: int, recomputed: frozenset[int]) -> int:
        t = sum(self.time_q[i] + (self.dtime_q[i] if i in recomputed else 0) for i in range(a, b))
        return t + self.extra_time_q(s)

    def stage_mem_q(self, s: int, a: int, b: int, recomputed: frozenset[int]) -> int:
        k = self.in_flight[s]
        m = sum(
            self.state_q[i] + k * (self.act_q[i] - (self.dact_q[i] if i in recomputed else 0))
            for i in range(a, b)
        )
        return m + self.extra_mem_q(s)

    def bottleneck(self, split: Split) -> int:
        return max(
            self.stage_time_q(s, a, b, split.recomputed)
            for s, (a, b) in enumerate(split.ranges(self.num_layers))
        )

    def fits(self, split: Split) -> bool:
        return all(
            self.stage_mem_q(s, a, b, split.recomputed) <= self.cap_q
            for s, (a, b) in enumerate(split.ranges(self.num_layers))
        )


def quantize_inputs(inputs: StageCostInputs) -> StageData:
    """Scale seconds and bytes to integers (about RESOLUTION units per max time / memory)."""
    units = inputs.units
    for u in units:
        if u.time_recompute_s < u.time_s or u.act_recompute_bytes > u.act_bytes:
            raise ValueError(
                f"stage inputs: layer {u.layer} must have time_recompute_s >= time_s and "
                "act_recompute_bytes <= act_bytes"
            )
    total_t = sum(u.time_recompute_s for u in units) + inputs.first.time_s + inputs.last.time_s
    t_unit = unit_for(total_t, RESOLUTION)
    m_unit = unit_for(inputs.usable_memory_bytes, RESOLUTION)
    if inputs.usable_memory_bytes < 1.0:  # under a byte: nothing fits; size the unit on demands
        m_unit = unit_for(max(u.state_bytes for u in units) if units else 1.0, RESOLUTION)

    def tq(x: float) -> int:
        return quantize(x, t_unit, "ceil")

    def mq(x: float) -> int:
        return quantize(x, m_unit, "ceil")

    time_q = tuple(tq(u.time_s) for u in units)
    dtime_q = tuple(max(0, tq(u.time_recompute_s) - t) for u, t in zip(units, time_q, strict=True))
    act_q = tuple(mq(u.act_bytes) for u in units)
    dact_q = tuple(max(0, a - mq(u.act_recompute_bytes)) for u, a in zip(units, act_q, strict=True))
    state_q = tuple(mq(u.state_bytes) for u in units)
    if not inputs.recompute_allowed:
        dact_q = tuple(0 for _ in units)

    def extras(e: StageExtras) -> tuple[int, int, int]:
        return (tq(e.time_s), mq(e.state_bytes), mq(e.act_bytes))

    keys = [(time_q[i], dtime_q[i], state_q[i], act_q[i], dact_q[i]) for i in range(len(units))]
    class_ids: dict[tuple[int, ...], int] = {}
    class_of = tuple(class_ids.setdefault(k, len(class_ids)) for k in keys)
    first, last = extras(inputs.first), extras(inputs.last)
    return StageData(
        num_layers=len(units),
        pp=inputs.pp,
        in_flight=tuple(inputs.in_flight(s) for s in range(inputs.pp)),
        time_q=time_q,
        dtime_q=dtime_q,
        state_q=state_q,
        act_q=act_q,
        dact_q=dact_q,
        first_q=first,
        last_q=last,
        cap_q=quantize(inputs.usable_memory_bytes, m_unit, "floor"),
        time_unit_s=t_unit,
        mem_unit_bytes=m_unit,
        recompute_allowed=inputs.recompute_allowed,
        max_time_q=sum(t + d for t, d in zip(time_q, dtime_q, strict=True)) + first[0] + last[0],
        class_of=class_of,
        min_layers=inputs.vp,
    )


@dataclass(frozen=True)
class DPResult:
    split: Split | None  # None: no split fits
    exact: bool  # False when some interval's recompute choice fell back to greedy
    reason: str  # why no split fits ("" when one does)
    wall_s: float


def solve_dp(data: StageData) -> DPResult:
    """Min-bottleneck split, then fewest recomputed layers, then smallest early stages."""
    start = time.perf_counter()
    if data.pp * data.min_layers > data.num_layers:
        reason = (
            f"pp={data.pp} exceeds the {data.num_layers} layers; every stage needs one"
            if data.min_layers == 1
            else f"pp={data.pp} stages of >= {data.min_layers} layers (one per interleaved "
            f"chunk) need {data.pp * data.min_layers} layers; the model has {data.num_layers}"
        )
        return DPResult(None, True, reason, time.perf_counter() - start)
    table = _IntervalTable(data)
    best_t = _min_bottleneck(data, table)
    if best_t is None:
        return DPResult(None, True, _infeasible_reason(data, table), time.perf_counter() - start)
    split = _canonical_split(data, table, best_t)
    return DPResult(split, table.exact, "", time.perf_counter() - start)


class _IntervalTable:
    """Pareto-optimal (time, recompute count) choices of one stage over layers [a, b)."""

    def __init__(self, data: StageData):
        self.data = data
        self.exact = True
        num_c = max(data.class_of, default=-1) + 1
        self.num_classes = num_c
        self.none = (0,) * num_c  # nothing recomputed
        self.rep = [data.class_of.index(c) for c in range(num_c)]  # a layer of each class
        self.prefix_CL = [[0] * (data.num_layers + 1) for _ in range(num_c)]
        for i, c in enumerate(data.class_of):
            for cc in range(num_c):
                self.prefix_CL[cc][i + 1] = self.prefix_CL[cc][i] + (cc == c)
        self._front = lru_cache(maxsize=None)(self._front_uncached)
        self._min_mem = lru_cache(maxsize=None)(self._min_mem_uncached)
        # integer prefix sums (L + 1) and per-stage extras (S) for plain_time
        self.time_P = _prefix_int(data.time_q)
        self.state_P = _prefix_int(data.state_q)
        self.act_P = _prefix_int(data.act_q)
        self.extra_time_S = [data.extra_time_q(s) for s in range(data.pp)]
        self.extra_mem_S = [data.extra_mem_q(s) for s in range(data.pp)]

    def counts(self, a: int, b: int) -> tuple[int, ...]:
        return tuple(p[b] - p[a] for p in self.prefix_CL)

    def plain_time(self, s: int, a: int, b: int) -> int | None:
        """Time of [a, b) in stage s when it fits memory with nothing recomputed (then its
        front is this time alone: recompute only adds time), else None. The same integers
        as `front`'s: layers of one class share their quantized costs."""
        k, sp = self.data.in_flight[s], self.state_P
        mem = self.extra_mem_S[s] + sp[b] - sp[a] + k * (self.act_P[b] - self.act_P[a])
        if mem > self.data.cap_q:
            return None
        return self.extra_time_S[s] + self.time_P[b] - self.time_P[a]

    def front(self, s: int, a: int, b: int):
        """Pareto front [(time_q, count, r_C)] sorted by time; [] when nothing fits."""
        d = self.data
        role = (s == 0, s == d.pp - 1)
        return self._front(d.in_flight[s], role, self.counts(a, b), s)

    def min_mem(self, s: int, a: int, b: int) -> int:
        """Memory of [a, b) in stage s with every recomputable layer recomputed."""
        d = self.data
        return self._min_mem(d.in_flight[s], (s == 0, s == d.pp - 1), self.counts(a, b), s)

    def _min_mem_uncached(self, k: int, role, n_C: tuple[int, ...], s: int) -> int:
        d = self.data
        mem = d.extra_mem_q(s)
        for c, n in enumerate(n_C):
            i = self.rep[c]
            mem += n * (d.state_q[i] + k * (d.act_q[i] - d.dact_q[i]))
        return mem

    def _front_uncached(self, k: int, role, n_C: tuple[int, ...], s: int):
        d = self.data
        base_t = d.extra_time_q(s) + sum(n * d.time_q[self.rep[c]] for c, n in enumerate(n_C))
        base_m = d.extra_mem_q(s) + sum(
            n * (d.state_q[self.rep[c]] + k * d.act_q[self.rep[c]]) for c, n in enumerate(n_C)
        )
        need = base_m - d.cap_q
        zeros = (0,) * len(n_C)
        if need <= 0:
            return [(base_t, 0, zeros)]
        savers = [c for c, n in enumerate(n_C) if n > 0 and d.dact_q[self.rep[c]] > 0]
        if not savers:
            return []
        free = max(savers, key=lambda c: (n_C[c], -c))
        others = [c for c in savers if c != free]
        if math.prod(n_C[c] + 1 for c in others) > MAX_COMBOS:
            self.exact = False
            return self._greedy(n_C, k, base_t, need, savers)
        options = []
        for combo in _product([range(n_C[c] + 1) for c in others]):
            saved = sum(r * k * d.dact_q[self.rep[c]] for c, r in zip(others, combo, strict=True))
            rem, sav = need - saved, k * d.dact_q[self.rep[free]]
            r_free = max(0, -(-rem // sav))
            if r_free > n_C[free]:
                continue
            r_C = list(zeros)
            for c, r in zip(others, combo, strict=True):
                r_C[c] = r
            r_C[free] = r_free
            t = base_t + sum(r * d.dtime_q[self.rep[c]] for c, r in enumerate(r_C))
            options.append((t, sum(r_C), tuple(r_C)))
        return _pareto(options)

    def _greedy(self, n_C, k, base_t, need, savers):
        d = self.data
        order = sorted(savers, key=lambda c: (d.dtime_q[self.rep[c]] / d.dact_q[self.rep[c]], c))
        r_C = [0] * len(n_C)
        for c in order:
            sav = k * d.dact_q[self.rep[c]]
            r_C[c] = min(n_C[c], max(0, -(-need // sav)))
            need -= r_C[c] * sav
            if need <= 0:
                break
        if need > 0:
            return []
        t = base_t + sum(r * d.dtime_q[self.rep[c]] for c, r in enumerate(r_C))
        return [(t, sum(r_C), tuple(r_C))]


def _prefix_int(values: tuple[int, ...]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _product(ranges):
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head,) + tail


def _pareto(options):
    """Keep choices not dominated in (time, count); sorted by time then count then r_C."""
    front = []
    for t, n, r_C in sorted(options):
        if not front or n < front[-1][1]:
            front.append((t, n, r_C))
    return front


def _min_bottleneck(data: StageData, table: _IntervalTable) -> int | None:
    """best[s][b]: min over splits of layers [0, b) into stages 0..s of the max stage time."""
    num_l, num_s, inf = data.num_layers, data.pp, math.inf
    best = [[inf] * (num_l + 1) for _ in range(num_s)]
    for s in range(num_s):
        for a in data.starts(s):
            before = 0 if s == 0 else best[s - 1][a]
            if s == 0 and a > 0:
                break
            if before == inf:
                continue
            for b in data.ends(s, a):
                if s == num_s - 1 and b != num_l:
                    continue
                t = table.plain_time(s, a, b)
                if t is None:
                    front = table.front(s, a, b)
                    if not front:
                        if table.min_mem(s, a, b) > data.cap_q:
                            break  # longer stages only need more memory
                        continue
                    t = front[0][0]
                best[s][b] = min(best[s][b], max(before, t))
    result = best[num_s - 1][num_l]
    return None if result == inf else int(result)


def _canonical_split(data: StageData, table: _IntervalTable, limit_t: int) -> Split:
    """Among splits with bottleneck <= limit_t: fewest recomputed layers, then shortest
    early stages; the recompute choice per stage takes the first layers of each class.
    Only starts reachable from layer 0 within limit_t are visited: the choice from (0, 0)
    follows them alone."""
    num_l, num_s, inf = data.num_layers, data.pp, math.inf
    options_S = []  # per stage: {reachable start a: [(end b, count, r_C), ...] in b order}
    reach = {0}
    for s in range(num_s):
        options = {a: _stage_options(data, table, s, a, limit_t) for a in sorted(reach)}
        options_S.append(options)
        reach = {b for opts in options.values() for b, _, _ in opts}
    h_next = {num_l: 0}  # fewest recomputed layers from (stage s + 1, start b) to the end
    choice: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
    for s in range(num_s - 1, -1, -1):
        h = {}
        for a, opts in options_S[s].items():
            best = inf
            for b, n, r_C in opts:
                if b in h_next and n + h_next[b] < best:
                    best = n + h_next[b]
                    choice[(s, a)] = (b, r_C)
            if best < inf:
                h[a] = best
        h_next = h
    starts, recomputed, a = [], set(), 0
    for s in range(num_s):
        b, r_C = choice[(s, a)]
        starts.append(a)
        for c, r in enumerate(r_C):
            recomputed.update([i for i in range(a, b) if data.class_of[i] == c][:r])
        a = b
    return Split(tuple(starts), frozenset(recomputed))


def _stage_options(
    data: StageData, table: _IntervalTable, s: int, a: int, limit_t: int
) -> list[tuple[int, int, tuple[int, ...]]]:
    """Ends b of stage s from a, in order, with the fewest recomputed layers (per class)
    within limit_t; stops at the first end that cannot make it (longer stages need more
    memory and at least as much time)."""
    out = []
    for b in data.ends(s, a):
        t = table.plain_time(s, a, b)
        if t is not None:  # its front: (t, nothing recomputed)
            if t > limit_t:
                break
            out.append((b, 0, table.none))
            continue
        front = table.front(s, a, b)
        if not front or front[0][0] > limit_t:
            break
        _, n, r_C = min((f for f in front if f[0] <= limit_t), key=lambda f: (f[1], f[0], f[2]))
        out.append((b, n, r_C))
    return out


def _infeasible_reason(data: StageData, table: _IntervalTable) -> str:
    """Name the tightest stage of the split that minimizes the worst memory overflow."""
    num_l, num_s, inf = data.num_layers, data.pp, math.inf
    best = [[inf] * (num_l + 1) for _ in range(num_s)]
    arg: dict[tuple[int, int], tuple[int, int]] = {}
    for s in range(num_s):
        for a in [0] if s == 0 else data.starts(s):
            before = -inf if s == 0 else best[s - 1][a]
            if before == inf:
                continue
            for b in data.ends(s, a):
                mem = table.min_mem(s, a, b)
                if max(before, mem) < best[s][b]:
                    best[s][b], arg[(s, b)] = max(before, mem), (a, mem)
    b, worst = num_l, (0, -inf)
    for s in range(num_s - 1, -1, -1):
        a, mem = arg[(s, b)]
        worst = max(worst, (mem, -s))
        b = a
    mem_q, stage = worst[0], -worst[1]
    need, cap = mem_q * data.mem_unit_bytes / GIB, data.cap_q * data.mem_unit_bytes / GIB
    how = " with full recompute" if data.recompute_allowed else " (recompute off)"
    return (
        f"stage {stage} needs {need:.1f} GiB > {cap:.1f} GiB usable (over by "
        f"{need - cap:.1f} GiB) in the best split of {num_l} layers over pp={num_s}{how}"
    )
