"""HALO's communication: the phases of one exchange, executing a frozen HaloPlan.

Forward (sources -> experts): Phase I (rows for my node's ranks) beside Phase II (one message
per remote node to my gateway there), then Phase III (each gateway forwards to its node's
ranks). Every Phase II message is split in two: first the rows the gateway forwards, then
its own rows, so Phase III starts while the second part is still on the wire. Reverse
(experts -> sources) retraces the path, the gateway's own rows going back first; with gates
the gateway sums a token's weighted rows of its node, one row per (token, node).

Every function takes the plan and the EPGroup explicitly; the only state that outlives a
call is `gateway_index` (per remote source: the position of each pair in its unique-token
message), which the dedup dispatch receives and the weighted combine reuses.

Shape letters as in runtime/dispatch/base.py (T, K, D, N, P = T * K, S ranks); R rows of
one message.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch.base import EPGroup, cat_rows, put_rows, segments, take_rows
from runtime.dispatch.halo_plan import HaloPlan

TAG_I, TAG_II, TAG_II_OWN, TAG_II_INDEX, TAG_III, TAG_GATE = 11, 12, 13, 14, 15, 16

RowsAt = Callable[[slice | Tensor], Tensor]  # rows of the sorted pairs at these positions

# ---- p2p on the EP group, bytes counted -------------------------------------------------


def send(ep: EPGroup, ops: list, tensor: Tensor, peer: int, tag: int) -> None:
    """Adds an isend of `tensor` to group rank `peer` (nothing for an empty tensor)."""
    if tensor.numel() == 0:
        return
    peer_global = ep.topo.global_ranks[peer]
    ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer_global, tag=tag))
    ep.count(peer, tensor.numel() * tensor.element_size())


def recv(ep: EPGroup, ops: list, rows: int, like: Tensor, peer: int, tag: int) -> Tensor:
    """A buffer of `rows` rows like `like`, with its irecv from `peer` added to ops."""
    buf = like.new_empty((rows, *like.shape[1:]))
    recv_into(ep, ops, buf, peer, tag)
    return buf


def recv_into(ep: EPGroup, ops: list, buf: Tensor, peer: int, tag: int) -> None:
    """Adds an irecv into `buf` from group rank `peer` (nothing for an empty buffer)."""
    if buf.shape[0]:
        ops.append(dist.P2POp(dist.irecv, buf, ep.topo.global_ranks[peer], tag=tag))


def post(ops: list) -> list:
    """Starts a batch of p2p ops; returns its works."""
    return dist.batch_isend_irecv(ops) if ops else []


def wait(works: list) -> None:
    """Waits for every work."""
    for work in works:
        work.wait()


def all_to_all(plan: HaloPlan, ep: EPGroup, rows_RD: Tensor, forward: bool) -> Tensor:
    """Direct path: every row straight to its rank in one all_to_all_single round."""
    me, size = plan.me, plan.topo.size
    to_rank = plan.pairs_SS[me] if forward else [plan.pairs_SS[s][me] for s in range(size)]
    from_rank = [plan.pairs_SS[s][me] for s in range(size)] if forward else plan.pairs_SS[me]
    to_rank, from_rank = list(to_rank), list(from_rank)
    out_RD = rows_RD.new_empty((sum(from_rank), *rows_RD.shape[1:]))
    dist.all_to_all_single(out_RD, rows_RD, from_rank, to_rank, group=ep.group)
    row_bytes = math.prod(rows_RD.shape[1:]) * rows_RD.element_size()
    for peer, rows in enumerate(to_rank):
        ep.count(peer, rows * row_bytes)
    return out_RD


# ---- forward: sources -> experts --------------------------------------------------------


def forward(
    plan: HaloPlan,
    ep: EPGroup,
    rows_at: RowsAt,
    like: Tensor,
    pack: Callable[[int], Tensor] | None = None,
    gateway_index: dict[int, Tensor] | None = None,
    expand: Callable[[int, Tensor], Tensor] | None = None,
    extra: Callable[[list], None] | None = None,
) -> Tensor:
    """Phases I + II, then III; returns rows grouped by (local expert, source) [N, D].

    Args:
      rows_at: rows of the sorted pairs at the given positions.
      like: a tensor with the rows' dtype, device and trailing shape.
      pack: pack(b) is the Phase II message to node b, one row per unique token (default:
        the rows of its pairs).
      gateway_index: with `pack`, filled with each remote source's pack index (sent beside
        its message) and used to copy its tokens to their pairs.
      expand: expand(src, message): pair rows from a whole unique-token message (then Phase
        III waits for all of it; the pack index must already be known).
      extra: extra(ops) adds ops to the Phase III batch.
    """
    if plan.direct:
        return plan.regroup.to_expert_major(all_to_all(plan, ep, rows_at(slice(None)), True))
    me = plan.me
    ops_i, from_peer = _phase_i(plan, ep, rows_at, like)
    ops_fwd, ops_own, fwd, own = _phase_ii(plan, ep, rows_at, like, pack, gateway_index)
    works_i, works_fwd, works_own = map(post, (ops_i, ops_fwd, ops_own))
    wait(works_fwd)
    unique = pack is not None
    if expand is not None:  # the transform needs whole messages: no overlap
        wait(works_own)
        full = {s: expand(s, torch.cat([fwd[s], own[s]])) for s in fwd}
        relayed = _phase_iii(
            plan, ep, lambda s, dst: full[s][slice(*plan.seg_at_gateway(s, dst))], like, extra
        )
    else:

        def own_pieces() -> dict[int, Tensor]:
            wait(works_own)
            if not unique:  # my rows are exactly the second part of each message
                return own
            return {s: _gather_two(fwd[s], own[s], _own_index(plan, gateway_index, s)) for s in fwd}

        def piece(src: int, dst: int) -> Tensor:
            a, b = plan.seg_at_gateway(src, dst)
            return take_rows(fwd[src], gateway_index[src][a:b]) if unique else fwd[src][a:b]

        relayed = _phase_iii(plan, ep, piece, like, extra, own_pieces)
    wait(works_i)
    by_src = [
        rows_at(slice(*plan.seg_of_dest[me]))
        if src == me
        else (from_peer[src] if src in from_peer else relayed[src])
        for src in range(plan.topo.size)
    ]
    return plan.regroup.to_expert_major(by_src)


def _phase_i(plan: HaloPlan, ep: EPGroup, rows_at: RowsAt, like: Tensor):
    """Ops and receive buffers of Phase I: rows for the other ranks of my node."""
    ops: list = []
    from_peer: dict[int, Tensor] = {}
    for peer in plan.node_peers:
        send(ep, ops, rows_at(slice(*plan.seg_of_dest[peer])), peer, TAG_I)
        from_peer[peer] = recv(ep, ops, plan.pairs_SS[peer][plan.me], like, peer, TAG_I)
    return ops, from_peer


def _phase_ii(plan: HaloPlan, ep: EPGroup, rows_at: RowsAt, like: Tensor, pack, gateway_index):
    """Ops and buffers of Phase II, as two batches: each message's forwarded rows (and
    the dedup pack index), then its rows for the gateway itself."""
    me, node, unique = plan.me, plan.my_node, pack is not None
    send_index = gateway_index is not None
    ops_fwd: list = []
    ops_own: list = []
    for b in plan.remote_nodes:  # as a source: one message per remote node
        gw = plan.topo.gateway(me, b)
        message = pack(b) if unique else rows_at(plan.rows_to_node[b])
        first = plan.forwarded_rows(me, b, unique)
        if send_index:
            send(ep, ops_fwd, plan.pack_index[b], gw, TAG_II_INDEX)
        send(ep, ops_fwd, message[:first], gw, TAG_II)
        send(ep, ops_own, message[first:], gw, TAG_II_OWN)
    fwd, own = {}, {}
    index_like = torch.zeros(0, dtype=torch.long, device=plan.device)
    for src in plan.srcs_via[me]:  # as a gateway
        pairs = plan.pairs_to_node(src, node)
        total = plan.unique_SQ[src][node] if unique else pairs
        first = plan.forwarded_rows(src, node, unique)
        if send_index:
            gateway_index[src] = recv(ep, ops_fwd, pairs, index_like, src, TAG_II_INDEX)
        fwd[src] = recv(ep, ops_fwd, first, like, src, TAG_II)
        own[src] = recv(ep, ops_own, total - first, like, src, TAG_II_OWN)
    return ops_fwd, ops_own, fwd, own


def _phase_iii(plan: HaloPlan, ep: EPGroup, piece, like, extra=None, own_pieces=None):
    """Gateway forwards pair rows to the other ranks of its node; returns rows relayed to
    me, by source. piece(src, dst): src's rows for dst; own_pieces(): each src's rows for
    me (may wait for them); extra(ops): more ops for this batch."""
    me, members = plan.me, plan.topo.members_of_node[plan.my_node]
    srcs = plan.srcs_via[me]
    ops: list = []
    bufs: dict[int, Tensor] = {}
    for dst in members:  # as a gateway
        if dst != me:
            send(ep, ops, cat_rows([piece(s, dst) for s in srcs], like), dst, TAG_III)
    for gw in members:  # as a final destination
        if gw != me:
            rows = sum(plan.pairs_SS[s][me] for s in plan.srcs_via[gw])
            bufs[gw] = recv(ep, ops, rows, like, gw, TAG_III)
    if extra:
        extra(ops)
    works = post(ops)
    mine = own_pieces() if own_pieces else {s: piece(s, me) for s in srcs}
    bufs[me] = cat_rows([mine[s] for s in srcs], like)
    wait(works)
    relayed: dict[int, Tensor] = {}
    for gw in members:
        counts = [plan.pairs_SS[s][me] for s in plan.srcs_via[gw]]
        for s, (a, b) in zip(plan.srcs_via[gw], segments(counts), strict=True):
            relayed[s] = bufs[gw][a:b]
    return relayed


def _own_index(plan: HaloPlan, gateway_index: dict[int, Tensor], src: int) -> Tensor:
    """Positions, in src's unique-token message, of the rows for my own experts."""
    a, b = plan.seg_at_gateway(src, plan.me)
    return gateway_index[src][a:b]


def _gather_two(first: Tensor, second: Tensor, index: Tensor) -> Tensor:
    """cat([first, second])[index] without building the concatenation."""
    out = first.new_empty((index.numel(), *first.shape[1:]))
    in_first = (index < first.shape[0]).nonzero().squeeze(1)
    in_second = (index >= first.shape[0]).nonzero().squeeze(1)
    put_rows(out, in_first, take_rows(first, index.index_select(0, in_first)))
    rows = index.index_select(0, in_second) - first.shape[0]
    put_rows(out, in_second, take_rows(second, rows))
    return out


# ---- reverse: experts -> sources --------------------------------------------------------


def reverse(plan: HaloPlan, ep: EPGroup, y_ND: Tensor) -> Tensor:
    """Expert rows back to their sources; returns rows [P, D] in (token, choice) order."""
    if plan.direct:
        sorted_PD = all_to_all(plan, ep, plan.regroup.to_source_major(y_ND), forward=False)
        y_PD = torch.empty_like(sorted_PD)
        put_rows(y_PD, plan.order_P, sorted_PD)
        return y_PD
    start = start_reverse(plan, ep, y_ND, weighted=False)
    for s in plan.srcs_via[plan.me]:  # as a gateway, my own rows for each source go back at once
        send(ep, start.ops_early, start.back_to(s), s, TAG_II_OWN)
    works_early = post(start.ops_early)
    works_iii = post(start.ops_iii)
    works_ii: list = []
    wait(works_iii)
    for s, rows_RD in regather(plan, start.at_gateway, y_ND, {}).items():  # reverse Phase II
        ops_ii: list = []  # each source's rows leave as soon as they are ready
        send(ep, ops_ii, rows_RD, s, TAG_II)
        works_ii += post(ops_ii)
    wait(works_ii + works_early)
    y_PD = y_ND.new_empty((plan.order_P.numel(), *y_ND.shape[1:]))
    for peer, rows in start.local.items():
        put_rows(y_PD, plan.order_P[slice(*plan.seg_of_dest[peer])], rows)
    for b in plan.remote_nodes:  # member order: forwarded ranks' rows, then the gateway's
        pos_P = plan.order_P[plan.rows_to_node[b]]
        first = start.from_fwd[b].shape[0]
        put_rows(y_PD, pos_P[:first], start.from_fwd[b])
        put_rows(y_PD, pos_P[first:], start.from_own[b])
    return y_PD


@dataclass(frozen=True)
class ReverseStart:
    """The reverse exchange's first ops, before Phase II goes back (see start_reverse).

    Attributes:
      back_to: back_to(s) is my expert rows for source s, in its pair order.
      ops_early: reverse Phase I, and the receives of reverse Phase II (not yet posted).
      ops_iii: reverse Phase III: rows of remote sources to their gateway (not yet posted).
      local: pair rows from my node's ranks (me included), by rank (filled once waited).
      at_gateway: as a gateway, per other rank of my node, the rows it sends me.
      from_fwd: per remote node, the rows its gateway forwarded in member order (weighted:
        one gate-weighted sum per unique token, all of them).
      from_own: per remote node, the gateway's own rows (none when weighted).
    """

    back_to: Callable[[int], Tensor]
    ops_early: list
    ops_iii: list
    local: dict[int, Tensor]
    at_gateway: dict[int, Tensor]
    from_fwd: dict[int, Tensor]
    from_own: dict[int, Tensor]


def start_reverse(plan: HaloPlan, ep: EPGroup, y_ND: Tensor, weighted: bool) -> ReverseStart:
    """Builds reverse Phase I and III, and the receives of reverse Phase II (three phases)."""
    me, size = plan.me, plan.topo.size
    by_src_ND = plan.regroup.to_source_major(y_ND)
    seg = segments([plan.pairs_SS[s][me] for s in range(size)])

    def back_to(src: int) -> Tensor:
        return by_src_ND[slice(*seg[src])]

    ops_early: list = []
    local = {me: back_to(me)}
    for peer in plan.node_peers:  # reverse Phase I
        send(ep, ops_early, back_to(peer), peer, TAG_I)
        local[peer] = recv(ep, ops_early, plan.pairs_SS[me][peer], y_ND, peer, TAG_I)
    ops_iii: list = []
    at_gateway: dict[int, Tensor] = {}
    others = [m for m in plan.topo.members_of_node[plan.my_node] if m != me]
    for gw in others:  # reverse Phase III: rows of remote sources to their gateway
        rows = cat_rows([back_to(s) for s in plan.srcs_via[gw]], y_ND)
        send(ep, ops_iii, rows, gw, TAG_III)
    for dst in others:
        rows = sum(plan.pairs_SS[s][dst] for s in plan.srcs_via[me])
        at_gateway[dst] = recv(ep, ops_iii, rows, y_ND, dst, TAG_III)
    from_own, from_fwd = {}, {}
    for b in plan.remote_nodes:
        gw = plan.topo.gateway(me, b)
        if weighted:  # one summed row per unique token, the gateway-only tokens' first
            buf = y_ND.new_empty((plan.unique_SQ[me][b], *y_ND.shape[1:]))
            first = plan.forwarded_unique_SQ[me][b]
            recv_into(ep, ops_early, buf[first:], gw, TAG_II_OWN)
            recv_into(ep, ops_early, buf[:first], gw, TAG_II)
            from_fwd[b], from_own[b] = buf, buf[:0]
            continue
        own_rows = plan.pairs_SS[me][gw]
        rows = plan.pairs_to_node(me, b) - own_rows
        from_fwd[b] = recv(ep, ops_early, rows, y_ND, gw, TAG_II)
        from_own[b] = recv(ep, ops_early, own_rows, y_ND, gw, TAG_II_OWN)
    return ReverseStart(back_to, ops_early, ops_iii, local, at_gateway, from_fwd, from_own)


def regather(
    plan: HaloPlan, at_gateway: dict[int, Tensor], like: Tensor, own: dict[int, Tensor]
) -> dict[int, Tensor]:
    """As a gateway: each remote source's rows from the other ranks of my node, in that
    source's member order, followed by my own rows for it when `own` has them (my rows
    come last in that order)."""
    me, node, srcs = plan.me, plan.my_node, plan.srcs_via[plan.me]
    per_dst = {d: segments([plan.pairs_SS[s][d] for s in srcs]) for d in at_gateway}
    return {
        src: cat_rows(
            [
                at_gateway[dst][slice(*per_dst[dst][i])]
                for dst in plan.member_order(src, node)
                if dst != me
            ]
            + ([own[src]] if src in own else []),
            like,
        )
        for i, src in enumerate(srcs)
    }
