"""Rank IP: logical ranks -> devices of a (possibly fragmented) allocation (FORMULATION.md, 3).

Entry point `solve_ranks(parallel, cluster, allocation, options) -> RankSolution`.

Logical ranks follow Megatron-Core's order (FORMULATION.md, section 3): with B = tp*cp*dp
ranks per stage, r = stage*B + j, j = dp_idx*(cp*tp) + cp_idx*tp + tp_idx; the expert mesh
folds over the same block, ep_idx = (j // etp) % ep, so an EP group is `ep` ranks `etp`
apart inside the block (ep may exceed dp*tp). TP groups are tp consecutive ranks, CP groups cp
ranks tp apart, expert-TP groups etp consecutive ranks. Ranks are cut into node-sized
*chunks* of consecutive ranks (chunk c = ranks [c*g, (c+1)*g)), so local rank = r % g, groups
whose span fits in a node stay inside one, and rail peers share a local index (GPU-NIC
affinity). The IP places chunks on switches; nodes of one switch are interchangeable, so a
chunk's node follows in allocation order.

Shape letters: C = chunks (used nodes), W = switches, K = multi-chunk groups.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from planner.inputs.allocation import Allocation, default_allocation
from planner.ip.solvers import LinearModel, SolveReport, SolverOptions, solve
from planner.parallel import ParallelConfig
from planner.plan.schema import RankPlan
from planner.specs import ClusterSpec, SpecError

log = logging.getLogger(__name__)

# Relative traffic of the group kinds: tensor-parallel collectives (attention and expert TP)
# every layer, the context-parallel K/V ring every attention layer, the all-to-alls every
# MoE layer, one activation per micro-batch between pipeline neighbours.
KIND_WEIGHT = {"tp": 4, "etp": 4, "cp": 3, "ep": 2, "pp": 1}
LEVEL_WEIGHT = {"switch": 1, "group": 3}  # crossing a dragonfly group costs more
# Pipeline neighbours are kept inside a dragonfly group, but not pushed onto one switch (that
# would split the other groups).
COUNTED = {(k, lv) for k in KIND_WEIGHT for lv in LEVEL_WEIGHT} - {("pp", "switch")}
GROUP_KINDS = ("tp", "cp", "etp", "ep")  # the groups counted as straddling
MAX_IP_CELLS = 40_000  # chunk x switch variables above which the greedy answer is kept


@dataclass(frozen=True)
class RankSolution:
    """One RankPlan per logical rank, and how many groups straddle a switch.

    straddling_groups: TP, CP, expert-TP and EP groups whose nodes hang off more than one
        switch.
    groups_total: those groups of size > 1.
    straddling_by_level: (kind, level, count) for kind in tp/cp/etp/ep/pp, level
        node/switch/group.
    hostnames: node index -> hostname of the allocation used.
    """

    ranks: tuple[RankPlan, ...]
    straddling_groups: int
    groups_total: int
    straddling_by_level: tuple[tuple[str, str, int], ...]
    hostnames: tuple[str, ...]
    report: SolveReport
    note: str = ""


@dataclass(frozen=True)
class _Group:
    kind: str  # "tp" | "cp" | "etp" | "ep" | "pp"
    chunks: tuple[int, ...]  # distinct chunks, ascending


def logical_rank(par: ParallelConfig, r: int) -> tuple[int, int, int, int, int]:
    """(stage, dp_idx, cp_idx, tp_idx, ep_idx) of global rank r (Megatron-Core's order)."""
    stage, j = divmod(r, par.tp * par.cp * par.dp)
    dp_idx, rest = divmod(j, par.cp * par.tp)
    cp_idx, tp_idx = divmod(rest, par.tp)
    return stage, dp_idx, cp_idx, tp_idx, (j // par.etp) % par.ep


def group_ranks(par: ParallelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every TP, CP, expert-TP and EP group (kind, ranks) of size > 1: the ranks that share
    every index but the group's own, in rank order."""
    out = []
    for kind, size in (("tp", par.tp), ("cp", par.cp), ("etp", par.etp), ("ep", par.ep)):
        if size == 1:
            continue
        members: dict[tuple[int, ...], list[int]] = {}
        for r in range(par.world):
            members.setdefault(_group_key(par, kind, r), []).append(r)
        out += [(kind, tuple(ranks)) for ranks in members.values()]
    return out


def _group_key(par: ParallelConfig, kind: str, r: int) -> tuple[int, ...]:
    stage, j = divmod(r, par.tp * par.cp * par.dp)
    if kind in ("tp", "etp"):  # consecutive ranks
        size = par.tp if kind == "tp" else par.etp
        return (stage, j // size)
    if kind == "cp":  # same dp and tp index
        dp_idx, rest = divmod(j, par.cp * par.tp)
        return (stage, dp_idx, rest % par.tp)
    return (stage, j % par.etp, j // (par.etp * par.ep))  # ep: same etp and edp index


def solve_ranks(
    parallel: ParallelConfig,
    cluster: ClusterSpec,
    allocation: Allocation | None,
    options: SolverOptions,
) -> RankSolution:
    """Place logical ranks on nodes so TP, CP, expert-TP and EP groups and pipeline
    neighbours cross as few slow (switch, then group) boundaries as possible.

    Args:
        parallel: the layout (pp, dp, tp, cp, ep, etp).
        cluster: node size (gpus_per_node) and, without an allocation, the topology.
        allocation: the job's nodes with switch/group ids; None = first nodes of the cluster.
        options: backend, time limit (s), threads, seed.
    Returns:
        RankSolution (a time limit returns the best placement with its gap).
    """
    g = cluster.gpus_per_node
    num_chunks = math.ceil(parallel.world / g)
    alloc = allocation if allocation is not None else default_allocation(cluster, num_chunks)
    if num_chunks > len(alloc):
        raise SpecError(
            f"{alloc.source or 'allocation'}: {len(alloc)} nodes but the layout needs "
            f"{num_chunks} ({parallel.world} ranks / {g} per node); allocate more nodes"
        )
    switches = _switches(alloc)
    groups = _groups(parallel, g)
    greedy = _greedy(groups, num_chunks, switches, parallel, g)
    lower = _lower_bound(groups, switches)
    greedy_cost = _cost(groups, greedy, switches)
    if greedy_cost == lower or num_chunks * len(switches) > MAX_IP_CELLS:
        status = "OPTIMAL" if greedy_cost == lower else "FEASIBLE"
        gap = 0.0 if status == "OPTIMAL" else (greedy_cost - lower) / greedy_cost
        report = SolveReport(
            options.backend,
            status,
            float(greedy_cost),
            float(lower),
            gap,
            0.0,
            "greedy placement meets the lower bound"
            if gap == 0
            else "too large for the rank IP: greedy placement kept",
        )
        return _result(parallel, g, alloc, switches, groups, greedy, report)
    model, decode = _build_model(groups, num_chunks, switches, greedy)
    sol = solve(model, options)
    chunk_switch = decode(sol.values) if sol.report.has_solution else greedy
    cost = _cost(groups, chunk_switch, switches)
    report = sol.report
    if greedy_cost < cost:  # the solver dropped the hint: keep the better greedy placement
        chunk_switch, cost = greedy, greedy_cost
        report = replace(
            report, status="FEASIBLE", objective=float(cost), gap=(cost - report.bound) / cost
        )
    if not report.has_solution:
        report = replace(
            report,
            status="FEASIBLE",
            objective=cost,
            bound=lower,
            gap=(cost - lower) / cost if cost else 0.0,
        )
    return _result(parallel, g, alloc, switches, groups, chunk_switch, report)


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class _Switch:
    key: tuple[str, str]  # (group, switch)
    nodes: tuple[int, ...]  # allocation indices, in allocation order

    @property
    def group(self) -> str:
        return self.key[0]

    @property
    def capacity(self) -> int:
        return len(self.nodes)


def _switches(alloc: Allocation) -> list[_Switch]:
    """Switches in order of first appearance in the allocation."""
    by_key: dict[tuple[str, str], list[int]] = {}
    for i, n in enumerate(alloc.nodes):
        by_key.setdefault((n.group, n.switch), []).append(i)
    return [_Switch(k, tuple(v)) for k, v in by_key.items()]


def _groups(par: ParallelConfig, g: int) -> list[_Group]:
    """TP, CP, expert-TP and EP groups and pipeline-neighbour pairs, as sets of chunks."""
    out = [_Group(kind, tuple(sorted({r // g for r in ranks}))) for kind, ranks in group_ranks(par)]
    block = par.dp * par.tp * par.cp
    pairs = {
        (r // g, (r + block) // g) for r in range(par.world - block)
    }  # rank r and its next-stage peer
    out += [_Group("pp", tuple(sorted(set(p)))) for p in sorted(pairs)]
    return out


# ----------------------------------------------------------------------------- model


def _build_model(groups: list[_Group], num_chunks: int, switches: list[_Switch], hint):
    """Data -> Variables -> Constraints -> Objective; returns (model, decode)."""
    model = LinearModel("rank_ip")
    group_ids = sorted({s.group for s in switches})
    multi = [k for k in groups if len(k.chunks) > 1]

    # Variables: chunk c on switch w; group k straddles switches / dragonfly groups.
    y = [
        [model.bool_var(f"chunk{c}_on_switch{w}") for w in range(len(switches))]
        for c in range(num_chunks)
    ]
    s_sw = [model.bool_var(f"group{i}_straddles_switch") for i in range(len(multi))]
    sw_counted = [(k.kind, "switch") in COUNTED for k in multi]
    s_gr = [model.bool_var(f"group{i}_straddles_group") for i in range(len(multi))]

    # C12: every chunk (used node) sits on exactly one switch.
    for c in range(num_chunks):
        model.add([(1, y[c][w]) for w in range(len(switches))], "==", 1, f"C12_c{c}")
    # C13: a switch hosts at most as many chunks as it has allocated nodes.
    for w, sw in enumerate(switches):
        model.add([(1, y[c][w]) for c in range(num_chunks)], "<=", sw.capacity, f"C13_w{w}")
    # C14: a group straddles switches if one of its chunks is on a switch its first chunk isn't.
    for i, k in enumerate(multi):
        c0 = k.chunks[0]
        for c in k.chunks[1:] if sw_counted[i] else ():
            for w in range(len(switches)):
                model.add([(1, s_sw[i]), (-1, y[c][w]), (1, y[c0][w])], ">=", 0)
    # C15: likewise for dragonfly groups (a chunk's group = the group of its switch).
    for i, k in enumerate(multi):
        c0 = k.chunks[0]
        for c in k.chunks[1:]:
            for gid in group_ids:
                ws = [w for w, sw in enumerate(switches) if sw.group == gid]
                model.add(
                    [(1, s_gr[i])] + [(-1, y[c][w]) for w in ws] + [(1, y[c0][w]) for w in ws],
                    ">=",
                    0,
                )

    # Objective: weighted straddles (TP > EP > pipeline pairs; group crossings > switch).
    model.minimize(
        [
            (KIND_WEIGHT[k.kind] * LEVEL_WEIGHT["switch"] * sw_counted[i], s_sw[i])
            for i, k in enumerate(multi)
        ]
        + [(KIND_WEIGHT[k.kind] * LEVEL_WEIGHT["group"], s_gr[i]) for i, k in enumerate(multi)]
    )
    for c in range(num_chunks):
        for w in range(len(switches)):
            model.hint(y[c][w], int(hint[c] == w))
    for i, k in enumerate(multi):
        model.hint(s_sw[i], int(sw_counted[i] and len({hint[c] for c in k.chunks}) > 1))
        model.hint(s_gr[i], int(len({switches[hint[c]].group for c in k.chunks}) > 1))

    def decode(values) -> list[int]:
        return [next(w for w in range(len(switches)) if values[y[c][w]]) for c in range(num_chunks)]

    return model, decode


def _cost(groups: list[_Group], chunk_switch: list[int], switches: list[_Switch]) -> int:
    """The IP's objective for a placement (chunk -> switch index)."""
    cost = 0
    for k in groups:
        sws = {chunk_switch[c] for c in k.chunks}
        cost += (
            KIND_WEIGHT[k.kind]
            * LEVEL_WEIGHT["switch"]
            * ((k.kind, "switch") in COUNTED and len(sws) > 1)
        )
        cost += (
            KIND_WEIGHT[k.kind]
            * LEVEL_WEIGHT["group"]
            * (len({switches[w].group for w in sws}) > 1)
        )
    return cost


def _lower_bound(groups: list[_Group], switches: list[_Switch]) -> int:
    """Groups with more chunks than the largest switch (group) must straddle it."""
    max_sw = max(s.capacity for s in switches)
    cap_gr: dict[str, int] = {}
    for s in switches:
        cap_gr[s.group] = cap_gr.get(s.group, 0) + s.capacity
    max_gr = max(cap_gr.values())
    return sum(
        KIND_WEIGHT[k.kind]
        * (
            LEVEL_WEIGHT["switch"] * (len(k.chunks) > max_sw)
            + LEVEL_WEIGHT["group"] * (len(k.chunks) > max_gr)
        )
        for k in groups
    )


def _greedy(groups: list[_Group], num_chunks: int, switches: list[_Switch], par, g) -> list[int]:
    """Blocks of consecutive chunks (one group span each), taken column by column (block j
    of stage 0, 1, ... in a row, so pipeline neighbours follow each other), go onto the
    previous block's switch, else best-fit in its dragonfly group; a column starts on the
    best-fitting switch that holds it whole, if any. A block that fits nowhere whole fills
    the fullest switches."""
    span = max([len(k.chunks) for k in groups if k.kind != "pp"] + [1])
    free = [s.capacity for s in switches]
    out = [-1] * num_chunks
    last_group, last_w = switches[0].group, -1
    for column in _block_columns(num_chunks, span, par, g):
        need = sum(len(b) for b in column)
        whole = [w for w in range(len(switches)) if free[w] >= need]
        if whole:
            last_w = min(whole, key=lambda w: (switches[w].group != last_group, free[w], w))
        for block in column:
            targets = _place_block(len(block), free, switches, last_w, last_group)
            for c, w in zip(block, targets, strict=True):
                out[c] = w
            last_w = targets[-1]
            last_group = switches[last_w].group
    return out


def _place_block(size: int, free: list[int], switches, last_w: int, last_group: str):
    """Switch per chunk of one block (updates `free`)."""
    fits = [w for w in range(len(switches)) if free[w] >= size]
    if fits:
        w = min(fits, key=lambda w: (w != last_w, switches[w].group != last_group, free[w], w))
        free[w] -= size
        return [w] * size
    targets = []
    for _ in range(size):
        w = min(
            (w for w in range(len(switches)) if free[w] > 0),
            key=lambda w: (switches[w].group != last_group, -free[w], w),
        )
        targets.append(w)
        free[w] -= 1
    return targets


def _block_columns(num_chunks: int, span: int, par, g: int) -> list[list[list[int]]]:
    """Chunk blocks grouped in columns (block j of every stage) when stages split evenly
    into blocks; otherwise one column of consecutive blocks."""
    block = par.dp * par.tp * par.cp
    per_stage = block // g if block % g == 0 else 0
    if not per_stage or per_stage % span:
        return [[list(range(c, min(c + span, num_chunks))) for c in range(0, num_chunks, span)]]
    return [
        [list(range(s * per_stage + j, s * per_stage + j + span)) for s in range(par.pp)]
        for j in range(0, per_stage, span)
    ]


# ----------------------------------------------------------------------------- decode


def _result(par, g, alloc, switches, groups, chunk_switch, report) -> RankSolution:
    node_of_chunk = [0] * len(chunk_switch)
    for w, sw in enumerate(switches):
        mine = [c for c, ww in enumerate(chunk_switch) if ww == w]
        for c, node in zip(mine, sw.nodes, strict=False):
            node_of_chunk[c] = node
    ranks = []
    for r in range(par.world):
        stage, dp_idx, cp_idx, tp_idx, ep_idx = logical_rank(par, r)
        node = node_of_chunk[r // g]
        ranks.append(RankPlan(r, node, r % g, stage, dp_idx, tp_idx, ep_idx, cp_idx))
    by_level = _straddles(groups, chunk_switch, switches)
    straddling = sum(n for kind, level, n in by_level if kind != "pp" and level == "switch")
    total = sum(1 for k in groups if k.kind != "pp")
    note = ""
    if straddling:
        note = (
            f"{straddling} of {total} TP/CP/EP groups straddle switches on "
            f"{len(alloc)} nodes over {alloc.num_switches} switches"
        )
    return RankSolution(
        tuple(ranks),
        straddling,
        total,
        by_level,
        tuple(n.hostname for n in alloc.nodes),
        report,
        note,
    )


def _straddles(groups, chunk_switch, switches) -> tuple[tuple[str, str, int], ...]:
    rows = []
    for kind in (*GROUP_KINDS, "pp"):
        mine = [k for k in groups if k.kind == kind]
        rows.append((kind, "node", sum(len(k.chunks) > 1 for k in mine)))
        rows.append(
            (kind, "switch", sum(len({chunk_switch[c] for c in k.chunks}) > 1 for k in mine))
        )
        rows.append(
            (
                kind,
                "group",
                sum(len({switches[chunk_switch[c]].group for c in k.chunks}) > 1 for k in mine),
            )
        )
    return tuple(rows)
