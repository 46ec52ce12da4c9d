"""Token dispatch for expert parallelism: the TokenDispatcher protocol and its shared parts.

An MoE layer on one rank of an expert-parallel (EP) group routes each of its T tokens to K
experts. `dispatch` sends every (token, choice) row to the EP rank that holds its expert;
`combine` brings the expert outputs back in the original order. Both are differentiable: the
backward of dispatch is the reverse exchange of gradients (summed over the K copies of a
token), the backward of combine is the forward exchange.

Shape letters: T tokens on this rank, K routing choices per token (top-k), D hidden size,
E experts in the layer, L experts local to this rank, N rows received by this rank,
P = T * K (token, choice) pairs, S ranks of the EP group.

Implementations (same protocol, outputs equal bit for bit):
  LocalDispatcher (runtime/dispatch/local.py): one rank holding every expert.
  FlatAllToAll (runtime/dispatch/flat.py): one all_to_all_single with uneven splits (the
    reference).
  Halo (runtime/dispatch/halo.py): hierarchical three-phase exchange, optionally deduplicated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from runtime.dispatch.topology import GroupTopology


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


@dataclass(frozen=True)
class EPGroup:
    """The EP process group as an exchange sees it.

    Attributes:
      group: the torch.distributed process group (None = the default group).
      topo: node layout of its members.
      me: this process's rank in the group.
      stats: the dispatcher's counters (every byte sent is added here).
      meta_device: where collectives need their tensors (CUDA on NCCL groups), None = CPU.
    """

    group: Any
    topo: GroupTopology
    me: int
    stats: DispatchStats
    meta_device: torch.device | None

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return self.topo.size

    def meta(self, tensor: Tensor) -> Tensor:
        """`tensor` on the device this group's collectives need."""
        return tensor if self.meta_device is None else tensor.to(self.meta_device)

    def count(self, peer: int, num_bytes: int) -> None:
        """Counts `num_bytes` sent from me to group rank `peer`."""
        self.stats.add_bytes(self.topo, self.me, peer, num_bytes)


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


class WeightedExchange(Exchange, Protocol):
    """An Exchange that also sums gate-weighted expert outputs on the way back."""

    def reverse_weighted(self, y_ND: Tensor, weight_TK: Tensor) -> tuple[Tensor, Any]:
        """Returns (y_TD = sum_k weight_TK[t, k] * y(t, k), what backward_weighted needs)."""

    def backward_weighted(self, grad_TD: Tensor, saved: Any) -> tuple[Tensor, Tensor]:
        """Gradients of reverse_weighted: (grad of expert rows [N, D], grad of gates [T, K])."""


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
            of the group (the routing table; migration swaps it). The MoE layer passes its
            expert slots as the experts (slot ids in expert_TK, the rank of each slot here:
            runtime/model/replicas.py), so a replicated expert is several "experts" here.

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


def cat_rows(parts: list[Tensor], like: Tensor) -> Tensor:
    """torch.cat(parts) along dim 0; one part is returned as is, none as [0, ...] like `like`."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else like.new_empty((0, *like.shape[1:]))


def segments(counts: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive blocks with the given sizes."""
    out, start = [], 0
    for count in counts:
        out.append((start, start + count))
        start += count
    return out


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
