"""Job-start placement: the rank IP on the nodes Slurm allocated, the plan's layout fixed.

Entry point `place_plan(plan, allocation, options) -> Placement`. The rank IP
(planner.ip.rank_ip.solve_ranks) places the plan's logical ranks on the allocation's nodes,
given each node's switch and group (planner.inputs.slurm_topology). Three rank-to-node
orders are priced side by side:

- placed: the rank IP's order on this allocation; when the IP's model would have more than
  PLACE_IP_CELLS node x switch cells (its build alone outlasts a job-start budget), the
  greedy-by-switch warm start of planner.run.place_layout instead, reported with its gap to
  the compact allocation's step time (a lower bound under this pricing);
- slurm order: the plan's own `ranks[].node` applied to the hosts in the order Slurm lists
  them (what the sbatch script does without placement);
- compact: the plan's order on the first nodes of the cluster (`default_allocation`), the
  allocation the plan was priced on.

Pricing (`step_time_s`): the resource model prices each kind of group (TP, CP, expert TP, EP
all-to-all, dense and expert data parallel, pipeline p2p) at one topology level, named in its
`comm_s` entries (`a2a_switch`, ...). On an allocation a group can reach farther: a group whose
nodes sit on two switches crosses the links of the first level wider than a node (the switch
tier), on two groups those of the next level, beyond that the outermost level. For each priced
level L and kind, the slowest level L' a group of that kind crosses (the slowest group sets the
step: ranks wait for each other at the gradient reduction) replaces L's bandwidth, latency and
taper, and the resource model (planner.resources.cost.estimate) prices the plan again, so the
step time keeps the plan's overlap and pipeline schedule; the step-time change is charged in
the share of level L's added communication seconds that the crossing kinds carry. The compact
order reproduces the plan's predicted step time.

The order written is the placed one unless the plan's own order is predicted faster on this
allocation (the IP counts straddling groups, the pricing seconds); then the plan's order is
kept, so placement is never predicted slower than the Slurm order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from planner.calibrate.compare import plan_inputs
from planner.inputs.allocation import Allocation, default_allocation
from planner.ip.rank_ip import solve_ranks
from planner.ip.solvers import SolverOptions
from planner.parallel import ParallelConfig
from planner.plan.schema import Plan, RankPlan, SolveReport
from planner.resources.layer_comm import DISPATCHERS
from planner.run.place_layout import (
    greedy_by_switch,
    node_array,
    position_ids,
    rank_group_arrays,
    span_nodes,
    tiers_K,
)
from planner.specs import ClusterSpec, SpecError

# chunk x switch cells above which the rank IP's model is not built at job start (its build
# alone outlasts a job-start budget): the greedy-by-switch warm start is used instead
PLACE_IP_CELLS = 8192


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


def place_plan(
    plan: Plan, allocation: Allocation, options: SolverOptions, where: str = "plan.json"
) -> Placement:
    """Place the plan's ranks on `allocation` (job order) and price the orders.

    Args:
        plan: a loaded plan.json (layout, stages and experts stay as planned).
        allocation: the job's nodes with switch and group ids, in Slurm's order.
        options: the rank IP's backend, time limit (s), threads and seed.
        where: the plan's file, named in errors.
    Raises:
        SpecError: the plan has no ranks table or a local rank beyond its cluster's devices
            per node; the allocation has fewer nodes than the plan uses.
    """
    cluster = plan.cluster_spec(where)
    par = plan.parallel.config()
    g = cluster.gpus_per_node
    _check_ranks(plan, g, where)
    need = max(math.ceil(par.world / g), max(r.node for r in plan.ranks) + 1)
    if len(allocation) < need:
        raise SpecError(
            f"{allocation.source or '--nodelist'}: {len(allocation)} nodes but the plan uses "
            f"{need} ({par.world} ranks, {g} per node); allocate at least {need} nodes"
        )
    pricer = _Pricer(plan, cluster, par)
    plan_ranks = tuple(sorted(plan.ranks, key=lambda r: r.rank))
    compact = pricer.order("compact", default_allocation(cluster, need), plan_ranks)
    slurm = pricer.order("slurm order", allocation, plan_ranks)
    start = time.perf_counter()
    if need * allocation.num_switches <= PLACE_IP_CELLS:
        sol = solve_ranks(par, cluster, allocation, options)
        placed = pricer.order("placed", allocation, sol.ranks)
        report = sol.report
    else:
        ranks = greedy_by_switch(par, allocation, g, span_nodes(pricer.arrays, g))
        placed = pricer.order("placed", allocation, ranks)
        gap = 1 - compact.step_time_s / placed.step_time_s if placed.step_time_s else 0.0
        report = SolveReport(
            "greedy-by-switch", "FEASIBLE", placed.step_time_s, compact.step_time_s, gap, 0.0,
            f"{need} nodes x {allocation.num_switches} switches: greedy warm start, no IP; "
            "objective and bound are step times (s), the bound a compact allocation",
        )  # fmt: skip
    solve_s = time.perf_counter() - start
    chosen = placed if placed.step_time_s <= slurm.step_time_s else slurm
    return Placement(
        chosen, placed, slurm, compact, report, len(allocation), need,
        allocation.num_switches, allocation.num_groups, solve_s,
    )  # fmt: skip


def _check_ranks(plan: Plan, gpus_per_node: int, where: str) -> None:
    """The plan's ranks table is there (the Slurm order and the compact one are its order)
    and fits the cluster's nodes (planner.plan.check has checked the rest)."""
    if not plan.ranks:
        raise SpecError(
            f"{where}: field 'ranks' is empty; piper place needs the plan's rank placement: "
            "regenerate it with 'piper plan'"
        )
    beyond = next((r for r in plan.ranks if r.local_rank >= gpus_per_node), None)
    if beyond is not None:
        raise SpecError(
            f"{where}: field 'ranks' puts rank {beyond.rank} on local rank {beyond.local_rank} "
            f"but the cluster has {gpus_per_node} devices per node; regenerate it with "
            "'piper plan'"
        )


class _Pricer:
    """Prices rank orders of one plan (see the module docstring); the resource model runs
    once for the plan and once per (priced level, crossed level) pair."""

    def __init__(self, plan: Plan, cluster: ClusterSpec, par: ParallelConfig) -> None:
        self.plan, self.cluster = plan, cluster
        self.base = self._estimate({})
        index = {lv.name: i for i, lv in enumerate(cluster.levels)}
        priced: dict[str, int] = {}  # comm_s prefix -> the level it is priced at
        for name, _ in self.base.comm_s:
            prefix, _, level = name.rpartition("_")
            if level in index:
                priced[prefix] = max(priced.get(prefix, -1), index[level])
        self.arrays = rank_group_arrays(par)
        self.groups = [
            (kinds, max(priced[k] for k in kinds if k in priced), ranks_KM)
            for kinds, ranks_KM in self.arrays
            if any(k in priced for k in kinds)
        ]
        above = [i for i, lv in enumerate(cluster.levels) if lv.devices > cluster.gpus_per_node]
        last = len(cluster.levels) - 1
        # allocation tier (one switch, one group, several groups) -> topology level index
        self.tier_level = np.asarray([above[t] if t < len(above) else last for t in range(3)])
        self.compact: list[np.ndarray] | None = None
        self.subs: dict[tuple[int, int], Any] = {}

    def order(self, name: str, alloc: Allocation, ranks: tuple[RankPlan, ...]) -> PricedOrder:
        node_of = node_array(ranks)
        switch_N, group_N = position_ids(alloc)
        tiers = [tiers_K(ranks_KM, node_of, switch_N, group_N) for _, _, ranks_KM in self.groups]
        if self.compact is None:  # the first order priced is the compact one
            self.compact = tiers
        crossed: dict[tuple[int, int], set[str]] = {}  # the slowest group of a kind sets it
        for (kinds, planned, _), tier_K, base_K in zip(self.groups, tiers, self.compact,
                                                       strict=True):  # fmt: skip
            reach_K = np.where(tier_K >= 0, self.tier_level[np.maximum(tier_K, 0)], -1)
            farther = (tier_K > base_K) & (reach_K > planned)
            if farther.any():
                crossed.setdefault((planned, int(reach_K[farther].max())), set()).update(kinds)
        step = self.base.step_time_s + sum(self._extra_s(k, v) for k, v in crossed.items())
        names = [lv.name for lv in self.cluster.levels]
        ordered = sorted(ranks, key=lambda r: r.rank)
        return PricedOrder(
            name,
            tuple(alloc.nodes[r.node].hostname for r in ordered),
            tuple(r.local_rank for r in ordered),
            step,
            tuple(
                f"{'+'.join(sorted(crossed[a, b]))}: {names[a]} -> {names[b]}"
                for a, b in sorted(crossed)
            ),  # fmt: skip
        )

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
            dispatcher=dispatcher if dispatcher in DISPATCHERS else "flat",
        )  # fmt: skip
