"""HALO's cost model and path decision on hand-computed traffic matrices (no process group)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime.dispatch.halo_cost import (
    DEFAULT_DIRECT_BELOW_BYTES,
    HaloCost,
    HaloTraffic,
    halo_traffic,
    takes_direct_path,
)
from runtime.dispatch.topology import group_topology

ROW_BYTES = 1000


def _uniform(nodes: int, ranks_per_node: int, rows: int) -> HaloTraffic:
    """`rows` rows from every rank to every rank; to_node_SQ spelled out by loops."""
    topo = group_topology(list(range(nodes * ranks_per_node)), ranks_per_node)
    size = topo.size
    to_node = [
        [0 if topo.node_of[s] == q else rows * ranks_per_node for q in range(nodes)]
        for s in range(size)
    ]
    return HaloTraffic(topo, torch.full((size, size), rows), torch.tensor(to_node))


def test_traffic_from_counts_by_hand():
    topo = group_topology([0, 1, 2, 3], 2)  # nodes {0, 1} and {2, 3}
    rank_of_expert_E = torch.tensor([0, 1, 2, 3, 3])
    counts_SE = torch.tensor([[1, 2, 3, 4, 5], [0, 0, 0, 0, 1], [2, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    traffic = halo_traffic(topo, counts_SE, rank_of_expert_E, None)
    assert traffic.pairs_SS.tolist() == [[1, 2, 3, 9], [0, 0, 0, 1], [2, 0, 0, 2], [0, 0, 0, 0]]
    assert traffic.to_node_SQ.tolist() == [[0, 12], [0, 1], [2, 0], [0, 0]]
    assert traffic.largest_node_pair_rows == 12


def test_costs_on_four_nodes_of_two_by_hand():
    # 10 rows between every two of 8 ranks (4 nodes x 2): direct posts 7 messages, a node's
    # link carries 2 ranks x 3 nodes x 20 rows; three phases post 1 (I) + 3 (II) + 1 (III),
    # and each gateway relays 3 sources x 10 rows after Phase II.
    traffic = _uniform(4, 2, 10)
    cost = HaloCost(message_s=2e-5, intra_gbps=1.0, node_link_gbps=1.0)
    assert cost.direct_s(traffic, ROW_BYTES) == pytest.approx(7 * 2e-5 + 120e3 / 1e9)
    assert cost.three_phase_s(traffic, ROW_BYTES) == pytest.approx(
        5 * 2e-5 + 120e3 / 1e9 + 30e3 / 1e9
    )


def test_cost_decides_on_both_sides_of_the_crossover():
    # direct 7 m + 1.2e-4 s, three phases 5 m + 1.5e-4 s: they cross at m = 1.5e-5 s
    traffic = _uniform(4, 2, 10)

    def direct(message_s: float, traffic: HaloTraffic = traffic) -> bool:
        return takes_direct_path(traffic, ROW_BYTES, 1, HaloCost(message_s, 1.0, 1.0))

    assert not direct(2e-5)  # dear messages: the relay's two saved messages pay
    assert direct(1e-5)  # cheap messages: the relay's 3e-5 s of copies do not
    # dedup (12 unique rows of 20 per remote node) shrinks the link: 5 m + 1.02e-4 s wins
    assert not direct(1e-5, replace(traffic, unique_SQ=traffic.to_node_SQ * 12 // 20))


def test_structural_rule_without_a_cost():
    def direct(traffic: HaloTraffic, dedup: bool = False) -> bool:
        if dedup:
            traffic = replace(traffic, unique_SQ=traffic.to_node_SQ)
        return takes_direct_path(traffic, ROW_BYTES, 1, None)

    # no dedup and at most two nodes: the same bytes cross, no message saved
    assert direct(_uniform(2, 4, 10))
    assert not direct(_uniform(2, 4, 10), dedup=True)
    # more than two nodes: (Q - 2)(g - 1) messages fewer per rank
    assert not direct(_uniform(4, 2, 10))
    # one rank per node: nothing to relay through
    assert direct(_uniform(8, 1, 10))


def test_threshold_rules():
    traffic = _uniform(4, 2, 10)  # largest node-pair message: 20 rows x 1000 B
    cost = HaloCost(message_s=1.0, intra_gbps=1.0, node_link_gbps=1.0)  # the relay pays
    assert takes_direct_path(traffic, ROW_BYTES, 20_001, cost)  # below the threshold
    assert not takes_direct_path(traffic, ROW_BYTES, 20_000, cost)
    assert takes_direct_path(traffic, ROW_BYTES, DEFAULT_DIRECT_BELOW_BYTES, None)
    # 0 = always three phases, even where they cannot pay
    assert not takes_direct_path(_uniform(8, 1, 10), ROW_BYTES, 0, None)
    assert not takes_direct_path(traffic, ROW_BYTES, 0, HaloCost(0.0, 1e-3, 1e3))


def test_halo_cost_estimates_by_hand():
    topo = group_topology([0, 1, 2, 3], 2)  # nodes {0, 1} and {2, 3}
    traffic = HaloTraffic(
        topo,
        pairs_SS=torch.full((4, 4), 10),  # 10 rows from every rank to every rank
        to_node_SQ=torch.tensor([[0, 20], [0, 20], [20, 0], [20, 0]]),  # rows to other nodes
    )
    unique_SQ = torch.tensor([[0, 12] if s < 2 else [12, 0] for s in range(4)])  # 20 -> 12
    cost = HaloCost(message_s=1e-3, intra_gbps=1.0, node_link_gbps=0.1)
    # direct: 3 messages; 10 rows to my node peer; a node sends 2 x 20 rows across = 40 kB
    assert cost.direct_s(traffic, 1000) == pytest.approx(3e-3 + 40e3 / 1e8)
    # three phases: Phase I 1 + Phase II 1 + Phase III 1 message; relay 10 rows after II
    assert cost.three_phase_s(traffic, 1000) == pytest.approx(3e-3 + 40e3 / 1e8 + 10e3 / 1e9)
    traffic = replace(traffic, unique_SQ=unique_SQ)  # dedup: the link carries 24 kB
    assert cost.three_phase_s(traffic, 1000) == pytest.approx(3e-3 + 24e3 / 1e8 + 10e3 / 1e9)


def _cost_by_loops(cost, topo, pairs, unique_SN, dedup, row_bytes):
    """Brute-force HaloCost: (direct_s, three_phase_s) rank by rank, node by node."""
    size, nodes = len(pairs), topo.num_nodes

    def to_node(s, b):
        return sum(pairs[s][r] for r in topo.members_of_node[b])

    def link(unique):
        worst = 0
        for n in range(nodes):
            out = sum(
                (unique_SN[s][b] if unique else to_node(s, b))
                for s in topo.members_of_node[n]
                for b in range(nodes)
                if b != n
            )
            inn = sum(
                (unique_SN[s][n] if unique else to_node(s, n))
                for s in range(size)
                if topo.node_of[s] != n
            )
            worst = max(worst, out, inn)
        return worst

    msgs = max(sum(1 for d in range(size) if d != s and pairs[s][d]) for s in range(size))
    intra = max(
        sum(pairs[s][d] for d in topo.members_of_node[topo.node_of[s]] if d != s)
        for s in range(size)
    )
    direct = msgs * cost.message_s + max(
        intra * row_bytes / (cost.intra_gbps * 1e9),
        link(False) * row_bytes / (cost.node_link_gbps * 1e9),
    )
    worst_msgs = worst_relay = 0
    for s in range(size):
        node = topo.node_of[s]
        members = [d for d in topo.members_of_node[node] if d != s]
        srcs = [r for r in range(size) if topo.node_of[r] != node and topo.gateway(r, node) == s]
        relay = [sum(pairs[r][d] for r in srcs) for d in members]
        remote = [b for b in range(nodes) if b != node and to_node(s, b)]
        phase_i = sum(1 for d in members if pairs[s][d])
        worst_msgs = max(worst_msgs, phase_i + len(remote) + sum(1 for r in relay if r))
        worst_relay = max(worst_relay, sum(relay))
    three = worst_msgs * cost.message_s + max(
        intra * row_bytes / (cost.intra_gbps * 1e9),
        link(dedup) * row_bytes / (cost.node_link_gbps * 1e9)
        + worst_relay * row_bytes / (cost.intra_gbps * 1e9),
    )
    return direct, three


@pytest.mark.parametrize("seed", range(6))
def test_halo_cost_matches_loops_on_random_traffic(seed):
    gen = torch.Generator().manual_seed(seed)
    members, rpn = [(list(range(8)), 2), (list(range(8)), 3), ([0, 1, 2, 5, 6, 7], 4)][seed % 3]
    topo = group_topology(members, rpn)
    size = len(members)
    pairs_SS = torch.randint(0, 40, (size, size), generator=gen)
    pairs_SS[torch.rand(size, size, generator=gen) < 0.2] = 0  # some empty messages
    node_S = torch.tensor(topo.node_of)
    to_node_SQ = torch.zeros(size, topo.num_nodes, dtype=torch.long).index_add_(1, node_S, pairs_SS)
    to_node_SQ[torch.arange(size), node_S] = 0
    unique_SQ = to_node_SQ * 2 // 3  # dedup: fewer rows per (source, node)
    unique_SN = unique_SQ.tolist()
    cost = HaloCost(message_s=2e-4, intra_gbps=0.5, node_link_gbps=0.1)
    for dedup in (False, True):
        plan = HaloTraffic(topo, pairs_SS, to_node_SQ, unique_SQ if dedup else None)
        want = _cost_by_loops(cost, topo, pairs_SS.tolist(), unique_SN, dedup, 1024)
        assert cost.direct_s(plan, 1024) == pytest.approx(want[0])
        assert cost.three_phase_s(plan, 1024) == pytest.approx(want[1])
