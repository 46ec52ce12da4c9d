"""The groups of ranks that communicate, as arrays, and a greedy rank order for large jobs.

Shape letters: K = groups of one kind, M = members of a group, N = allocation nodes.

`rank_group_arrays(par)` gives every group kind as a K x M array of ranks, with the names
the resource model gives its traffic (`comm_s` prefixes). The groups are those of
planner.ip.rank_ip.group_ranks (Megatron-Core's rank order, FORMULATION.md section 3: with
B = tp*cp*dp ranks per stage, j = dp_idx*(cp*tp) + cp_idx*tp + tp_idx and
j = edp_idx*(etp*ep) + ep_idx*etp + etp_idx), plus the data-parallel groups of dense and expert
parameters and pipeline-neighbour pairs, built by reshaping so that 65,536 ranks take
milliseconds (a test checks them against group_ranks).

`tiers_K(groups_KM, node_of_rank, switch_N, group_N)` says per group how far it reaches:
-1 one node, 0 one switch, 1 one group of switches, 2 several groups.

`greedy_by_switch(...)` is the warm start used when the rank IP's model would be too large to
build at job start: nodes are ordered so that whole spans of the largest group (EP, TP, ...)
fill switches, the leftovers of a group stay next to each other, and the pieces that fit
nowhere whole come last; chunk c (ranks c*g .. c*g+g-1) goes to the c-th node of that order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.inputs.allocation import Allocation
from planner.ip.rank_ip import logical_rank
from planner.parallel import ParallelConfig
from planner.plan.schema import RankPlan

GroupArrays = list[tuple[tuple[str, ...], np.ndarray]]


def rank_group_arrays(par: ParallelConfig) -> GroupArrays:
    """(comm_s prefixes, K x M ranks) for every group kind with more than one member."""
    pp, dp, tp, cp, ep, etp = par.pp, par.dp, par.tp, par.cp, par.ep, par.etp
    block = tp * cp * dp
    edp = block // (etp * ep)
    r = np.arange(par.world, dtype=np.int64)
    kinds: GroupArrays = [
        (("tp",), r.reshape(-1, tp)),
        (("cp",), r.reshape(pp, dp, cp, tp).transpose(0, 1, 3, 2).reshape(-1, cp)),
        (("etp",), r.reshape(-1, etp)),
        (("a2a",), r.reshape(pp, edp, ep, etp).transpose(0, 1, 3, 2).reshape(-1, ep)),
        (("dp", "fsdp"), r.reshape(pp, dp, cp * tp).transpose(0, 2, 1).reshape(-1, dp)),
        (("edp",), r.reshape(pp, edp, etp * ep).transpose(0, 2, 1).reshape(-1, edp)),
        (("p2p",), np.stack([r[: par.world - block], r[block:]], axis=1)),
    ]
    return [(names, ranks) for names, ranks in kinds if ranks.shape[1] > 1 and ranks.size]


def tiers_K(
    groups_KM: np.ndarray, node_of_rank: np.ndarray, switch_N: np.ndarray, group_N: np.ndarray
) -> np.ndarray:
    """Per group: -1 on one node, 0 on one switch, 1 in one group, 2 across groups."""
    nodes = node_of_rank[groups_KM]

    def same(a: np.ndarray) -> np.ndarray:
        return a.min(axis=1) == a.max(axis=1)

    return np.select(
        [same(nodes), same(switch_N[nodes]), same(group_N[nodes])], [-1, 0, 1], default=2
    )


def position_ids(alloc: Allocation) -> tuple[np.ndarray, np.ndarray]:
    """(switch id, group id) per allocation node as integers; a switch is (group, switch)."""
    switches: dict[tuple[str, str], int] = {}
    groups: dict[str, int] = {}
    sw = [switches.setdefault((n.group, n.switch), len(switches)) for n in alloc.nodes]
    gr = [groups.setdefault(n.group, len(groups)) for n in alloc.nodes]
    return np.asarray(sw, dtype=np.int64), np.asarray(gr, dtype=np.int64)


def span_nodes(groups: GroupArrays, gpus_per_node: int) -> int:
    """The most nodes one TP, CP, expert-TP or EP group spans on consecutive nodes."""
    spans = [1]
    for names, ranks in groups:
        if names[0] in ("tp", "cp", "etp", "a2a"):
            chunks = ranks // gpus_per_node
            spans.append(int((chunks.max(axis=1) - chunks.min(axis=1)).max()) + 1)
    return max(spans)


def greedy_by_switch(
    par: ParallelConfig, alloc: Allocation, gpus_per_node: int, span: int
) -> tuple[RankPlan, ...]:
    """Ranks on the allocation by the node order in the module docstring."""
    by_group: dict[str, dict[str, list[int]]] = {}
    for i, n in enumerate(alloc.nodes):
        by_group.setdefault(n.group, {}).setdefault(n.switch, []).append(i)
    whole: list[int] = []
    pieces: list[int] = []
    groups = sorted(by_group.values(), key=lambda sws: -sum(map(len, sws.values())))
    for switches in groups:
        rest: list[int] = []
        for nodes in sorted(switches.values(), key=len, reverse=True):
            cut = len(nodes) - len(nodes) % span
            whole += nodes[:cut]
            rest += nodes[cut:]
        cut = len(rest) - len(rest) % span  # leftovers that still make whole spans in-group
        whole += rest[:cut]
        pieces += rest[cut:]
    order = whole + pieces
    out = []
    for r in range(par.world):
        stage, dp_idx, cp_idx, tp_idx, ep_idx = logical_rank(par, r)
        out.append(RankPlan(r, order[r // gpus_per_node], r % gpus_per_node, stage, dp_idx,
                            tp_idx, ep_idx, cp_idx))  # fmt: skip
    return tuple(out)


def node_array(ranks: Sequence[RankPlan]) -> np.ndarray:
    """Allocation node per rank, in rank order."""
    return np.asarray([r.node for r in sorted(ranks, key=lambda r: r.rank)], dtype=np.int64)
