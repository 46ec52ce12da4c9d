"""Which of the four exchanges HALO-dedup deduplicates, counted on a real gloo run.

The resource model prices HALO-dedup's dispatch, gate-weighted combine and the combine's
backward at one row per (token, remote node) and the dispatch's backward at one row per
(token, choice) (planner/resources/layer_comm.py `_a2a_s`). Here 2 nodes x 2 ranks route
top-4 of 16 experts and the inter-node bytes of each exchange are set beside plain HALO's:
each moves whole rows, one per unique (token, remote node) pair or one per (token, choice)
row that crosses nodes, plus metadata of at most 16 B per choice and the counts round.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from runtime.dispatch.halo import Halo

DIM, TOKENS, TOPK, EXPERTS, RPN = 256, 48, 4, 16, 2  # fp32 rows of 1 KiB; 2 nodes x 2 ranks


def _routing(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.rand(TOKENS, EXPERTS, generator=gen).topk(TOPK, dim=1).indices


def _crossing_rows(rank: int, rank_of_expert_E: torch.Tensor) -> tuple[int, int]:
    """(token, choice) rows of this rank bound for the other node, and distinct (token, node)
    pairs among them."""
    node_TK = rank_of_expert_E[_routing(rank)] // RPN
    remote_TK = node_TK != rank // RPN
    pairs = {(t, int(n)) for t, k in remote_TK.nonzero().tolist() for n in [node_TK[t, k]]}
    return int(remote_TK.sum()), len(pairs)


def _exchange_bytes(rank: int, world_size: int) -> dict[str, list[int]]:
    """Inter-node bytes this rank sends in dispatch, weighted combine and their backward."""
    rank_of_expert_E = torch.arange(EXPERTS) * world_size // EXPERTS
    out = {}
    for name, dedup in (("halo", False), ("dedup", True)):
        disp = Halo(None, RPN, dedup=dedup, direct_below_bytes=0)
        gen = torch.Generator().manual_seed(rank)
        x_TD = torch.randn(TOKENS, DIM, generator=gen).requires_grad_(True)
        gate_TK = torch.rand(TOKENS, TOPK, generator=gen).requires_grad_(True)
        marks = [0]
        y_ND, _, handle = disp.dispatch(x_TD, _routing(rank), rank_of_expert_E)
        marks.append(disp.stats.bytes_inter_node)
        y_TD = disp.combine(y_ND * 2.0, handle, gate_TK)
        marks.append(disp.stats.bytes_inter_node)
        y_TD.square().sum().backward()
        marks.append(disp.stats.bytes_inter_node)
        out[name] = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    dist.barrier()
    return out


@pytest.mark.slow
def test_dedup_sends_unique_rows_in_three_of_the_four_exchanges(run_distributed):
    results = run_distributed(_exchange_bytes, 4, timeout_s=60)
    rank_of_expert_E = torch.arange(EXPERTS) * 4 // EXPERTS
    rows = [_crossing_rows(r, rank_of_expert_E) for r in range(4)]
    choices, unique = sum(r[0] for r in rows), sum(r[1] for r in rows)
    assert unique < 0.9 * choices  # top-4 of 8 experts per node repeats tokens per node
    halo = [sum(res["halo"][i] for res in results) for i in range(3)]
    dedup = [sum(res["dedup"][i] for res in results) for i in range(3)]
    row = DIM * 4
    meta = 16 * choices + 2048  # int64 indices, fp32 gate scalars per choice; count rounds
    # plain HALO: the (token, choice) rows in every exchange (dispatch plus its counts round)
    assert 0 <= halo[0] - choices * row <= 2048
    assert (halo[1], halo[2]) == (choices * row, 2 * choices * row)
    # dispatch and the gate-weighted combine: one row per (token, remote node)
    assert 0 <= dedup[0] - unique * row <= meta
    assert 0 <= dedup[1] - unique * row <= meta
    # backward: the combine's gradient once per (token, node), the dispatch's per choice
    assert 0 <= dedup[2] - (unique + choices) * row <= meta
