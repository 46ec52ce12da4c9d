"""FlatAllToAll: the reference dispatcher, one flat all_to_all_single over the EP group.

Preparation: each rank orders its pairs by destination and tells every rank, in one counts
round, how many rows it sends per local expert of that rank. Communication: one
all_to_all_single with uneven splits; the received (source, expert) blocks are regrouped by
expert.

Shape letters as in runtime/dispatch/base.py (T, K, D, E, L, N, P = T * K, S ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch.base import BlockTranspose, EPGroup, Exchange, put_rows, sort_pairs, take_rows
from runtime.dispatch.dispatcher import ExchangeDispatcher


class _FlatExchange:
    """all_to_all_single with uneven splits; rows arrive (source, expert) and are regrouped."""

    reduces_weighted = False

    def __init__(self, ep: EPGroup, expert_TK: Tensor, rank_of_expert_E: Tensor, device) -> None:
        self.ep = ep
        self.num_tokens, self.topk = expert_TK.shape
        size, me = ep.size, ep.me
        self.order_P, counts_E, send_S = sort_pairs(expert_TK, rank_of_expert_E, size)
        # Metadata: every rank tells each destination how many rows it sends per local expert.
        expert_rank_order = torch.sort(rank_of_expert_E, stable=True).indices
        local_per_rank = torch.bincount(rank_of_expert_E, minlength=size)
        num_local = int(local_per_rank[me].item())
        counts_SL = ep.meta(torch.empty(size * num_local, dtype=torch.long))
        dist.all_to_all_single(
            counts_SL,
            ep.meta(counts_E[expert_rank_order].contiguous()),
            [num_local] * size,
            local_per_rank.tolist(),
            group=ep.group,
        )
        counts_SL = counts_SL.cpu().reshape(size, num_local)
        for peer in range(size):
            ep.count(peer, 8 * int(local_per_rank[peer].item()))
        self.send_splits = send_S.tolist()
        self.recv_splits = counts_SL.sum(dim=1).tolist()
        self.regroup = BlockTranspose(counts_SL)
        self.tokens_per_local_expert_L = counts_SL.sum(dim=0).to(device)
        self.order_P = self.order_P.to(device)

    def _exchange(self, send_ND: Tensor, send_splits, recv_splits) -> Tensor:
        recv_ND = send_ND.new_empty((sum(recv_splits), send_ND.shape[1]))
        dist.all_to_all_single(recv_ND, send_ND, recv_splits, send_splits, group=self.ep.group)
        row_bytes = send_ND.shape[1] * send_ND.element_size()
        for peer, rows in enumerate(send_splits):
            self.ep.count(peer, rows * row_bytes)
        return recv_ND

    def forward_tokens(self, x_TD: Tensor) -> Tensor:
        rows = take_rows(x_TD, self.order_P // self.topk)
        return self.regroup.to_expert_major(
            self._exchange(rows, self.send_splits, self.recv_splits)
        )

    def forward_pairs(self, x_PD: Tensor) -> Tensor:
        rows = take_rows(x_PD, self.order_P)
        return self.regroup.to_expert_major(
            self._exchange(rows, self.send_splits, self.recv_splits)
        )

    def reverse(self, y_ND: Tensor) -> Tensor:
        back = self.regroup.to_source_major(y_ND)
        sorted_PD = self._exchange(back, self.recv_splits, self.send_splits)
        y_PD = torch.empty_like(sorted_PD)
        put_rows(y_PD, self.order_P, sorted_PD)
        return y_PD


class FlatAllToAll(ExchangeDispatcher):
    """The reference dispatcher: one flat all_to_all_single over the EP group.

    Args:
      group: the EP process group (None = default group).
      ranks_per_node: node size, only to split the byte counters into intra/inter node
        (default: LOCAL_WORLD_SIZE, else the whole world is one node).
    """

    def _exchange(
        self, expert_TK: Tensor, rank_of_expert_E: Tensor, row_bytes: int, device: torch.device
    ) -> Exchange:
        return _FlatExchange(self.ep, expert_TK, rank_of_expert_E, device)
