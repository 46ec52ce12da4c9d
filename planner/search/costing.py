"""Cost candidates once, screen them by the cheap bounds, and compare dispatchers.

`Costing` holds one search's cost inputs (planner.resources via the Evaluator), so a
candidate is costed at most once, and turns each into a `Screened` candidate (fits the memory
bound; its step-time lower bound) or an infeasible CandidateRow:
- a memory lower bound rejects a candidate no split can fit, with the reason;
- activation memory per stage, live chunks x act(micro-batch) / vp =
  a x min((W + 1) b, m vp b) / vp with m = batch / b, never shrinks as the micro-batch b
  grows, nor as vp grows (interleaving keeps more chunks in flight on every rank:
  (2 (pp - r - 1) + (vp - 1) pp + 1) / vp >= pp - r), so once a (micro-batch, vp) cannot fit,
  the larger ones of the same candidate are rejected without costing them.

`probe_dispatchers` compares the dispatchers of one layout member by member: a dispatcher
whose every layer is no faster and needs no less memory than another's is dominated for every
layout of the same MoE shape (tokens per rank b s / (tp cp), ep, etp): a layer's dispatch
and combine depend only on the tokens each rank sends and the EP group (ep ranks etp apart),
and the other knobs (recompute, overlap, sharding) change every dispatcher's layer alike.

Shape letters: none.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

from planner.resources.stage_inputs import StageCostInputs
from planner.search import bounds
from planner.search.evaluator import Evaluator, gib
from planner.search.rows import CandidateRow, describe
from planner.search.space import Candidate
from planner.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec

log = logging.getLogger(__name__)

_REL_TOL = 1e-12


@dataclass(frozen=True)
class Screened:
    """A costed candidate that may fit memory, with a step-time lower bound (s): the quick
    one until `refined`, then bounds.step_time_lower_bound_s."""

    order: int
    candidate: Candidate
    inputs: StageCostInputs
    bound_s: float
    refined: bool = False
    family_bound_s: float = 0.0  # its family's bound, which its own must not be below

    def refine(self) -> Screened:
        bound = bounds.step_time_lower_bound_s(self.inputs)
        if bound < self.family_bound_s * (1 - 1e-6):
            log.warning(
                "bound %.6g s of %s below its family's %.6g s; pruning may be unsafe",
                bound,
                self.candidate,
                self.family_bound_s,
            )
        return replace(self, bound_s=bound, refined=True)


def training_for(training: TrainingSpec, cand: Candidate) -> TrainingSpec:
    """The training spec a candidate is costed with (its recompute policy and knobs)."""
    k = cand.knobs
    return replace(
        training,
        recompute=cand.parallel.recompute,
        zero=k.sharding == "zero",
        fsdp=k.sharding == "fsdp",
        a2a_overlap=k.a2a_overlap,
    )


def _too_big_key(cand: Candidate) -> tuple:
    """Everything but the micro-batch and vp, in which memory only grows."""
    p = cand.parallel
    sizes = (p.pp, p.dp, p.tp, p.cp, p.ep, p.etp, p.recompute, p.recompute_modules)
    return (*sizes, cand.knobs)


@dataclass
class Costing:
    """One search's cost inputs by candidate, and the micro-batch sizes known not to fit."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    evaluator: Evaluator
    inputs: dict[Candidate, StageCostInputs | SpecError] = field(default_factory=dict)
    # key -> (micro-batch, vp, need GiB, usable GiB) of candidates that cannot fit
    too_big: dict[tuple, list[tuple[int, int, float, float]]] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        return len(self.inputs)

    def cost_inputs(self, cand: Candidate) -> StageCostInputs:
        """The candidate's StageCostInputs (raises the resource model's SpecError)."""
        if cand not in self.inputs:
            try:
                self.inputs[cand] = self.evaluator.cost_inputs(
                    self.model,
                    self.cluster,
                    training_for(self.training, cand),
                    cand.parallel,
                    cand.knobs.dispatcher,
                )
            except SpecError as exc:  # a rule of the resource model the enumeration lacks
                self.inputs[cand] = exc
        got = self.inputs[cand]
        if isinstance(got, SpecError):
            raise got
        return got

    def screen(self, order: int, cand: Candidate) -> Screened | CandidateRow:
        """Cost one candidate and check its memory bound -> Screened or an infeasible row."""
        par, key = cand.parallel, _too_big_key(cand)
        for mb, vp, need, usable in self.too_big.get(key, ()):
            if par.micro_batch >= mb and par.vp >= vp:
                reason = (
                    f"micro-batch {par.micro_batch} >= {mb} and vp {par.vp} >= {vp}, which "
                    f"already needs >= {need:.1f} GiB > {usable:.1f} GiB usable"
                )
                return _infeasible(order, cand, reason, need, usable)
        try:
            inputs = self.cost_inputs(cand)
        except SpecError as exc:
            return _infeasible(order, cand, str(exc))
        if not bounds.memory_may_fit(inputs):
            need = gib(bounds.min_peak_memory_bytes(inputs))
            usable = gib(inputs.usable_memory_bytes)
            self.too_big.setdefault(key, []).append((par.micro_batch, par.vp, need, usable))
            reason = f"needs >= {need:.1f} GiB on its fullest stage > {usable:.1f} GiB usable"
            return _infeasible(order, cand, reason, need, usable)
        return Screened(order, cand, inputs, bounds.quick_step_time_bound_s(inputs))


def _infeasible(
    order: int, cand: Candidate, reason: str, need: float = math.nan, usable: float = math.nan
) -> CandidateRow:
    return CandidateRow(
        order,
        cand.parallel,
        math.nan,
        False,
        "infeasible",
        reason,
        memory_need_gib=need,
        usable_memory_gib=usable,
        knobs=cand.knobs,
    )


def dominates(a: StageCostInputs, b: StageCostInputs) -> bool:
    """Every unit and stage extra of `a` is no slower and keeps no more bytes than `b`'s, and
    `a` leaves at least as much usable memory: no split or recompute choice is worse."""

    if len(a.units) != len(b.units) or a.recompute_allowed != b.recompute_allowed:
        return False
    if a.usable_memory_bytes < b.usable_memory_bytes * (1 - _REL_TOL):
        return False
    if any(a.in_flight(s) > b.in_flight(s) for s in range(a.pp)):
        return False
    pairs = []
    for u, v in zip(a.units, b.units, strict=True):
        pairs += [
            (u.time_s, v.time_s),
            (u.time_recompute_s, v.time_recompute_s),
            (u.state_bytes, v.state_bytes),
            (u.act_bytes, v.act_bytes),
            (u.act_recompute_bytes, v.act_recompute_bytes),
        ]
    for x, y in ((a.first, b.first), (a.last, b.last)):
        pairs += [(x.time_s, y.time_s), (x.state_bytes, y.state_bytes), (x.act_bytes, y.act_bytes)]
    return all(x <= y * (1 + _REL_TOL) for x, y in pairs)


def probe_dispatchers(costing: Costing, probes: list[Candidate]) -> dict[str, str]:
    """Dispatcher -> the dispatcher that dominates it, for one layout's probe members (the
    same layout and knobs but the dispatcher). Ties go to the earlier probe (the list is in
    the search's dispatcher order). A probe the resource model rejects dominates nothing."""
    costed = []
    for cand in probes:
        try:
            costed.append((cand.knobs.dispatcher, costing.cost_inputs(cand)))
        except SpecError:
            continue
    out: dict[str, str] = {}
    for i, (name, inp) in enumerate(costed):
        for j, (other, other_inp) in enumerate(costed):
            if i == j or other in out:
                continue
            better = dominates(other_inp, inp)
            if better and (j < i or not dominates(inp, other_inp)):
                out[name] = other
                break
    return out


def dominated_row(order: int, cand: Candidate, by: str, probe: Candidate) -> CandidateRow:
    p = cand.parallel
    reason = (
        f"dominated: dispatcher {by} is no slower and needs no more memory for the MoE shape "
        f"tp={p.tp} cp={p.cp} ep={p.ep} etp={p.etp} mb={p.micro_batch} "
        f"(compared on {describe(probe.parallel, probe.knobs)})"
    )
    return CandidateRow(order, p, math.nan, False, "dominated", reason, knobs=cand.knobs)
