"""Families in the branch and bound: one costing bounds a family, the rest is costed lazily.

A family (planner.search.enumerate.Family) is bounded by its first, fastest member: the
others recompute more, shard more or overlap less, so each is at least as slow per
micro-batch and their step-time lower bound is at least the first member's. Where the
recompute policy is chosen per layer, a member's layer times without recompute are its
knobs group's, so any member of the fastest knobs group bounds the family (the leanest is
costed anyway); where the engine applies one policy to every layer
(TrainingSpec.uniform_recompute), a member's layer times include its policy's recompute, so
only the member without recompute bounds its group, and a group without one is screened
member by member. Before that,
its leanest members (full recompute, or the heaviest module set, with each sharding and no
overlap) are screened: when none of them fits any split, no member can (the others keep
more activations or state), and the family is infeasible as a whole without costing the
rest. A family whose bound cannot beat the best step found is pruned whole, its other
members never costed; one that can is *expanded*: every member is costed and screened.

Shape letters: none.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from planner.search import bounds
from planner.search.costing import Costing, Screened, dominated_row, probe_dispatchers
from planner.search.enumerate import Family
from planner.search.rows import CandidateRow, describe
from planner.search.space import Candidate, Knobs
from planner.specs import SpecError


@dataclass(frozen=True)
class Bounded:
    """Members of a family (all of them, or one knobs group: the same knobs, any recompute
    policy) with a step-time lower bound (s) computed from the costs of `source`: the quick
    one until `refined`, then bounds.step_time_lower_bound_s."""

    family: Family
    bound_s: float
    source: Candidate
    indices: tuple[int, ...] = ()  # () = every member
    refined: bool = False

    @property
    def members(self) -> tuple[int, ...]:
        return self.indices or tuple(range(len(self.family.members)))

    def refine(self, costing: Costing) -> Bounded:
        bound = bounds.step_time_lower_bound_s(costing.cost_inputs(self.source))
        return replace(self, bound_s=max(bound, self.bound_s if self.indices else 0.0),
                       refined=True)  # fmt: skip


def _base(f: Family) -> tuple:
    p = f.members[0].parallel
    return (p.pp, p.tp, p.cp, p.dp, p.ep, p.etp, p.micro_batch, p.vp)


def leanest(fam: Family) -> list[int]:
    """Member indices with the most memory-saving policy (full recompute, else the last
    policy: the heaviest module set), each sharding, overlap off."""
    full = [i for i, c in enumerate(fam.members) if c.parallel.recompute == "full"]
    heaviest = fam.members[-1].parallel
    chosen = full or [i for i, c in enumerate(fam.members) if c.parallel == heaviest]
    return [i for i in chosen if not fam.members[i].knobs.a2a_overlap]


def _probe_members(group: list[Family]) -> list[Candidate] | None:
    """One member per dispatcher family of a layout, all with the same layout and knobs but
    the dispatcher (the leanest first); None when no such member exists in every family."""
    first = group[0]
    order = leanest(first) + list(range(len(first.members)))
    for i in order:
        cand = first.members[i]
        key = (cand.parallel, cand.knobs.sharding, cand.knobs.a2a_overlap)
        picks = [
            next((c for c in fam.members if (c.parallel, *_knob_pair(c)) == key), None)
            for fam in group
        ]
        if all(p is not None for p in picks):
            return picks  # type: ignore[return-value]
    return None


def _knob_pair(c: Candidate) -> tuple:
    return (c.knobs.sharding, c.knobs.a2a_overlap)


def _infeasible_family(
    fam: Family, rows: dict[int, CandidateRow], lean: list[int]
) -> list[CandidateRow] | None:
    """Rows for every member when no leanest member fits; None when one might."""
    known = [rows[i] for i in lean if i in rows and not math.isnan(rows[i].memory_need_gib)]
    if len(known) < len(lean) or not known:
        return None
    best = min(known, key=lambda r: (r.memory_need_gib, r.order))
    reason = (
        f"needs more memory than its leanest variant {describe(best.parallel, best.knobs)}, "
        f"which needs >= {best.memory_need_gib:.1f} GiB > {best.usable_memory_gib:.1f} GiB usable"
    )
    out = []
    for i, c in enumerate(fam.members):
        out.append(
            rows.get(i)
            or CandidateRow(
                fam.first_order + i,
                c.parallel,
                math.nan,
                False,
                "infeasible",
                reason,
                memory_need_gib=best.memory_need_gib,
                usable_memory_gib=best.usable_memory_gib,
                knobs=c.knobs,
            )
        )
    return out


def bound_families(
    costing: Costing, families: Iterable[Family]
) -> tuple[list[Bounded], list[Screened], list[CandidateRow]]:
    """Screen each family's leanest members and bound it by its fastest -> (bounded
    families, candidates screened one by one, rows decided already: dominated dispatchers,
    families that cannot fit, members the resource model rejects).

    Dispatchers are compared once per MoE shape, on the first layout of that shape; a family
    whose fastest member the resource model rejects is screened member by member."""
    verdicts: dict[tuple, tuple[dict[str, str], Candidate]] = {}
    bounded, single, rows = [], [], []
    for _, grouped in itertools.groupby(families, key=_base):
        group = list(grouped)
        shape = group[0].shape
        if shape not in verdicts and len(group) > 1:
            probes = _probe_members(group)
            if probes is not None:
                verdicts[shape] = (probe_dispatchers(costing, probes), probes[0])
        beaten, probe = verdicts.get(shape, ({}, group[0].members[0]))
        for fam in group:
            if fam.dispatcher in beaten:
                by = beaten[fam.dispatcher]
                rows += [
                    dominated_row(fam.first_order + i, c, by, probe)
                    for i, c in enumerate(fam.members)
                ]
                continue
            got = _bound_one(costing, fam)
            if isinstance(got, Bounded):
                bounded.append(got)
            else:
                for item in got:
                    (single if isinstance(item, Screened) else rows).append(item)
    return bounded, single, rows


def _uniform_source(fam: Family, idx: list[int]) -> Candidate | None:
    """Under a uniform recompute policy, the member of `idx` (one knobs group) whose bound
    holds for the group: the one without recompute (recomputing only adds time); None when
    the group has none."""
    return next((fam.members[i] for i in idx if fam.members[i].parallel.recompute == "none"), None)


def _bound_one(costing: Costing, fam: Family) -> Bounded | list[CandidateRow | Screened]:
    """Bound a family, or find it cannot fit. When a leanest member has the fastest member's
    knobs (only the recompute policy differs, which leaves a layer's time without recompute
    as it is), it is screened first and bounds the family; otherwise the fastest member is
    screened first, and the leanest only when it does not fit."""
    rep, lean = fam.members[0], leanest(fam)
    if costing.training.uniform_recompute:
        source = _uniform_source(
            fam, [i for i, c in enumerate(fam.members) if c.knobs == rep.knobs]
        )
        if source is None:
            return [costing.screen(fam.first_order + i, c) for i, c in enumerate(fam.members)]
        same = []
    else:
        same = [i for i in lean if fam.members[i].knobs == rep.knobs]
        source = fam.members[same[0]] if same else rep
    if not same and isinstance(costing.screen(fam.first_order, rep), Screened):
        lean = []
    lean_rows = {}
    for i in lean:
        got = costing.screen(fam.first_order + i, fam.members[i])
        if isinstance(got, CandidateRow):
            lean_rows[i] = got
    whole = _infeasible_family(fam, lean_rows, lean)
    if whole is not None:
        return list(whole)
    try:
        inputs = costing.cost_inputs(source)
    except SpecError:
        return [costing.screen(fam.first_order + i, c) for i, c in enumerate(fam.members)]
    return Bounded(fam, bounds.quick_step_time_bound_s(inputs), source)


def expand(costing: Costing, b: Bounded) -> tuple[list[Screened | Bounded], list[CandidateRow]]:
    """Expand a family or knobs group -> (items to queue, infeasible rows).

    A whole family splits into its knobs groups: the fastest member's group is screened
    member by member; every other group is queued with its own bound (from a member costed
    already, else its first member), at least the family's. A group is screened member by
    member; a member's quick bound is raised to the group's, which holds for it too (the
    policies of a group share their layers' times without recompute)."""
    fam, out, rows = b.family, [], []
    if not b.indices:
        groups: dict[Knobs, list[int]] = {}
        for i, c in enumerate(fam.members):
            groups.setdefault(c.knobs, []).append(i)
        first = fam.members[0].knobs
        uniform = costing.training.uniform_recompute
        for knobs, idx in groups.items():
            if knobs == first:
                continue
            if uniform:
                source = _uniform_source(fam, idx)
                if source is None:  # no member bounds the others: screen each
                    _screen_members(costing, b, idx, out, rows)
                    continue
            else:
                source = next(
                    (fam.members[i] for i in idx if fam.members[i] in costing.inputs),
                    fam.members[idx[0]],
                )
            try:
                quick = bounds.quick_step_time_bound_s(costing.cost_inputs(source))
            except SpecError:
                quick = b.bound_s
            out.append(Bounded(fam, max(quick, b.bound_s), source, tuple(idx)))
        members = groups[first]
    else:
        members = list(b.indices)
    _screen_members(costing, b, members, out, rows)
    return out, rows


def _screen_members(
    costing: Costing, b: Bounded, idx: Iterable[int], out: list, rows: list[CandidateRow]
) -> None:
    """Screen members `idx` of b's family one by one: Screened ones (their quick bound raised
    to b's) to `out`, infeasible ones to `rows`."""
    fam = b.family
    for i in idx:
        got = costing.screen(fam.first_order + i, fam.members[i])
        if isinstance(got, Screened):
            out.append(replace(got, bound_s=max(got.bound_s, b.bound_s), family_bound_s=b.bound_s))
        else:
            rows.append(got)


def unexpanded_rows(b: Bounded, status: str, reason: str) -> list[CandidateRow]:
    """Rows of a family or group left unexpanded (pruned or interrupted), all with its bound
    and their memory not checked."""
    fam, out = b.family, []
    for i in b.members:
        c = fam.members[i]
        shared = c == b.source or c.knobs == b.source.knobs
        note = reason if shared else f"{reason} (its family's fastest variant)"
        out.append(
            CandidateRow(fam.first_order + i, c.parallel, b.bound_s, None, status, note,
                         knobs=c.knobs)
        )  # fmt: skip
    return out
