"""Expert IP: place the experts of one MoE layer on EP ranks (FORMULATION.md, section 2).

Entry point `solve_experts(load_E, ep, options, ...) -> ExpertSolution`. Sections: Data
(validate, quantize loads), greedy LPT warm start, Variables, Constraints C7..C11, Objective,
Decode (with a canonical relabelling of interchangeable ranks).

Shape letters: E = routed experts, R = EP ranks, N = nodes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.ip.expert_swap import improve_by_swaps, lpt_with_replicas, replicate_then_pack
from planner.ip.solvers import LinearModel, SolveReport, SolverOptions, quantize, solve, unit_for
from planner.specs import SpecError

log = logging.getLogger(__name__)

RESOLUTION = 1_000_000  # integer units per total load
MAX_PAIRS_PER_EXPERT = 4  # strongest co-activated pairs per expert entering the objective
# Replica models with more (expert, rank, copies) variables than this are not built: at
# DeepSeek-V3's 256 experts x 64 ranks x 4 copies (65,536) CP-SAT spends its whole limit
# building and presolving; the greedy placement and the bound are returned instead.
MAX_REPLICA_VARIABLES = 20_000


def slot_counts(experts: int, ep: int, redundant_slots: int = 0) -> tuple[int, ...]:
    """Slots per EP rank: E / ep each plus `redundant_slots` (a total over the EP group)
    spread as evenly as the ranks allow: rank r gets one more when floor((r + 1) k / ep)
    > floor(r k / ep) for the remainder k, so 32 over 64 ranks land on every other rank
    (DeepSeek-V3's 288 slots for 256 experts). The one rule the plan, the expert IP and
    the migration policies share."""
    base, k = divmod(redundant_slots, ep)
    return tuple(experts // ep + base + ((r + 1) * k) // ep - (r * k) // ep for r in range(ep))


@dataclass(frozen=True)
class ExpertSolution:
    """Placement of one MoE layer's experts.

    rank_of_expert: E ranks (the lowest rank holding a replica when replicated).
    slots: per rank the experts it holds, ascending (plan.json's `slots`).
    replicas: (expert, rank, share) rows sorted; share = fraction of the expert's tokens.
    rank_load: R expected tokens per rank; max_rank_load its max.
    cross_node_tokens: expected tokens crossing a node boundary with HALO dedup
      (pairwise model, FORMULATION.md 2.3); with node_of_rank None every rank is a node.
    objective = max_rank_load + traffic_weight * cross_node_tokens.
    """

    rank_of_expert: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...]
    replicas: tuple[tuple[int, int, float], ...]
    rank_load: tuple[float, ...]
    max_rank_load: float
    cross_node_tokens: float
    objective: float
    report: SolveReport


def solve_experts(
    load_E: Sequence[float],
    ep: int,
    options: SolverOptions,
    node_of_rank: Sequence[int] | None = None,
    coactivation_EE: Sequence[Sequence[float]] | None = None,
    traffic_weight: float = 0.0,
    redundant_slots: int = 0,
    max_replicas: int = 4,
    accept_gap: float = 0.0,
) -> ExpertSolution:
    """Balanced (and traffic-aware) expert placement with equal slots per rank.

    Args:
        load_E: expected tokens routed to each expert (>= 0).
        ep: EP ranks; must divide E. Rank r holds slot_counts(E, ep, redundant_slots)[r].
        options: backend, time limit (s), threads, seed.
        node_of_rank: R node ids (ranks of a node are interchangeable); None = one node each.
        coactivation_EE: tokens whose top-k includes both e and e2 (symmetric, diagonal unused).
        traffic_weight: weight of cross-node tokens against the hottest rank's tokens.
        redundant_slots: extra slots over the whole EP group (slot_counts spreads them),
            filled by replicas of hot experts; a replicated expert's tokens split evenly
            over its replicas (<= max_replicas copies, on distinct ranks).
        accept_gap: without traffic, a warm start whose hottest rank is within this
            fraction of the lower bound is returned without a solve (FEASIBLE, its gap).
    Returns:
        ExpertSolution; a time limit returns the best placement found with its gap.
    """
    data = _Data.build(
        load_E, ep, node_of_rank, coactivation_EE, traffic_weight, redundant_slots, max_replicas
    )
    greedy = data.greedy()
    if not data.traffic_active and max(_rank_load_q(data, greedy, _copies(greedy))) == (
        data.lower_bound_q()
    ):  # e.g. uniform loads: the warm start meets the lower bound, nothing to search
        report = SolveReport(
            options.backend, "OPTIMAL", 0.0, 0.0, 0.0, 0.0, "greedy placement meets the lower bound"
        )
        return _result(data, _canonical(data, greedy), report)
    hottest_q, bound_q = max(_rank_load_q(data, greedy, _copies(greedy))), data.lower_bound_q()
    if not data.traffic_active and hottest_q <= bound_q * (1 + accept_gap):
        report = SolveReport(
            options.backend, "FEASIBLE", math.nan, bound_q * data.unit, math.nan, 0.0,
            f"greedy placement within {accept_gap:.2%} of the lower bound",
        )  # fmt: skip
        return _result(data, _canonical(data, greedy), report)
    start = _warm_start(data)
    if data.redundant_slots and data.num_e * data.ep * data.max_replicas > MAX_REPLICA_VARIABLES:
        bound = data.lower_bound_q() * data.unit
        report = SolveReport(
            options.backend, "FEASIBLE", math.nan, bound, math.nan, 0.0,
            "replica model too large to build; greedy placement",
        )  # fmt: skip
        return _result(data, _canonical(data, start), report)
    model, x, decode = _build_model(data, start)
    sol = solve(model, options)
    if not sol.report.has_solution:  # time limit hit before the solver kept the hint
        placement = start
        bound = data.lower_bound_q() * data.unit
        report = SolveReport(
            options.backend,
            "FEASIBLE",
            math.nan,
            bound,
            math.nan,
            sol.report.wall_s,
            sol.report.message,
        )
    else:
        placement, report = decode(sol.values), sol.report
    return _result(data, _canonical(data, placement), report)


@dataclass(frozen=True)
class _Data:
    load_E: tuple[float, ...]
    load_q: tuple[int, ...]
    unit: float
    ep: int
    slots: tuple[int, ...]  # per rank, replicas included
    node_of_rank: tuple[int, ...]
    pairs: tuple[tuple[int, int, float], ...]  # (e, e2, coactivated tokens), e < e2
    traffic_weight: float
    redundant_slots: int
    max_replicas: int

    @staticmethod
    def build(load_E, ep, node_of_rank, coact, weight, redundant, max_replicas) -> _Data:
        loads = tuple(float(x) for x in load_E)
        num_e = len(loads)
        if ep < 1 or num_e == 0 or num_e % ep:
            raise SpecError(f"expert placement: ep={ep} must divide the {num_e} experts")
        if any(not math.isfinite(x) or x < 0 for x in loads):
            raise SpecError("expert placement: expert loads must be finite and >= 0")
        if redundant < 0 or max_replicas < 1:
            raise SpecError("expert placement: redundant_slots >= 0 and max_replicas >= 1")
        nodes = tuple(node_of_rank) if node_of_rank is not None else tuple(range(ep))
        if len(nodes) != ep:
            raise SpecError(f"expert placement: node_of_rank has {len(nodes)} entries, need {ep}")
        if redundant and weight:
            raise SpecError(
                "expert placement: traffic_weight with redundant_slots is not "
                "supported; set one of them to 0"
            )
        if num_e * min(max_replicas, ep) < num_e + redundant:
            raise SpecError(
                "expert placement: too few replicas allowed to fill the redundant "
                "slots; raise max_replicas or lower redundant_slots"
            )
        copies = min(max_replicas, ep)
        # With replicas a load is split into 1..copies equal shares (C9): integer loads that
        # are multiples of lcm(1..copies) split exactly, so the model's optimum and its lower
        # bound are the true ones (rounded-up shares leave equal loads one unit above the
        # mean, which CP-SAT then spends its whole limit trying to reach).
        split = math.lcm(*range(1, copies + 1)) if redundant else 1
        unit = unit_for(sum(loads), RESOLUTION)
        return _Data(
            loads,
            tuple(quantize(x, unit) * split for x in loads),
            unit / split,
            ep,
            slot_counts(num_e, ep, redundant),
            nodes,
            _pairs(coact, num_e),
            float(weight),
            redundant,
            copies,
        )

    @property
    def num_e(self) -> int:
        return len(self.load_E)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of_rank))

    def lower_bound_q(self) -> int:
        """Valid bound on the hottest rank: the mean load, and the hottest expert's share."""
        mean = -(-sum(self.load_q) // self.ep)
        if self.redundant_slots:
            return max(mean, max(-(-q // self.max_replicas) for q in self.load_q))
        hot = max(range(self.num_e), key=lambda e: (self.load_q[e], -e))
        rest = sorted(q for e, q in enumerate(self.load_q) if e != hot)[: self.slots[0] - 1]
        return max(mean, self.load_q[hot] + sum(rest))

    @property
    def traffic_active(self) -> bool:
        return bool(self.traffic_weight and self.pairs and self.num_nodes > 1)

    def symmetry_classes(self) -> list[list[int]]:
        """Groups of interchangeable ranks: those with as many slots (and, with traffic, on
        one node)."""
        key = {r: (self.slots[r], self.node_of_rank[r] if self.traffic_active else 0)
               for r in range(self.ep)}  # fmt: skip
        classes: dict[tuple[int, int], list[int]] = {}
        for r in range(self.ep):
            classes.setdefault(key[r], []).append(r)
        return list(classes.values())

    def ranks_of_node(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for r, n in enumerate(self.node_of_rank):
            out.setdefault(n, []).append(r)
        return out

    def greedy(self) -> dict[int, list[int]]:
        """The warm start without traffic: expert_swap.lpt_with_replicas or, with replicas,
        expert_swap.replicate_then_pack when its hottest rank is cooler (on skewed loads it
        lands within a few percent of the mean where LPT's is 10-50% above it)."""
        lpt = lpt_with_replicas(self.load_E, self.slots, self.redundant_slots, self.max_replicas)
        if not self.redundant_slots:
            return lpt
        packed = replicate_then_pack(self.load_E, self.slots, self.redundant_slots,
                                     self.max_replicas)  # fmt: skip
        if packed is None or len(_copies(packed)) < self.num_e:
            return lpt

        def hottest(held: dict[int, list[int]]) -> int:
            return max(_rank_load_q(self, held, _copies(held)))

        return packed if hottest(packed) < hottest(lpt) else lpt


def _pairs(coact, num_e: int) -> tuple[tuple[int, int, float], ...]:
    if coact is None:
        return ()
    if len(coact) != num_e or any(len(row) != num_e for row in coact):
        raise SpecError(f"expert placement: coactivation must be {num_e} x {num_e}")
    return tuple(
        (e, e2, float(coact[e][e2]))
        for e in range(num_e)
        for e2 in range(e + 1, num_e)
        if coact[e][e2] > 0
    )


def _build_model(data: _Data, start: dict[int, list[int]]):
    """Data -> Variables -> Constraints -> Objective; returns (model, x, decode)."""
    num_e, ep = data.num_e, data.ep
    offset = 0.0  # constant part of the crossings, so objective/bound are in tokens
    if data.traffic_active:
        offset = data.traffic_weight * (1 - 1 / data.num_nodes) * sum(data.load_E)
    model = LinearModel("expert_ip", objective_unit=data.unit, objective_offset=offset)
    copies = range(1, data.max_replicas + 1) if data.redundant_slots else range(1, 2)

    # Variables: expert e on rank r; with replicas also "on rank r as one of c replicas" and
    # "has c replicas"; the hottest rank's load (lower bound: a trivially valid one).
    x = [[model.bool_var(f"expert{e}_on_rank{r}") for r in range(ep)] for e in range(num_e)]
    y, z = {}, {}
    if data.redundant_slots:
        z = {
            (e, c): model.bool_var(f"expert{e}_has_{c}_replicas")
            for e in range(num_e)
            for c in copies
        }
        y = {
            (e, r, c): model.bool_var(f"expert{e}_on_rank{r}_of_{c}")
            for e in range(num_e)
            for r in range(ep)
            for c in copies
        }
    zmax = model.num_var(data.lower_bound_q(), sum(data.load_q), "max_rank_load")

    _placement_constraints(model, data, x, y, z, copies)
    load_terms = _load_constraints(model, data, x, y, zmax, copies)
    _symmetry_constraints(model, data, x, load_terms)
    # C11: pairs (e, e2) count as co-located on node n only if both are on n (see _pair_terms).
    together, pair_vars = _pair_terms(model, data, x, data.ranks_of_node())

    # Objective: hottest rank + traffic_weight x (placement-dependent part of) crossings.
    model.minimize([(1, zmax)] + together)
    _hint(model, data, start, x, y, z, zmax, pair_vars)

    def decode(values) -> dict[int, list[int]]:
        return {r: [e for e in range(num_e) if values[x[e][r]]] for r in range(ep)}

    return model, x, decode


def _placement_constraints(model, data: _Data, x, y, z, copies) -> None:
    """C7 (each expert placed once, or on exactly c distinct ranks) and C8 (equal slots)."""
    num_e, ep = data.num_e, data.ep
    # C7: every expert is placed once, or (replicas) on exactly c distinct ranks for one c.
    for e in range(num_e):
        if not data.redundant_slots:
            model.add([(1, x[e][r]) for r in range(ep)], "==", 1, f"C7_once_e{e}")
            continue
        model.add([(1, z[(e, c)]) for c in copies], "==", 1, f"C7_count_e{e}")
        for c in copies:
            model.add([(1, y[(e, r, c)]) for r in range(ep)] + [(-c, z[(e, c)])], "==", 0)
        for r in range(ep):
            model.add([(1, x[e][r])] + [(-1, y[(e, r, c)]) for c in copies], "==", 0)
    # C8: every rank fills exactly its slots.
    for r in range(ep):
        model.add([(1, x[e][r]) for e in range(num_e)], "==", data.slots[r], f"C8_slots_r{r}")


def _load_constraints(model, data: _Data, x, y, zmax, copies) -> dict[int, list]:
    """C9: each rank's expected tokens (split evenly over replicas) <= zmax; returns the
    load terms per rank."""
    load_terms = {}
    for r in range(data.ep):
        if data.redundant_slots:
            terms = [
                (-(-data.load_q[e] // c), y[(e, r, c)]) for e in range(data.num_e) for c in copies
            ]
        else:
            terms = [(data.load_q[e], x[e][r]) for e in range(data.num_e)]
        load_terms[r] = terms
        model.add(terms + [(-1, zmax)], "<=", 0, f"C9_load_r{r}")
    return load_terms


def _symmetry_constraints(model, data: _Data, x, load_terms) -> None:
    """C10: symmetry breaking among interchangeable ranks. Without replicas: ordered by their
    smallest expert, the j-th rank holds only experts >= j. With replicas: loads descend."""
    for ranks in data.symmetry_classes():
        for j, r in enumerate(ranks):
            if not data.redundant_slots:
                for e in range(min(j, data.num_e)):
                    model.add([(1, x[e][r])], "==", 0, f"C10_sym_e{e}_r{r}")
            elif j > 0:
                prev = [(c, v) for c, v in load_terms[ranks[j - 1]]]
                this = [(-c, v) for c, v in load_terms[r]]
                model.add(prev + this, ">=", 0, f"C10_order_r{r}")


def _pair_terms(model, data, x, classes):
    """Objective terms of co-located pairs, and their variables {(e, e2, node): var}."""
    if not data.traffic_active:
        return [], {}
    keep = _strong_pairs(data)
    factor = data.traffic_weight * (1 - 1 / data.num_nodes)
    terms, pair_vars = [], {}
    for e, e2, tokens in keep:
        for n, ranks in classes.items():
            p = model.bool_var(f"experts{e}_{e2}_on_node{n}")
            pair_vars[(e, e2, n)] = p
            for ee in (e, e2):  # C11
                model.add([(1, p)] + [(-1, x[ee][r]) for r in ranks], "<=", 0, f"C11_{e}_{e2}_{n}")
            terms.append((-quantize(factor * tokens, data.unit), p))
    return terms, pair_vars


def _strong_pairs(data: _Data) -> list[tuple[int, int, float]]:
    """All pairs on small instances; else the MAX_PAIRS_PER_EXPERT strongest pairs of each
    expert (ties by index), to keep the model small."""
    if len(data.pairs) <= MAX_PAIRS_PER_EXPERT * data.num_e:
        return list(data.pairs)
    keep: set[tuple[int, int, float]] = set()
    by_e: dict[int, list[tuple[int, int, float]]] = {}
    for p in data.pairs:
        by_e.setdefault(p[0], []).append(p)
        by_e.setdefault(p[1], []).append(p)
    for rows in by_e.values():
        keep.update(sorted(rows, key=lambda p: (-p[2], p[0], p[1]))[:MAX_PAIRS_PER_EXPERT])
    return sorted(keep)


def _warm_start(data: _Data) -> dict[int, list[int]]:
    """LPT, then (traffic on) swaps between nodes that lower the objective."""
    held = data.greedy()
    if not data.traffic_active:
        return held
    factor = data.traffic_weight * (1 - 1 / data.num_nodes)
    weights = {(e, f): quantize(factor * t, data.unit) for e, f, t in _strong_pairs(data)}
    return improve_by_swaps(held, data.load_q, data.node_of_rank, weights)


def _hint(model, data: _Data, start, x, y, z, zmax, pair_vars) -> None:
    held = _symmetric_first(data, start)
    count = {e: sum(e in v for v in held.values()) for e in range(data.num_e)}
    rank_of = {e: r for r in held for e in held[r]}
    for (e, e2, n), v in pair_vars.items():
        model.hint(v, int(data.node_of_rank[rank_of[e]] == data.node_of_rank[rank_of[e2]] == n))
    for e in range(data.num_e):
        for r in range(data.ep):
            model.hint(x[e][r], int(e in held[r]))
    for (e, r, c), v in y.items():
        model.hint(v, int(e in held[r] and count[e] == c))
    for (e, c), v in z.items():
        model.hint(v, int(count[e] == c))
    model.hint(zmax, max(max(_rank_load_q(data, held, count)), data.lower_bound_q()))


def _symmetric_first(data: _Data, held: dict[int, list[int]]) -> dict[int, list[int]]:
    """Relabel interchangeable ranks by their smallest expert (the order C10 expects)."""
    out: dict[int, list[int]] = {}
    count = _copies(held)
    for ranks in data.symmetry_classes():
        if data.redundant_slots:  # C10 with replicas: loads non-increasing

            def key(s):
                return (-sum(-(-data.load_q[e] // count[e]) for e in s), s)
        else:  # C10 without: ordered by smallest expert

            def key(s):
                return (s[:1], s)

        sets = sorted((sorted(held[r]) for r in ranks), key=key)
        out.update(zip(ranks, sets, strict=True))
    return out


def _copies(held: dict[int, list[int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for experts in held.values():
        for e in experts:
            out[e] = out.get(e, 0) + 1
    return out


def _rank_load_q(data, held, count) -> list[int]:
    return [sum(-(-data.load_q[e] // count[e]) for e in held[r]) for r in range(data.ep)]


def _canonical(data: _Data, held: dict[int, list[int]]) -> dict[int, list[int]]:
    """Relabel interchangeable ranks (same node): hottest first, then by expert ids."""
    count = {e: sum(e in v for v in held.values()) for e in range(data.num_e)}
    out: dict[int, list[int]] = {}
    for ranks in data.symmetry_classes():
        sets = sorted(
            (sorted(held[r]) for r in ranks),
            key=lambda s: (-sum(data.load_E[e] / count[e] for e in s), s),
        )
        out.update(zip(ranks, sets, strict=True))
    return out


def _result(data: _Data, held: dict[int, list[int]], report: SolveReport) -> ExpertSolution:
    count = {e: sum(e in v for v in held.values()) for e in range(data.num_e)}
    rows = tuple(sorted((e, r, 1.0 / count[e]) for r in held for e in held[r]))
    slots = tuple(tuple(sorted(held[r])) for r in range(data.ep))
    rank_of = tuple(min(r for r in held if e in held[r]) for e in range(data.num_e))
    rank_load = tuple(sum(data.load_E[e] / count[e] for e in held[r]) for r in range(data.ep))
    cross = cross_node_tokens(data.load_E, rank_of, data.node_of_rank, data.pairs)
    objective = max(rank_load) + data.traffic_weight * cross
    if report.status == "OPTIMAL":
        report = replace(report, objective=objective, bound=objective, gap=0.0)
    else:
        bound = report.bound if math.isfinite(report.bound) else data.lower_bound_q() * data.unit
        bound = min(bound, objective)
        gap = (objective - bound) / objective if objective > 0 else 0.0
        report = replace(report, status="FEASIBLE", objective=objective, bound=bound, gap=gap)
    return ExpertSolution(rank_of, slots, rows, rank_load, max(rank_load), cross, objective, report)


def cross_node_tokens(
    load_E: Sequence[float],
    rank_of_expert: Sequence[int],
    node_of_rank: Sequence[int],
    pairs: Sequence[tuple[int, int, float]],
) -> float:
    """Expected routed tokens that cross a node boundary with HALO dedup (pairwise model).

    A token goes once to each distinct node among its experts; that node is remote with
    probability 1 - 1/N (tokens start uniformly over the N nodes). Distinct nodes per token
    = k - (co-located pairs among its experts): exact for k <= 2, a lower bound above.
    """
    num_nodes = len(set(node_of_rank))
    if num_nodes < 2:
        return 0.0
    node = [node_of_rank[r] for r in rank_of_expert]
    together = sum(t for e, e2, t in pairs if node[e] == node[e2])
    return (1 - 1 / num_nodes) * (sum(load_E) - together)
