"""Dispatch building blocks: group topology, pair ordering, block regrouping, byte counters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from runtime.dispatch.base import (
    BlockTranspose,
    DispatchStats,
    default_ranks_per_node,
    sort_pairs,
)
from runtime.dispatch.flat import FlatAllToAll
from runtime.dispatch.halo import Halo
from runtime.dispatch.topology import group_topology

# ---- topology -----------------------------------------------------------------------------


def test_topology_of_node_aligned_group():
    topo = group_topology([0, 1, 2, 3, 4, 5, 6, 7], ranks_per_node=4)
    assert topo.node_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert topo.local_of == (0, 1, 2, 3, 0, 1, 2, 3)
    assert topo.node_aligned and topo.num_nodes == 2
    # Rail pairing: (n, j) sends to (n', j).
    assert [topo.gateway(src, 1) for src in range(4)] == [4, 5, 6, 7]
    assert [topo.gateway(src, 0) for src in range(4, 8)] == [0, 1, 2, 3]


def test_topology_of_unaligned_subgroup():
    # 3 ranks per node: global 2 on node 0; 3 and 5 on node 1; 9 on node 3.
    topo = group_topology([3, 9, 5, 2], ranks_per_node=3)
    assert topo.node_of == (1, 2, 1, 0)  # compact ids in order of physical node
    assert topo.members_of_node == ((3,), (0, 2), (1,))
    assert topo.local_of == (0, 0, 1, 0)
    assert not topo.node_aligned
    assert topo.gateway(2, 0) == 3  # local index 1 wraps onto the single member of node 0
    assert topo.gateway(3, 1) == 0 and topo.gateway(1, 1) == 0
    assert topo.same_node(0, 2) and not topo.same_node(0, 3)


def test_topology_rejects_bad_input():
    with pytest.raises(ValueError, match="ranks_per_node"):
        group_topology([0, 1], 0)
    with pytest.raises(ValueError, match="distinct"):
        group_topology([0, 0], 2)


def test_default_ranks_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_ranks_per_node() == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert default_ranks_per_node() is None


# ---- pair ordering and regrouping ---------------------------------------------------------


def test_sort_pairs_orders_by_destination_then_expert_then_token():
    expert_TK = torch.tensor([[3, 0], [1, 3], [0, 2]])
    rank_of_expert_E = torch.tensor([1, 0, 1, 0])  # experts 1, 3 on rank 0; 0, 2 on rank 1
    order_P, counts_E, counts_S = sort_pairs(expert_TK, rank_of_expert_E, 3)
    pairs = [(t, k) for t in range(3) for k in range(2)]
    key = {p: (int(rank_of_expert_E[expert_TK[p]]), int(expert_TK[p]), p) for p in pairs}
    expected = sorted(range(6), key=lambda i: key[pairs[i]])
    assert order_P.tolist() == expected
    assert counts_E.tolist() == [2, 1, 1, 2]
    assert counts_S.tolist() == [3, 3, 0]


@pytest.mark.parametrize("seed", range(5))
def test_block_transpose_matches_brute_force_both_ways(seed):
    gen = torch.Generator().manual_seed(seed)
    counts_SL = torch.randint(0, 4, (3, 4), generator=gen)
    # Rows carry labels (s, l, i) s-major; brute force builds the l-major order.
    labels = [
        (s, loc, i) for s in range(3) for loc in range(4) for i in range(int(counts_SL[s, loc]))
    ]
    expected = sorted(labels, key=lambda x: (x[1], x[0], x[2]))
    rows = torch.tensor(labels, dtype=torch.float64).reshape(-1, 3)
    regroup = BlockTranspose(counts_SL)
    by_expert = regroup.to_expert_major(rows)
    assert [tuple(int(v) for v in r) for r in by_expert.tolist()] == expected
    per_src = list(rows.split(counts_SL.sum(dim=1).tolist()))
    assert torch.equal(regroup.to_expert_major(per_src), by_expert)
    assert torch.equal(regroup.to_source_major(by_expert), rows)


def test_block_transpose_empty():
    for shape in ((2, 0), (0, 3)):
        regroup = BlockTranspose(torch.zeros(shape, dtype=torch.long))
        assert regroup.to_expert_major(torch.zeros(0, 5)).shape == (0, 5)
        assert regroup.to_source_major(torch.zeros(0, 5)).shape == (0, 5)


def test_stats_reset_and_classification():
    topo = group_topology([0, 1, 2, 3], 2)
    stats = DispatchStats()
    stats.add_bytes(topo, 0, 1, 10)
    stats.add_bytes(topo, 0, 2, 7)
    stats.add_bytes(topo, 0, 0, 99)  # a copy to itself is not sent
    assert (stats.bytes_intra_node, stats.bytes_inter_node) == (10, 7)
    stats.dispatch_s = 1.0
    stats.reset()
    assert stats == DispatchStats()


# ---- byte counters on a real exchange (hand-computed expectation) -------------------------

DIM = 5


def _byte_counts(rank: int, world_size: int) -> dict:
    """2 nodes x 2 ranks; every rank sends token t to expert (rank + t) % 4 and expert 3."""
    rank_of_expert_E = torch.tensor([0, 1, 2, 3])
    tokens = 4
    expert_TK = torch.tensor([[(rank + t) % 4, 3] for t in range(tokens)])
    x_TD = torch.randn(tokens, DIM, dtype=torch.float64, requires_grad=True)
    out = {}
    for name, disp in {
        "flat": FlatAllToAll(None, 2),
        "halo": Halo(None, 2, direct_below_bytes=0),
        "dedup": Halo(None, 2, dedup=True, direct_below_bytes=0),
        "small-direct": Halo(None, 2, dedup=True),  # default threshold: tiny messages go direct
    }.items():
        y_ND, _, handle = disp.dispatch(x_TD, expert_TK, rank_of_expert_E)
        after_dispatch = (disp.stats.bytes_intra_node, disp.stats.bytes_inter_node)
        disp.combine(y_ND, handle).sum().backward()
        out[name] = {
            "dispatch": after_dispatch,
            "total": (disp.stats.bytes_intra_node, disp.stats.bytes_inter_node),
            "times": (disp.stats.dispatch_s > 0, disp.stats.combine_s > 0),
        }
    with pytest.raises(ValueError, match="rank_of_expert_E"):
        FlatAllToAll(None, 2).dispatch(x_TD, expert_TK, torch.tensor([0, 1, 2, 4]))
    dist.barrier()
    return out


def _expected_rows(rank: int) -> tuple[dict, dict]:
    """Rows each rank sends to every peer, by hand from the routing of _byte_counts."""
    to_peer = {p: 0 for p in range(4)}
    tokens_to_node: dict[int, set] = {0: set(), 1: set()}
    for t in range(4):
        for expert in ((rank + t) % 4, 3):
            to_peer[expert] += 1
            tokens_to_node[expert // 2].add(t)
    return to_peer, {n: len(v) for n, v in tokens_to_node.items()}


@pytest.mark.slow
def test_byte_counters_match_hand_count(run_distributed):
    results = run_distributed(_byte_counts, 4, timeout_s=60)
    row = DIM * 8
    saved_rows = 0
    for rank, res in enumerate(results):
        to_peer, unique_to_node = _expected_rows(rank)
        node = rank // 2
        peer_same = rank ^ 1
        remote = [p for p in range(4) if p // 2 != node]
        intra_rows = to_peer[peer_same]
        inter_rows = sum(to_peer[p] for p in remote)
        received = {src: _expected_rows(src)[0][rank] for src in range(4)}
        intra_back, inter_back = received[peer_same], sum(received[p] for p in remote)
        # Flat: payload + 8 B per count of the destination's local experts (1 per rank).
        assert res["flat"]["dispatch"] == (row * intra_rows + 8, row * inter_rows + 8 * 2)
        # Dispatch and backward of combine send my rows; combine and backward of dispatch
        # send back the rows I received.
        assert res["flat"]["total"] == (
            2 * row * (intra_rows + intra_back) + 8,
            2 * row * (inter_rows + inter_back) + 16,
        )
        # HALO: all-gather of 4 expert counts to each of 3 peers (dedup: in the same round
        # 2 x 2 node counts: unique tokens, forwarded unique tokens); Phase I direct; Phase II
        # the same inter-node rows, then Phase III relays inside the node.
        meta, meta_dedup = 8 * 4, 8 * (4 + 2 * 2)
        rail_peer = (rank + 2) % 4  # the one remote source whose gateway I am
        relayed_by_me = _expected_rows(rail_peer)[0][peer_same]
        halo_intra = row * (intra_rows + relayed_by_me) + meta
        assert res["halo"]["dispatch"] == (halo_intra, row * inter_rows + 2 * meta)
        # Dedup: one row per (token, remote node) plus an int64 index per pair.
        other = 1 - node
        dedup_intra = halo_intra - meta + meta_dedup
        dedup_inter = row * unique_to_node[other] + 8 * inter_rows + 2 * meta_dedup
        assert res["dedup"]["dispatch"] == (dedup_intra, dedup_inter)
        saved_rows += inter_rows - unique_to_node[other]
        # Below the threshold every row goes straight to its rank: no relay, no dedup (the
        # unique-token counts still travel in the single metadata round).
        direct = (row * intra_rows + meta_dedup, row * inter_rows + 2 * meta_dedup)
        assert res["small-direct"]["dispatch"] == direct
        assert all(res[name]["times"] == (True, True) for name in res)
    assert saved_rows > 0  # the routing repeats some tokens per remote node
