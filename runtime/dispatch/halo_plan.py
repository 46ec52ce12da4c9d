"""HALO's preparation: the frozen plan of one routing decision (which rows go where, how many).

`plan_halo` runs on every rank of the EP group from its own routing and one counts round, so
all ranks agree on every message size and on the path before any payload moves.
runtime/dispatch/halo.py executes the plan.

Per (source rank, remote node), the source's pairs for that node are ordered by "member
order": the node's ranks ascending, except the source's gateway there, which comes last, so
the gateway can forward the first part of the message before the rest has arrived. With
dedup, the message holds unique tokens: those any non-gateway rank needs first.

Shape letters as in runtime/dispatch/base.py (T, K, E, L, N, P = T * K, S ranks); Q nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.dispatch.base import BlockTranspose, segments, sort_pairs
from runtime.dispatch.halo_cost import (
    DEFAULT_DIRECT_BELOW_BYTES,
    HaloCost,
    halo_traffic,
    takes_direct_path,
)
from runtime.dispatch.topology import GroupTopology


@dataclass(frozen=True)
class HaloOptions:
    """How a Halo dispatcher plans its exchanges.

    Attributes:
      dedup: send a token once per remote node even when several of its experts live there.
      direct_below_bytes: below this largest node-pair message, one direct round; 0 = never.
      cost: the cluster's HaloCost for the path decision, None = the structural rule.
    """

    dedup: bool = False
    direct_below_bytes: int = DEFAULT_DIRECT_BELOW_BYTES
    cost: HaloCost | None = None


@dataclass(frozen=True)
class HaloPlan:
    """Sizes, paths and index tensors of one routing decision on rank `me`.

    Attributes:
      topo, me: the EP group's node layout and this rank.
      num_tokens, topk: T and K of this rank's routing.
      direct: every row goes straight to its rank in one round (no relay).
      dedup: the three phases send unique tokens across nodes (never when direct).
      order_P: pair indices in (destination, expert, token, choice) order [P].
      token_sorted_P: token of each pair in that order [P].
      tokens_per_local_expert_L: rows my local experts receive [L].
      seg_of_dest: (start, stop) in sorted pairs of the rows for each rank [S].
      pairs_SS: rows rank s sends to rank d, every rank's [S][S].
      unique_SQ, forwarded_unique_SQ: with dedup, unique tokens rank s sends to node q, and
        how many of them the gateway forwards (they come first); empty without.
      regroup: how my received (source, expert) blocks regroup by expert.
      node_peers: ranks I send to in Phase I (every other rank when direct).
      remote_nodes: nodes I send Phase II messages to (none when direct).
      srcs_via: per rank g of my node, the remote sources whose rows for my node g receives.
      rows_to_node, unique_tokens, pack_index: per node (empty for mine): sorted-pair
        positions of my rows for it in member order; with dedup its unique tokens (those
        the gateway forwards first) and each pair's position among them.
      device: where the index tensors live (next to the data).
    """

    topo: GroupTopology
    me: int
    num_tokens: int
    topk: int
    direct: bool
    dedup: bool
    order_P: Tensor
    token_sorted_P: Tensor
    tokens_per_local_expert_L: Tensor
    seg_of_dest: tuple[tuple[int, int], ...]
    pairs_SS: tuple[tuple[int, ...], ...]
    unique_SQ: tuple[tuple[int, ...], ...]
    forwarded_unique_SQ: tuple[tuple[int, ...], ...]
    regroup: BlockTranspose
    node_peers: tuple[int, ...]
    remote_nodes: tuple[int, ...]
    srcs_via: Mapping[int, tuple[int, ...]]
    rows_to_node: tuple[Tensor, ...]
    unique_tokens: tuple[Tensor, ...]
    pack_index: tuple[Tensor, ...]
    device: torch.device

    @property
    def my_node(self) -> int:
        """My node's index."""
        return self.topo.node_of[self.me]

    def member_order(self, src: int, node: int) -> list[int]:
        """Ranks of `node` in the order src packs their rows: its gateway there last."""
        return _member_order(self.topo, src, node)

    def pairs_to_node(self, src: int, node: int) -> int:
        """Pairs src sends to the ranks of `node`."""
        return sum(self.pairs_SS[src][r] for r in self.topo.members_of_node[node])

    def forwarded_rows(self, src: int, node: int, unique: bool) -> int:
        """Rows of src's Phase II message to `node` that its gateway forwards (sent first)."""
        if unique:
            return self.forwarded_unique_SQ[src][node]
        return sum(self.pairs_SS[src][r] for r in self.member_order(src, node)[:-1])

    def seg_at_gateway(self, src: int, dst: int) -> tuple[int, int]:
        """Pair positions of src -> dst inside src's message to my node (member order)."""
        order = self.member_order(src, self.my_node)
        return segments([self.pairs_SS[src][r] for r in order])[order.index(dst)]


@dataclass(frozen=True)
class _Pack:
    """Per node: rows_to_node, unique_tokens, pack_index (HaloPlan); forwarded unique counts."""

    rows_to_node: tuple[Tensor, ...] = ()
    unique_tokens: tuple[Tensor, ...] = ()
    pack_index: tuple[Tensor, ...] = ()
    forwarded_unique: tuple[int, ...] = ()


def plan_halo(
    expert_TK: Tensor,
    rank_of_expert_E: Tensor,
    topo: GroupTopology,
    me: int,
    gather_counts: Callable[[Tensor], Tensor],
    options: HaloOptions,
    row_bytes: int,
    device: torch.device,
) -> HaloPlan:
    """Plans one HALO exchange on rank `me` (collective: every rank of the group calls it).

    Args:
      expert_TK: my top-k expert ids [T, K] (int64, CPU).
      rank_of_expert_E: EP rank of each expert [E] (int64, CPU; the same on every rank).
      topo, me: the EP group's node layout and my rank in it.
      gather_counts: the counts round: my int64 vector [C] -> every rank's, as a table [S, C].
      options: dedup, direct threshold and cost model.
      row_bytes: bytes of one payload row (D x element size), for the path decision.
      device: where the exchange's data lives.

    Returns:
      The HaloPlan; every rank of the group takes the same path.
    """
    num_tokens, topk = expert_TK.shape
    order_P, counts_E, counts_S = sort_pairs(expert_TK, rank_of_expert_E, topo.size)
    seg_of_dest = tuple(segments(counts_S.tolist()))
    token_sorted_P = order_P // topk
    # The pack plan needs only my routing, so the unique-token counts per node (dedup)
    # travel in the same round as the per-expert counts: one metadata round per dispatch.
    mine, pack = [counts_E], _Pack()
    if options.dedup:
        pack = _pack_plan(topo, me, seg_of_dest, token_sorted_P, num_tokens, dedup=True)
        mine.append(torch.tensor([u.numel() for u in pack.unique_tokens], dtype=torch.long))
        mine.append(torch.tensor(pack.forwarded_unique, dtype=torch.long))
    table = gather_counts(torch.cat(mine))
    num_experts, num_nodes = counts_E.numel(), topo.num_nodes
    counts_SE = table[:, :num_experts]
    unique_SQ = table[:, num_experts : num_experts + num_nodes] if options.dedup else None
    traffic = halo_traffic(topo, counts_SE, rank_of_expert_E, unique_SQ)
    direct = takes_direct_path(traffic, row_bytes, options.direct_below_bytes, options.cost)
    if direct:  # only the three phases use the pack plan
        pack = _Pack()
    elif not options.dedup:
        pack = _pack_plan(topo, me, seg_of_dest, token_sorted_P, num_tokens, dedup=False)
    node_peers, remote_nodes, srcs_via = _paths(topo, me, direct)
    forwarded_SQ = table[:, num_experts + num_nodes :] if options.dedup else None
    counts_SL = counts_SE[:, rank_of_expert_E == me]
    return HaloPlan(
        topo=topo,
        me=me,
        num_tokens=num_tokens,
        topk=topk,
        direct=direct,
        dedup=options.dedup and not direct,
        order_P=order_P.to(device),
        token_sorted_P=token_sorted_P.to(device),
        tokens_per_local_expert_L=counts_SL.sum(dim=0).to(device),
        seg_of_dest=seg_of_dest,
        pairs_SS=_rows_of(traffic.pairs_SS),
        unique_SQ=_rows_of(unique_SQ),
        forwarded_unique_SQ=_rows_of(forwarded_SQ),
        regroup=BlockTranspose(counts_SL),  # received rows: (source, expert) blocks
        node_peers=node_peers,
        remote_nodes=remote_nodes,
        srcs_via=srcs_via,
        rows_to_node=tuple(t.to(device) for t in pack.rows_to_node),
        unique_tokens=tuple(t.to(device) for t in pack.unique_tokens),
        pack_index=tuple(t.to(device) for t in pack.pack_index),
        device=device,
    )


def _rows_of(table: Tensor | None) -> tuple[tuple[int, ...], ...]:
    """A 2-D int tensor as nested tuples (() for None)."""
    return () if table is None else tuple(tuple(row) for row in table.tolist())


def _member_order(topo: GroupTopology, src: int, node: int) -> list[int]:
    """Ranks of `node` in the order src packs their rows: its gateway there last."""
    gw = topo.gateway(src, node)
    return [m for m in topo.members_of_node[node] if m != gw] + [gw]


def _paths(
    topo: GroupTopology, me: int, direct: bool
) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, tuple[int, ...]]]:
    """node_peers, remote_nodes and srcs_via of HaloPlan."""
    node = topo.node_of[me]
    local = range(topo.size) if direct else topo.members_of_node[node]
    srcs_via: dict[int, list[int]] = {gw: [] for gw in topo.members_of_node[node]}
    for src in range(topo.size):
        if not direct and topo.node_of[src] != node:
            srcs_via[topo.gateway(src, node)].append(src)
    node_peers = tuple(r for r in local if r != me)
    remote_nodes = () if direct else tuple(b for b in range(topo.num_nodes) if b != node)
    return node_peers, remote_nodes, {gw: tuple(srcs) for gw, srcs in srcs_via.items()}


def _pack_plan(
    topo: GroupTopology,
    me: int,
    seg_of_dest: tuple[tuple[int, int], ...],
    token_sorted_P: Tensor,
    num_tokens: int,
    dedup: bool,
) -> _Pack:
    """Per other node: sorted-pair positions in member order; with dedup also its unique
    tokens (those the gateway forwards first) and each pair's position among them."""
    rows_to_node, unique_tokens, pack_index, forwarded = [], [], [], []
    empty = torch.zeros(0, dtype=torch.long)
    for node in range(topo.num_nodes):
        if node == topo.node_of[me]:
            rows_to_node.append(empty)
            unique_tokens.append(empty)
            pack_index.append(empty)
            forwarded.append(0)
            continue
        order = _member_order(topo, me, node)
        fwd = torch.cat([torch.arange(*seg_of_dest[r]) for r in order[:-1]] + [empty])
        own = torch.arange(*seg_of_dest[order[-1]])
        rows = torch.cat([fwd, own])
        rows_to_node.append(rows)
        if not dedup:
            unique_tokens.append(empty)
            pack_index.append(empty)
            forwarded.append(0)
            continue
        tokens_fwd = torch.unique(token_sorted_P[fwd])
        tokens_own = torch.unique(token_sorted_P[own])
        tokens_own = tokens_own[~torch.isin(tokens_own, tokens_fwd)]
        uniq = torch.cat([tokens_fwd, tokens_own])
        position_T = torch.full((num_tokens,), -1, dtype=torch.long)
        position_T[uniq] = torch.arange(uniq.numel())
        unique_tokens.append(uniq)
        pack_index.append(position_T[token_sorted_P[rows]])
        forwarded.append(tokens_fwd.numel())
    return _Pack(tuple(rows_to_node), tuple(unique_tokens), tuple(pack_index), tuple(forwarded))
