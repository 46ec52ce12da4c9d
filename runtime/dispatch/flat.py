"""Token dispatch for expert parallelism: the TokenDispatcher protocol and the flat reference.

An MoE layer on one rank of an expert-parallel (EP) group routes each of its T tokens to K
experts. `dispatch` sends every (token, choice) row to the EP rank that holds its expert;
`combine` brings the expert outputs back in the original order. Both are differentiable: the
backward of dispatch is the reverse exchange of gradients (summed over the K copies of a
token), the backward of combine is the forward exchange.

Shape letters: T tokens on this rank, K routing choices per token (top-k), D hidden size,
E experts in the layer, L experts local to this rank, N rows received by this rank,
P = T * K (token, choice) pairs, S ranks of the EP group.

Implementations (same protocol, outputs equal bit for bit):
  FlatAllToAll: one all_to_all_single with uneven splits (the reference).
  Halo (runtime/dispatch/halo.py): hierarchical three-phase exchange, optionally deduplicated.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch.topology import GroupTopology, topology_of_group


@dataclass
class DispatchStats:
    """Cumulative communication counters of one dispatcher (reset() between steps).

    Attributes:
      bytes_intra_node: bytes this rank sent to EP peers on its own node (payload + int64
        metadata; forward and backward exchanges; copies to itself are not counted).
      bytes_inter_node: bytes this rank sent to EP peers on other nodes.
      dispatch_s: wall seconds in dispatch (forward) and in its backward.
      combine_s: wall seconds in combine (forward) and in its backward.
    """

    bytes_intra_node: int = 0
    bytes_inter_node: int = 0
    dispatch_s: float = 0.0
    combine_s: float = 0.0

    def reset(self) -> None:
        """Zeroes every counter."""
        self.bytes_intra_node = 0
        self.bytes_inter_node = 0
        self.dispatch_s = 0.0
        self.combine_s = 0.0

    def add_bytes(self, topo: GroupTopology, me: int, peer: int, num_bytes: int) -> None:
        """Counts `num_bytes` sent from group rank `me` to group rank `peer`."""
        if peer == me or num_bytes == 0:
            return
        if topo.same_node(me, peer):
            self.bytes_intra_node += num_bytes
        else:
            self.bytes_inter_node += num_bytes


class Exchange(Protocol):
    """One routing decision's data movement (built by `dispatch`, reused by `combine`)."""

    num_tokens: int
    topk: int
    tokens_per_local_expert_L: Tensor
    reduces_weighted: bool  # True: reverse_weighted / backward_weighted are implemented

    def forward_tokens(self, x_TD: Tensor) -> Tensor:
        """Sends token rows to the experts (a token may be replicated); returns rows [N, D]."""

    def forward_pairs(self, x_PD: Tensor) -> Tensor:
        """Sends one row per (token, choice) pair to the experts; returns rows [N, D]."""

    def reverse(self, y_ND: Tensor) -> Tensor:
        """Sends expert rows back to their sources; returns rows [P, D] in (token, choice) order."""


@dataclass(frozen=True)
class DispatchHandle:
    """What `combine` needs from `dispatch` (opaque to callers)."""

    exchange: Exchange


class TokenDispatcher(Protocol):
    """The contract between the MoE layer and the expert all-to-all."""

    stats: DispatchStats

    def dispatch(
        self, x_TD: Tensor, expert_TK: Tensor, rank_of_expert_E: Tensor
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        """Sends this rank's (token, choice) rows to the ranks holding their experts.

        Args:
          x_TD: this rank's tokens [T, D].
          expert_TK: top-k expert ids per token [T, K] (int).
          rank_of_expert_E: EP-group rank (0..S-1) of each expert [E]; identical on every rank
            of the group (the routing table; migration swaps it).

        Returns:
          expert_input_ND: rows for this rank's local experts (experts whose rank is mine,
            ascending expert id), grouped by local expert; within a group ordered by
            (source rank, token, choice).
          tokens_per_local_expert_L: rows per local expert [L] (int64).
          handle: for `combine`.
        """

    def combine(
        self, expert_output_ND: Tensor, handle: DispatchHandle, weight_TK: Tensor | None = None
    ) -> Tensor:
        """Returns y_TKD: the expert output for each (token, choice) of this rank, in order.

        The caller applies gate weights and sums over K. Optional extension: with `weight_TK`
        (gates [T, K]) it returns y_TD = sum_k weight_TK[:, k, None] * y_TKD[:, k] instead,
        differentiable in both arguments; HALO-dedup then sums on the remote node.
        """


def take_rows(src: Tensor, index: Tensor) -> Tensor:
    """src[index] along dim 0. index_select is several times faster than advanced indexing
    on CPU (one contiguous row copy per index), which matters when dispatch shares cores."""
    return src.index_select(0, index)


def put_rows(dst: Tensor, index: Tensor, rows: Tensor) -> None:
    """dst[index] = rows along dim 0 (index without repeats)."""
    dst.index_copy_(0, index, rows)


def default_ranks_per_node() -> int | None:
    """Node size from torchrun's LOCAL_WORLD_SIZE, or None when it is not set."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def sort_pairs(
    expert_TK: Tensor, rank_of_expert_E: Tensor, group_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Orders this rank's (token, choice) pairs by (destination rank, expert, token, choice).

    Returns:
      order_P: pair indices (t * K + k) in that order.
      counts_E: pairs routed to each expert.
      counts_S: pairs routed to each EP rank.
    """
    num_experts = rank_of_expert_E.numel()
    expert_P = expert_TK.reshape(-1).long()
    dest_P = rank_of_expert_E[expert_P]
    order_P = torch.sort(dest_P * num_experts + expert_P, stable=True).indices
    counts_E = torch.bincount(expert_P, minlength=num_experts)
    counts_S = torch.zeros(group_size, dtype=torch.long).index_add_(0, rank_of_expert_E, counts_E)
    return order_P, counts_E, counts_S


class BlockTranspose:
    """Reorders rows stored in (s, l) blocks, s-major, into (l, s) blocks and back.

    Received rows arrive by source rank s, each source's rows grouped by local expert l; the
    experts want them grouped by l, then s. Both directions are one torch.cat of S x L block
    views (memcpy of whole blocks), several times cheaper than a per-row index copy.

    Args:
      counts_SL: rows in block (s, l) [S, L].
    """

    def __init__(self, counts_SL: Tensor) -> None:
        self.num_src, self.num_local = counts_SL.shape
        self.counts_SL = counts_SL.tolist()
        self.sizes_sl = counts_SL.reshape(-1).tolist()
        self.sizes_ls = counts_SL.t().reshape(-1).tolist()
        self.rows = sum(self.sizes_sl)

    def to_expert_major(self, rows: Tensor | list[Tensor]) -> Tensor:
        """(s, l) blocks -> (l, s) blocks. rows: the s-major buffer, or one tensor per s."""
        if isinstance(rows, Tensor):
            like, blocks = rows, rows.split(self.sizes_sl)
        else:
            like = rows[0]
            blocks = [b for s, part in enumerate(rows) for b in part.split(self.counts_SL[s])]
        s_n, l_n = self.num_src, self.num_local
        order = [blocks[s * l_n + loc] for loc in range(l_n) for s in range(s_n)]
        return torch.cat(order) if order else like.new_empty((0, *like.shape[1:]))

    def to_source_major(self, rows_ND: Tensor) -> Tensor:
        """(l, s) blocks -> (s, l) blocks (the inverse of to_expert_major)."""
        blocks = rows_ND.split(self.sizes_ls)
        s_n, l_n = self.num_src, self.num_local
        order = [blocks[loc * s_n + s] for s in range(s_n) for loc in range(l_n)]
        return torch.cat(order) if order else rows_ND.new_empty((0, *rows_ND.shape[1:]))


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, exchange, stats):
        ctx.exchange, ctx.stats = exchange, stats
        start = time.perf_counter()
        out = exchange.forward_tokens(x_TD)
        stats.dispatch_s += time.perf_counter() - start
        return out

    @staticmethod
    def backward(ctx, grad_ND):
        start = time.perf_counter()
        ex = ctx.exchange
        grad_PD = ex.reverse(grad_ND.contiguous())
        grad_TD = grad_PD.reshape(ex.num_tokens, ex.topk, grad_PD.shape[1]).sum(dim=1)
        ctx.stats.dispatch_s += time.perf_counter() - start
        return grad_TD, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, exchange, stats):
        ctx.exchange, ctx.stats = exchange, stats
        start = time.perf_counter()
        y_PD = exchange.reverse(y_ND)
        stats.combine_s += time.perf_counter() - start
        return y_PD.reshape(exchange.num_tokens, exchange.topk, y_PD.shape[1])

    @staticmethod
    def backward(ctx, grad_TKD):
        start = time.perf_counter()
        ex = ctx.exchange
        grad_ND = ex.forward_pairs(
            grad_TKD.reshape(ex.num_tokens * ex.topk, grad_TKD.shape[2]).contiguous()
        )
        ctx.stats.combine_s += time.perf_counter() - start
        return grad_ND, None, None


class _WeightedCombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, weight_TK, exchange, stats):
        ctx.exchange, ctx.stats, ctx.weight_dtype = exchange, stats, weight_TK.dtype
        start = time.perf_counter()
        y_TD = exchange.reverse_weighted(y_ND, weight_TK)
        stats.combine_s += time.perf_counter() - start
        return y_TD

    @staticmethod
    def backward(ctx, grad_TD):
        start = time.perf_counter()
        grad_ND, grad_weight_TK = ctx.exchange.backward_weighted(grad_TD.contiguous())
        ctx.stats.combine_s += time.perf_counter() - start
        return grad_ND, grad_weight_TK.to(ctx.weight_dtype), None, None


class ExchangeDispatcher:
    """TokenDispatcher built from an Exchange factory (subclasses define `_exchange`)."""

    def __init__(self, group=None, ranks_per_node: int | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        rpn = ranks_per_node or default_ranks_per_node() or dist.get_world_size()
        self.topo = topology_of_group(group, rpn)
        self.stats = DispatchStats()
        # Collectives on NCCL groups need CUDA tensors; index planning stays on the CPU.
        on_nccl = dist.get_backend(group) == "nccl"
        self.meta_device = torch.device("cuda", torch.cuda.current_device()) if on_nccl else None

    def _exchange(
        self, expert_TK: Tensor, rank_of_expert_E: Tensor, row_bytes: int, device: torch.device
    ) -> Exchange:
        raise NotImplementedError

    def meta(self, tensor: Tensor) -> Tensor:
        """`tensor` on the device this group's collectives need."""
        return tensor if self.meta_device is None else tensor.to(self.meta_device)

    def dispatch(
        self, x_TD: Tensor, expert_TK: Tensor, rank_of_expert_E: Tensor
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        """See TokenDispatcher.dispatch."""
        if x_TD.dim() != 2 or expert_TK.dim() != 2 or expert_TK.shape[0] != x_TD.shape[0]:
            raise ValueError(
                f"dispatch: x_TD {tuple(x_TD.shape)} and expert_TK {tuple(expert_TK.shape)} "
                "must be [T, D] and [T, K]"
            )
        start = time.perf_counter()
        rank_of_expert_E = rank_of_expert_E.long().cpu()
        if (
            rank_of_expert_E.numel()
            and not 0 <= int(rank_of_expert_E.min()) <= int(rank_of_expert_E.max()) < self.size
        ):
            raise ValueError(f"dispatch: rank_of_expert_E must lie in [0, {self.size})")
        row_bytes = x_TD.shape[1] * x_TD.element_size()
        expert_TK = expert_TK.long().cpu()
        exchange = self._exchange(expert_TK, rank_of_expert_E, row_bytes, x_TD.device)
        self.stats.dispatch_s += time.perf_counter() - start
        out_ND = _DispatchFn.apply(x_TD.contiguous(), exchange, self.stats)
        return out_ND, exchange.tokens_per_local_expert_L, DispatchHandle(exchange)

    def combine(
        self, expert_output_ND: Tensor, handle: DispatchHandle, weight_TK: Tensor | None = None
    ) -> Tensor:
        """See TokenDispatcher.combine."""
        exchange = handle.exchange
        if weight_TK is not None and exchange.reduces_weighted:
            y_ND = expert_output_ND.contiguous()
            return _WeightedCombineFn.apply(y_ND, weight_TK, exchange, self.stats)
        y_TKD = _CombineFn.apply(expert_output_ND.contiguous(), exchange, self.stats)
        if weight_TK is None:
            return y_TKD
        return (y_TKD * weight_TK.to(y_TKD.dtype)[:, :, None]).sum(dim=1)


class _FlatExchange:
    """all_to_all_single with uneven splits; rows arrive (source, expert) and are regrouped."""

    reduces_weighted = False

    def __init__(
        self, owner: FlatAllToAll, expert_TK: Tensor, rank_of_expert_E: Tensor, device
    ) -> None:
        self.owner = owner
        self.num_tokens, self.topk = expert_TK.shape
        size, me = owner.size, owner.rank
        self.order_P, counts_E, send_S = sort_pairs(expert_TK, rank_of_expert_E, size)
        # Metadata: every rank tells each destination how many rows it sends per local expert.
        expert_rank_order = torch.sort(rank_of_expert_E, stable=True).indices
        local_per_rank = torch.bincount(rank_of_expert_E, minlength=size)
        num_local = int(local_per_rank[me].item())
        counts_SL = owner.meta(torch.empty(size * num_local, dtype=torch.long))
        dist.all_to_all_single(
            counts_SL,
            owner.meta(counts_E[expert_rank_order].contiguous()),
            [num_local] * size,
            local_per_rank.tolist(),
            group=owner.group,
        )
        counts_SL = counts_SL.cpu().reshape(size, num_local)
        for peer in range(size):
            owner.stats.add_bytes(owner.topo, me, peer, 8 * int(local_per_rank[peer].item()))
        self.send_splits = send_S.tolist()
        self.recv_splits = counts_SL.sum(dim=1).tolist()
        self.regroup = BlockTranspose(counts_SL)
        self.tokens_per_local_expert_L = counts_SL.sum(dim=0).to(device)
        self.order_P = self.order_P.to(device)

    def _exchange(self, send_ND: Tensor, send_splits, recv_splits) -> Tensor:
        owner = self.owner
        recv_ND = send_ND.new_empty((sum(recv_splits), send_ND.shape[1]))
        dist.all_to_all_single(recv_ND, send_ND, recv_splits, send_splits, group=owner.group)
        row_bytes = send_ND.shape[1] * send_ND.element_size()
        for peer, rows in enumerate(send_splits):
            owner.stats.add_bytes(owner.topo, owner.rank, peer, rows * row_bytes)
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
        return _FlatExchange(self, expert_TK, rank_of_expert_E, device)
