"""Job-start placement: the rank IP on the nodes Slurm allocated, the plan's layout fixed.

Entry point `place_plan(plan, allocation, options) -> Placement`. The rank IP
(planner.ip.rank_ip.solve_ranks) places the plan's logical ranks on the allocation's nodes,
given each node's switch and group (planner.inputs.slurm_topology). Three rank-to-node
orders are priced side by side:

- placed: the rank IP's order on this allocation;
- slurm order: the plan's own `ranks[].node` applied to the hosts in the order Slurm lists
  them (what the sbatch script does without placement);
- compact: the plan's order on the first nodes of the cluster (`default_allocation`), the
  allocation the plan was priced on.

Pricing (`step_time_s`): the resource model prices each kind of group (TP, CP, expert TP, EP
all-to-all, dense and expert data parallel, pipeline p2p) at one topology level, named in its
`comm_s` entries (`a2a_switch`, ...). On an allocation a group can reach farther: a group whose
nodes sit on two switches crosses the links of the first level wider than a node (the switch
tier), on two groups those of the next level, beyond that the outermost level. For each priced
level L, the slowest level L' any group priced at L crosses replaces L's bandwidth, latency and
taper, and the resource model (planner.resources.cost.estimate) prices the plan again, so the
step time keeps the plan's overlap and pipeline schedule. The slowest group sets the step:
ranks wait for each other at the gradient reduction. The compact order reproduces the plan's
predicted step time.

The order written is the placed one unless the plan's own order is predicted faster on this
allocation (the IP counts straddling groups, the pricing seconds); then the plan's order is
kept, so placement is never predicted slower than the Slurm order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

from planner.calibrate.compare import plan_inputs
from planner.inputs.allocation import Allocation, default_allocation
from planner.ip.rank_ip import group_ranks, logical_rank, solve_ranks
from planner.ip.solvers import SolverOptions
from planner.parallel import ParallelConfig
from planner.plan.schema import Plan, RankPlan, SolveReport
from planner.specs import ClusterSpec, SpecError


@dataclass(frozen=True)
class PricedOrder:
    """One rank-to-node order on an allocation and its predicted step time.

    name: "placed" | "slurm order" | "compact".
    hosts: the host of each rank, in rank order (the hostfile).
    local_ranks: the device index inside its node of each rank.
    step_time_s: predicted step time (see the module docstring).
    crossings: 'kinds: priced level -> level crossed here' for each group kind that reaches
        farther on this allocation than on the compact one (e.g. 'a2a: switch -> system').
    """

    name: str
    hosts: tuple[str, ...]
    local_ranks: tuple[int, ...]
    step_time_s: float
    crossings: tuple[str, ...]


@dataclass(frozen=True)
class Placement:
    """The order to launch (`chosen`), the three priced orders and the rank IP's report."""

    chosen: PricedOrder
    placed: PricedOrder
    slurm_order: PricedOrder
    compact: PricedOrder
    report: SolveReport
    nodes_allocated: int
    nodes_used: int
    switches: int
    groups: int
    solve_s: float


def place_plan(plan: Plan, allocation: Allocation, options: SolverOptions) -> Placement:
    """Place the plan's ranks on `allocation` (job order) and price the orders.

    Args:
        plan: a loaded plan.json (layout, stages and experts stay as planned).
        allocation: the job's nodes with switch and group ids, in Slurm's order.
        options: the rank IP's backend, time limit (s), threads and seed.
    Raises:
        SpecError: the allocation has fewer nodes than the plan uses.
    """
    cluster = plan.cluster_spec()
    par = plan.parallel.config()
    g = cluster.gpus_per_node
    need = max(math.ceil(par.world / g), max(r.node for r in plan.ranks) + 1)
    if len(allocation) < need:
        raise SpecError(
            f"{allocation.source or '--nodelist'}: {len(allocation)} nodes but the plan uses "
            f"{need} ({par.world} ranks, {g} per node); allocate at least {need} nodes"
        )
    start = time.perf_counter()
    sol = solve_ranks(par, cluster, allocation, options)
    solve_s = time.perf_counter() - start
    plan_ranks = tuple(sorted(plan.ranks, key=lambda r: r.rank))
    compact_alloc = default_allocation(cluster, need)
    pricer = _Pricer(plan, cluster, par)
    compact = pricer.order("compact", compact_alloc, plan_ranks)  # first: the reference
    placed = pricer.order("placed", allocation, sol.ranks)
    slurm = pricer.order("slurm order", allocation, plan_ranks)
    chosen = placed if placed.step_time_s <= slurm.step_time_s else slurm
    return Placement(
        chosen, placed, slurm, compact, sol.report, len(allocation),
        len({r.node for r in sol.ranks}), allocation.num_switches, allocation.num_groups, solve_s,
    )  # fmt: skip


class _Pricer:
    """Prices rank orders of one plan (see the module docstring); the resource model runs
    once for the plan and once per (priced level, crossed level) pair."""

    def __init__(self, plan: Plan, cluster: ClusterSpec, par: ParallelConfig) -> None:
        self.plan, self.cluster = plan, cluster
        self.base = self._estimate({})
        self.index = {lv.name: i for i, lv in enumerate(cluster.levels)}
        priced: dict[str, int] = {}  # comm_s prefix -> the level it is priced at
        for name, _ in self.base.comm_s:
            prefix, _, level = name.rpartition("_")
            if level in self.index:
                priced[prefix] = max(priced.get(prefix, -1), self.index[level])
        self.groups = [
            (kinds, max(priced[k] for k in kinds if k in priced), ranks)
            for kinds, ranks in rank_groups(par)
            if any(k in priced for k in kinds)
        ]
        above = [i for i, lv in enumerate(cluster.levels) if lv.devices > cluster.gpus_per_node]
        last = len(cluster.levels) - 1
        # allocation tier (one switch, one group, several groups) -> topology level index
        self.tier_level = [above[t] if t < len(above) else last for t in range(3)]
        self.compact: list[int] | None = None
        self.subs: dict[tuple[int, int], Any] = {}

    def order(self, name: str, alloc: Allocation, ranks: tuple[RankPlan, ...]) -> PricedOrder:
        tiers = self.tiers(alloc, ranks)
        if self.compact is None:  # the first order priced is the compact one
            self.compact = tiers
        crossed: dict[tuple[int, int], set[str]] = {}
        for (kinds, planned, _), tier, base_tier in zip(self.groups, tiers, self.compact,
                                                        strict=True):  # fmt: skip
            if tier > base_tier and self.tier_level[tier] > planned:
                crossed.setdefault((planned, self.tier_level[tier]), set()).update(kinds)
        step = self.base.step_time_s + sum(self._extra_s(k, v) for k, v in crossed.items())
        names = [lv.name for lv in self.cluster.levels]
        return PricedOrder(
            name,
            tuple(alloc.nodes[r.node].hostname for r in ranks),
            tuple(r.local_rank for r in ranks),
            step,
            tuple(
                f"{'+'.join(sorted(crossed[a, b]))}: {names[a]} -> {names[b]}"
                for a, b in sorted(crossed)
            ),  # fmt: skip
        )

    def tiers(self, alloc: Allocation, ranks: tuple[RankPlan, ...]) -> list[int]:
        """Per group: -1 on one node, 0 one switch, 1 one group, 2 several groups."""
        node_of = [r.node for r in ranks]
        where_of = [(n.group, n.switch) for n in alloc.nodes]
        out = []
        for _, _, members in self.groups:
            where = {where_of[node_of[r]] for r in members}
            nodes = len({node_of[r] for r in members})
            out.append(-1 if nodes == 1 else 0 if len(where) == 1
                       else 1 if len({w[0] for w in where}) == 1 else 2)  # fmt: skip
        return out

    def _extra_s(self, levels: tuple[int, int], kinds: set[str]) -> float:
        """Step seconds added when the groups of `kinds` priced at level levels[0] cross
        levels[1]: the resource model's step change with level levels[0] priced as
        levels[1], in the share of that level's added communication seconds those kinds
        carry."""
        if levels not in self.subs:
            self.subs[levels] = self._estimate({levels[0]: levels[1]})
        sub = self.subs[levels]
        name = self.cluster.levels[levels[0]].name
        before, after = dict(self.base.comm_s), dict(sub.comm_s)
        added = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith(f"_{name}")}
        total = sum(added.values())
        if total <= 0:
            return 0.0
        mine = sum(v for k, v in added.items() if k.rpartition("_")[0] in kinds)
        return max(sub.step_time_s - self.base.step_time_s, 0.0) * mine / total

    def _estimate(self, substitute: dict[int, int]) -> Any:
        """The resource model's Estimate of the plan, level L priced as level substitute[L]."""
        from planner.resources.cost import estimate

        levels = list(self.cluster.levels)
        for planned, actual in substitute.items():
            slow = self.cluster.levels[actual]
            levels[planned] = replace(levels[planned], bw_gbps=slow.bw_gbps,
                                      latency_us=slow.latency_us, taper=slow.taper,
                                      kind=slow.kind)  # fmt: skip
        cluster = replace(self.cluster, levels=tuple(levels))
        model, cl, training, parallel = plan_inputs(self.plan, cluster)
        stages = sorted(self.plan.stages, key=lambda s: s.stage)
        dispatcher = self.plan.extra.get("dispatcher", "flat")
        return estimate(
            model, cl, training, parallel,
            stage_layers=[s.layers for s in stages],
            recompute_layers=[s.recompute_layers for s in stages],
            dispatcher=dispatcher if dispatcher in ("flat", "halo", "deepep") else "flat",
        )  # fmt: skip


def rank_groups(par: ParallelConfig) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every communicating group of ranks with the resource model's names for its traffic
    (comm_s prefixes): TP, CP, expert-TP and EP groups (planner.ip.rank_ip), the data-parallel
    groups of dense and expert parameters, and pipeline-neighbour pairs."""
    names = {"tp": ("tp",), "cp": ("cp",), "etp": ("etp",), "ep": ("a2a",)}
    groups = [(names[kind], ranks) for kind, ranks in group_ranks(par)]
    dense: dict[tuple[int, ...], list[int]] = {}
    expert: dict[tuple[int, ...], list[int]] = {}
    block = par.tp * par.cp * par.dp
    for r in range(par.world):
        stage, _, cp_idx, tp_idx, _ = logical_rank(par, r)
        dense.setdefault((stage, cp_idx, tp_idx), []).append(r)
        expert.setdefault((stage, r % block % (par.etp * par.ep)), []).append(r)
    groups += [(("dp", "fsdp"), tuple(m)) for m in dense.values() if len(m) > 1]
    groups += [(("edp",), tuple(m)) for m in expert.values() if len(m) > 1]
    groups += [(("p2p",), (r, r + block)) for r in range(par.world - block)]
    return groups
