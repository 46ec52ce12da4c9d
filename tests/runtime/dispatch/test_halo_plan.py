"""HALO's preparation on one process: every rank's plan_halo against brute-force counts.

The counts round is a function argument, so the test plays every rank of a 2 x 2 and a
4 x 2 group: one pass collects what each rank contributes, the second hands back the table.
"""

from __future__ import annotations

import pytest
import torch

from runtime.dispatch.halo_plan import HaloOptions, HaloPlan, plan_halo
from runtime.dispatch.topology import GroupTopology, group_topology

ROW_BYTES = 8


def _routing(topo: GroupTopology, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_experts = 2 * topo.size
    rank_of_expert_E = torch.randperm(num_experts, generator=gen) % topo.size
    experts = [
        torch.rand(3 + 2 * s, num_experts, generator=gen).topk(3, dim=1).indices
        for s in range(topo.size)
    ]
    return experts, rank_of_expert_E


def _plans(topo: GroupTopology, seed: int, options: HaloOptions) -> list[HaloPlan]:
    experts, rank_of_expert_E = _routing(topo, seed)
    sent: dict[int, torch.Tensor] = {}

    def plan(me: int, table: torch.Tensor | None) -> HaloPlan:
        def gather(mine: torch.Tensor) -> torch.Tensor:
            sent[me] = mine
            return (
                torch.zeros(topo.size, mine.numel(), dtype=torch.long) if table is None else table
            )

        cpu = torch.device("cpu")
        return plan_halo(experts[me], rank_of_expert_E, topo, me, gather, options, ROW_BYTES, cpu)

    for me in range(topo.size):
        plan(me, None)
    table = torch.stack([sent[me] for me in range(topo.size)])
    return [plan(me, table) for me in range(topo.size)]


def _brute_force(topo: GroupTopology, seed: int):
    """pairs[s][d]; unique[s][q] tokens s sends to node q; forwarded[s][q] of them needed by
    a rank of q other than s's gateway there."""
    experts, rank_of_expert_E = _routing(topo, seed)
    size, nodes = topo.size, topo.num_nodes
    pairs = [[0] * size for _ in range(size)]
    unique = [[0] * nodes for _ in range(size)]
    forwarded = [[0] * nodes for _ in range(size)]
    for s in range(size):
        for q in range(nodes):
            if q == topo.node_of[s]:
                continue
            dests = [[int(rank_of_expert_E[e]) for e in row] for row in experts[s].tolist()]
            unique[s][q] = sum(any(topo.node_of[d] == q for d in row) for row in dests)
            gw = topo.gateway(s, q)
            forwarded[s][q] = sum(
                any(topo.node_of[d] == q and d != gw for d in row) for row in dests
            )
        for e in experts[s].reshape(-1).tolist():
            pairs[s][int(rank_of_expert_E[e])] += 1
    return pairs, unique, forwarded


def _srcs_via(topo: GroupTopology, me: int) -> dict[int, list[int]]:
    """Per rank g of my node: the remote sources whose gateway on my node is g."""
    node = topo.node_of[me]
    return {
        gw: [s for s in range(topo.size) if topo.node_of[s] != node and topo.gateway(s, node) == gw]
        for gw in topo.members_of_node[node]
    }


@pytest.mark.parametrize(("members", "rpn", "seed"), [(4, 2, 0), (8, 2, 1), (8, 3, 2)])
def test_plans_agree_with_brute_force(members, rpn, seed):
    topo = group_topology(list(range(members)), rpn)
    pairs, unique, forwarded = _brute_force(topo, seed)
    for dedup in (False, True):
        plans = _plans(topo, seed, HaloOptions(dedup=dedup, direct_below_bytes=0))
        for me, plan in enumerate(plans):
            assert [list(row) for row in plan.pairs_SS] == pairs
            assert not plan.direct and plan.dedup == dedup
            node = topo.node_of[me]
            assert plan.node_peers == tuple(r for r in topo.members_of_node[node] if r != me)
            assert plan.remote_nodes == tuple(q for q in range(topo.num_nodes) if q != node)
            assert {gw: list(srcs) for gw, srcs in plan.srcs_via.items()} == _srcs_via(topo, me)
            assert sum(plan.tokens_per_local_expert_L.tolist()) == sum(p[me] for p in pairs)
            for q in plan.remote_nodes:
                rows = plan.rows_to_node[q]
                dest_of = [r for r, (a, b) in enumerate(plan.seg_of_dest) for _ in range(a, b)]
                dest = [dest_of[int(p)] for p in rows]
                order = plan.member_order(me, q)
                assert dest == sorted(dest, key=order.index)  # member order, gateway last
                if not dedup:
                    continue
                assert plan.unique_SQ[me][q] == unique[me][q]
                assert plan.forwarded_unique_SQ[me][q] == forwarded[me][q]
                tokens = plan.unique_tokens[q]
                assert torch.equal(tokens[plan.pack_index[q]], plan.token_sorted_P[rows])
                assert tokens.numel() == len(set(tokens.tolist())) == unique[me][q]


def test_the_path_is_the_same_on_every_rank():
    topo = group_topology(list(range(8)), 2)
    for options, direct in [
        (HaloOptions(direct_below_bytes=1 << 20), True),  # tiny rows: below the threshold
        (HaloOptions(direct_below_bytes=1), False),  # 4 nodes of 2: the relay pays
        (HaloOptions(dedup=True, direct_below_bytes=0), False),
    ]:
        plans = _plans(topo, 3, options)
        assert [p.direct for p in plans] == [direct] * 8
        assert all(p.dedup == (options.dedup and not direct) for p in plans)
        if direct:
            assert all(p.node_peers == tuple(r for r in range(8) if r != p.me) for p in plans)
            assert all(p.remote_nodes == () and p.rows_to_node == () for p in plans)
