"""HALO: hierarchical, locality-optimized all-to-all behind the TokenDispatcher protocol.

For EP ranks (node n, local j):
  Phase I   rows for ranks on my own node go there directly (intra-node p2p).
  Phase II  rows for each remote node n' are packed into one message and sent to my rail peer
            (n', j) (the node's "gateway" for me, runtime/dispatch/topology.py), so a pair of nodes
            exchanges g large messages instead of g * g small ones.
  Phase III each gateway forwards the rows it received to their final ranks on its node.
Phase I runs concurrently with Phase II -> Phase III (asynchronous batched p2p). With
`dedup=True`, a token with several of its top-k experts on one remote node crosses the network
once in the dispatch and is copied by the gateway in Phase III. The reverse exchange (combine,
backward of dispatch) retraces the same path with one row per (token, choice).

`combine(..., weight_TK=gates)` returns the gate-weighted sum over K; with dedup the gateway
sums a token's weighted expert outputs from its node, so that direction also crosses the
network once per (token, node) (backward likewise: one gradient row per (token, node) goes
out, the gate gradients come back as scalars).

Sizes are known everywhere before any payload moves: one exchange of each rank's per-expert
row counts (with dedup also its unique-token counts per node, in the same round) gives every
rank the full traffic matrix. When the largest node-to-node message is below
`direct_below_bytes` (latency-bound sizes), or when the relay cannot pay (no dedup and at most
two nodes, or one rank per node: same bytes across nodes, no fewer messages), every rank
decides the same way to send rows straight to their final ranks in one round, like the flat
all-to-all.

Shape letters as in runtime/dispatch/flat.py (T, K, D, E, L, N, P = T * K, S ranks); R rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch.flat import Exchange, ExchangeDispatcher, put_rows, take_rows
from runtime.dispatch.halo_plan import HaloCost, HaloPlan, segments
from runtime.dispatch.halo_weighted import WeightedReduction

_TAG_I, _TAG_II, _TAG_II_OWN, _TAG_II_INDEX, _TAG_III = 11, 12, 13, 14, 15
# Below this many bytes per node-pair message, one direct round beats two hops (the crossover
# measured on the emulated network of benchmarks/halo_emulated.py; see runtime/HALO.md).
DEFAULT_DIRECT_BELOW_BYTES = 1 << 20


class _HaloExchange(HaloPlan, WeightedReduction):
    """The three-phase exchange for one routing decision (see module docstring).

    Every Phase II message from a source to a node's gateway is split in two: first the rows
    the gateway forwards, then the rows for the gateway itself, so Phase III starts while the
    second part is still on the wire (and, in reverse, the gateway's own rows go back first).
    """

    def _all_to_all(self, rows_RD: Tensor, forward: bool) -> Tensor:
        """Direct path: every row straight to its rank in one all_to_all_single round."""
        me, size = self.me, self.owner.size
        to_rank = self.pairs_SS[me] if forward else [self.pairs_SS[s][me] for s in range(size)]
        from_rank = [self.pairs_SS[s][me] for s in range(size)] if forward else self.pairs_SS[me]
        out_RD = rows_RD.new_empty((sum(from_rank), *rows_RD.shape[1:]))
        dist.all_to_all_single(out_RD, rows_RD, from_rank, to_rank, group=self.owner.group)
        row_bytes = math.prod(rows_RD.shape[1:]) * rows_RD.element_size()
        for peer, rows in enumerate(to_rank):
            self.owner.stats.add_bytes(self.topo, me, peer, rows * row_bytes)
        return out_RD

    def _send(self, ops: list, tensor: Tensor, peer: int, tag: int) -> None:
        if tensor.numel() == 0:
            return
        peer_global = self.topo.global_ranks[peer]
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer_global, tag=tag))
        self.owner.stats.add_bytes(self.topo, self.me, peer, tensor.numel() * tensor.element_size())

    def _recv(self, ops: list, rows: int, like: Tensor, peer: int, tag: int) -> Tensor:
        buf = like.new_empty((rows, *like.shape[1:]))
        if rows:
            ops.append(dist.P2POp(dist.irecv, buf, self.topo.global_ranks[peer], tag=tag))
        return buf

    @staticmethod
    def _post(ops: list) -> list:
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def _wait(works: list) -> None:
        for work in works:
            work.wait()

    @staticmethod
    def _cat(parts: list[Tensor], like: Tensor) -> Tensor:
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else like.new_empty((0, *like.shape[1:]))

    # ---- forward: sources -> experts -------------------------------------------------------

    def forward_tokens(self, x_TD: Tensor) -> Tensor:
        """Dispatch: token rows (one per (token, node) across nodes with dedup)."""
        tok = self.token_sorted_P
        if not self.dedup:
            return self._forward(lambda pos: take_rows(x_TD, tok[pos]), x_TD)
        return self._forward(
            lambda pos: take_rows(x_TD, tok[pos]),
            x_TD,
            pack=lambda b: take_rows(x_TD, self.unique_tokens[b]),
            send_index=True,
        )

    def forward_pairs(self, x_PD: Tensor) -> Tensor:
        """Backward of combine: one row per (token, choice)."""
        return self._forward(lambda pos: take_rows(x_PD, self.order_P[pos]), x_PD)

    def _forward(self, rows_at, like, pack=None, send_index=False, expand=None, extra=None):
        """Phases I + II, then III; returns rows grouped by (local expert, source).

        rows_at(pos): rows of sorted pairs `pos`. pack(b): the Phase II message to node b
        (default: the rows of its pairs), indexed per pair by the pack index. expand(src,
        message): pair rows from a whole message (then Phase III waits for all of it).
        extra(ops): adds ops to the Phase III batch.
        """
        if self.direct:
            return self.regroup.to_expert_major(self._all_to_all(rows_at(slice(None)), True))
        me = self.me
        ops_i, from_peer = self._phase_i(rows_at, like)
        ops_fwd, ops_own, fwd, own = self._phase_ii(rows_at, like, pack, send_index)
        works_i, works_fwd, works_own = map(self._post, (ops_i, ops_fwd, ops_own))
        self._wait(works_fwd)
        unique = pack is not None
        if expand is not None:  # the transform needs whole messages: no overlap
            self._wait(works_own)
            full = {s: expand(s, torch.cat([fwd[s], own[s]])) for s in fwd}
            relayed = self._phase_iii(
                lambda s, dst: full[s][slice(*self._seg_at_gateway(s, dst))], like, extra
            )
        else:

            def own_pieces() -> dict[int, Tensor]:
                self._wait(works_own)
                if not unique:  # my rows are exactly the second part of each message
                    return own
                return {s: self._gather_two(fwd[s], own[s], self._own_index(s)) for s in fwd}

            def piece(src: int, dst: int) -> Tensor:
                return self._piece(fwd[src], src, dst, unique)

            relayed = self._phase_iii(piece, like, extra, own_pieces)
        self._wait(works_i)
        by_src = [
            rows_at(slice(*self.seg_of_dest[me]))
            if src == me
            else (from_peer[src] if src in from_peer else relayed[src])
            for src in range(self.owner.size)
        ]
        return self.regroup.to_expert_major(by_src)

    def _phase_i(self, rows_at, like) -> tuple[list, dict[int, Tensor]]:
        """Ops and receive buffers of Phase I: rows for the other ranks of my node."""
        ops: list = []
        from_peer: dict[int, Tensor] = {}
        for peer in self.node_peers:
            self._send(ops, rows_at(slice(*self.seg_of_dest[peer])), peer, _TAG_I)
            from_peer[peer] = self._recv(ops, self.pairs_SS[peer][self.me], like, peer, _TAG_I)
        return ops, from_peer

    def _phase_ii(self, rows_at, like, pack, send_index: bool):
        """Ops and buffers of Phase II, as two batches: each message's forwarded rows (and
        the dedup pack index), then its rows for the gateway itself."""
        me, node, unique = self.me, self.my_node, pack is not None
        ops_fwd: list = []
        ops_own: list = []
        for b in self.remote_nodes:  # as a source: one message per remote node
            gw = self.topo.gateway(me, b)
            message = pack(b) if unique else rows_at(self.rows_to_node[b])
            first = self._forwarded_rows(me, b, unique)
            if send_index:
                self._send(ops_fwd, self.pack_index[b], gw, _TAG_II_INDEX)
            self._send(ops_fwd, message[:first], gw, _TAG_II)
            self._send(ops_own, message[first:], gw, _TAG_II_OWN)
        fwd, own = {}, {}
        index_like = torch.zeros(0, dtype=torch.long, device=self.device)
        for src in self.srcs_via[me]:  # as a gateway
            pairs = self._pairs_to_node(src, node)
            total = self.unique_SN[src][node] if unique else pairs
            first = self._forwarded_rows(src, node, unique)
            if send_index:
                self.gateway_index[src] = self._recv(ops_fwd, pairs, index_like, src, _TAG_II_INDEX)
            fwd[src] = self._recv(ops_fwd, first, like, src, _TAG_II)
            own[src] = self._recv(ops_own, total - first, like, src, _TAG_II_OWN)
        return ops_fwd, ops_own, fwd, own

    def _phase_iii(self, piece, like, extra=None, own_pieces=None) -> dict[int, Tensor]:
        """Gateway forwards pair rows to the other ranks of its node; returns rows relayed to
        me, by source. piece(src, dst): src's rows for dst; own_pieces(): each src's rows for
        me (may wait for them); extra(ops): more ops for this batch."""
        me, members = self.me, self.topo.members_of_node[self.my_node]
        srcs = self.srcs_via[me]
        ops: list = []
        bufs: dict[int, Tensor] = {}
        for dst in members:  # as a gateway
            if dst != me:
                self._send(ops, self._cat([piece(s, dst) for s in srcs], like), dst, _TAG_III)
        for gw in members:  # as a final destination
            if gw != me:
                rows = sum(self.pairs_SS[s][me] for s in self.srcs_via[gw])
                bufs[gw] = self._recv(ops, rows, like, gw, _TAG_III)
        if extra:
            extra(ops)
        works = self._post(ops)
        mine = own_pieces() if own_pieces else {s: piece(s, me) for s in srcs}
        bufs[me] = self._cat([mine[s] for s in srcs], like)
        self._wait(works)
        relayed: dict[int, Tensor] = {}
        for gw in members:
            counts = [self.pairs_SS[s][me] for s in self.srcs_via[gw]]
            for s, (a, b) in zip(self.srcs_via[gw], segments(counts), strict=True):
                relayed[s] = bufs[gw][a:b]
        return relayed

    def _piece(self, message: Tensor, src: int, dst: int, unique: bool) -> Tensor:
        """Rows of src's Phase II message to my node for rank dst (copies tokens if unique)."""
        a, b = self._seg_at_gateway(src, dst)
        return take_rows(message, self.gateway_index[src][a:b]) if unique else message[a:b]

    def _own_index(self, src: int) -> Tensor:
        """Positions, in src's unique-token message, of the rows for my own experts."""
        a, b = self._seg_at_gateway(src, self.me)
        return self.gateway_index[src][a:b]

    @staticmethod
    def _gather_two(first: Tensor, second: Tensor, index: Tensor) -> Tensor:
        """cat([first, second])[index] without building the concatenation."""
        out = first.new_empty((index.numel(), *first.shape[1:]))
        in_first = (index < first.shape[0]).nonzero().squeeze(1)
        in_second = (index >= first.shape[0]).nonzero().squeeze(1)
        put_rows(out, in_first, take_rows(first, index.index_select(0, in_first)))
        rows = index.index_select(0, in_second) - first.shape[0]
        put_rows(out, in_second, take_rows(second, rows))
        return out

    # ---- reverse: experts -> sources -------------------------------------------------------

    def reverse(self, y_ND: Tensor) -> Tensor:
        """Combine (unweighted) / backward of dispatch: rows [P, D] in (token, choice) order."""
        if self.direct:
            by_src_ND = self.regroup.to_source_major(y_ND)
            sorted_PD = self._all_to_all(by_src_ND, forward=False)
            y_PD = torch.empty_like(sorted_PD)
            put_rows(y_PD, self.order_P, sorted_PD)
            return y_PD
        local, from_fwd, from_own = self._reverse(y_ND)
        y_PD = y_ND.new_empty((self.order_P.numel(), *y_ND.shape[1:]))
        for peer, rows in local.items():
            put_rows(y_PD, self.order_P[slice(*self.seg_of_dest[peer])], rows)
        for b in self.remote_nodes:  # member order: forwarded ranks' rows, then the gateway's
            pos_P = self.order_P[self.rows_to_node[b]]
            first = from_fwd[b].shape[0]
            put_rows(y_PD, pos_P[:first], from_fwd[b])
            put_rows(y_PD, pos_P[first:], from_own[b])
        return y_PD

    def _reverse(self, y_ND: Tensor, weight_P: Tensor | None = None):
        """Reverse I, III and the gateways' own rows at once, then reverse II.

        Returns (pair rows from my node's ranks, by rank; per remote node the rows its gateway
        forwarded (with weight_P: one gate-weighted sum per unique token); per remote node the
        gateway's own rows (none with weight_P)); both in member order.
        """
        me, size, weighted = self.me, self.owner.size, weight_P is not None
        by_src_ND = self.regroup.to_source_major(y_ND)
        seg = segments([self.pairs_SS[s][me] for s in range(size)])
        ops_early: list = []
        local = {me: by_src_ND[slice(*seg[me])]}
        for peer in self.node_peers:  # reverse Phase I
            self._send(ops_early, by_src_ND[slice(*seg[peer])], peer, _TAG_I)
            local[peer] = self._recv(ops_early, self.pairs_SS[me][peer], y_ND, peer, _TAG_I)
        ops_iii: list = []
        at_gateway: dict[int, Tensor] = {}
        others = [m for m in self.topo.members_of_node[self.my_node] if m != me]
        for gw in others:  # reverse Phase III: rows of remote sources to their gateway
            rows = self._cat([by_src_ND[slice(*seg[s])] for s in self.srcs_via[gw]], y_ND)
            self._send(ops_iii, rows, gw, _TAG_III)
        for dst in others:
            rows = sum(self.pairs_SS[s][dst] for s in self.srcs_via[me])
            at_gateway[dst] = self._recv(ops_iii, rows, y_ND, dst, _TAG_III)
        from_own, from_fwd, weights = {}, {}, {}
        for b in self.remote_nodes:
            gw = self.topo.gateway(me, b)
            if weighted:  # one summed row per unique token, the gateway-only tokens' first
                buf = y_ND.new_empty((self.unique_SN[me][b], *y_ND.shape[1:]))
                first = self.forwarded_unique_SN[me][b]
                self._recv_into(ops_early, buf[first:], gw, _TAG_II_OWN)
                self._recv_into(ops_early, buf[:first], gw, _TAG_II)
                from_fwd[b], from_own[b] = buf, buf[:0]
                continue
            own_rows = self.pairs_SS[me][gw]
            rows = self._pairs_to_node(me, b) - own_rows
            from_fwd[b] = self._recv(ops_early, rows, y_ND, gw, _TAG_II)
            from_own[b] = self._recv(ops_early, own_rows, y_ND, gw, _TAG_II_OWN)
        works_w: list = []
        if weighted:
            ops_w: list = []
            weights = self._exchange_weights(ops_w, weight_P)
            works_w = self._post(ops_w)
        else:  # as a gateway, my own rows for each source go back at once
            for s in self.srcs_via[me]:
                self._send(ops_early, by_src_ND[slice(*seg[s])], s, _TAG_II_OWN)
        works_early = self._post(ops_early)
        works_iii = self._post(ops_iii)
        works_ii: list = []
        own = {s: by_src_ND[slice(*seg[s])] for s in self.srcs_via[me]} if weighted else {}
        partial: dict[int, Tensor] = {}
        if weighted:  # sum my own rows first: tokens only my experts saw can leave at once
            self._wait(works_w)
            for s in self.srcs_via[me]:
                partial[s] = self._gateway_own_sum(s, own[s], weights[s])
                ops_own: list = []
                self._send(ops_own, partial[s][self._gateway_first(s) :], s, _TAG_II_OWN)
                works_ii += self._post(ops_own)
        self._wait(works_iii)
        for s, rows_RD in self._regather(at_gateway, y_ND, own).items():  # reverse Phase II
            if weighted:
                rows_RD = self._gateway_sum(s, rows_RD, weights[s], partial[s])
                rows_RD = rows_RD[: self._gateway_first(s)]
            ops_ii: list = []  # each source's rows leave as soon as they are ready
            self._send(ops_ii, rows_RD, s, _TAG_II)
            works_ii += self._post(ops_ii)
        self._wait(works_ii + works_early)
        return local, from_fwd, from_own

    def _recv_into(self, ops: list, buf: Tensor, peer: int, tag: int) -> None:
        if buf.shape[0]:
            ops.append(dist.P2POp(dist.irecv, buf, self.topo.global_ranks[peer], tag=tag))

    def _regather(
        self, at_gateway: dict[int, Tensor], like: Tensor, own: dict[int, Tensor]
    ) -> dict[int, Tensor]:
        """As a gateway: each remote source's rows from the other ranks of my node, in that
        source's member order, followed by my own rows for it when `own` has them (my rows
        come last in that order)."""
        me, node, srcs = self.me, self.my_node, self.srcs_via[self.me]
        per_dst = {d: segments([self.pairs_SS[s][d] for s in srcs]) for d in at_gateway}
        return {
            src: self._cat(
                [
                    at_gateway[dst][slice(*per_dst[dst][i])]
                    for dst in self._member_order(src, node)
                    if dst != me
                ]
                + ([own[src]] if src in own else []),
                like,
            )
            for i, src in enumerate(srcs)
        }


class Halo(ExchangeDispatcher):
    """Hierarchical three-phase all-to-all dispatcher (HALO), optionally deduplicated.

    Args:
      group: the EP process group (None = default group); every member calls each method.
      ranks_per_node: ranks per (emulated) node; a member's node is its GLOBAL rank // this
        (default: LOCAL_WORLD_SIZE, else the whole world is one node).
      dedup: send a token once per remote node even when several of its experts live there
        (and, in a gate-weighted combine, return one pre-summed row per (token, node)).
      direct_below_bytes: when the largest node-to-node message of a dispatch is smaller, send
        rows straight to their final ranks in one round (latency-bound sizes); 0 = never
        (always three phases, whatever `cost` says).
      cost: a HaloCost (message cost and bandwidths of this cluster): above the threshold,
        take the three phases only when it estimates them faster than one direct round on
        this exchange's traffic. None: take them unless they cannot pay at all (no dedup on
        two nodes, or one rank per node).
    """

    def __init__(
        self,
        group=None,
        ranks_per_node: int | None = None,
        dedup: bool = False,
        direct_below_bytes: int = DEFAULT_DIRECT_BELOW_BYTES,
        cost: HaloCost | None = None,
    ) -> None:
        super().__init__(group, ranks_per_node)
        self.dedup = dedup
        self.direct_below_bytes = direct_below_bytes
        self.cost = cost

    def _exchange(
        self, expert_TK: Tensor, rank_of_expert_E: Tensor, row_bytes: int, device: torch.device
    ) -> Exchange:
        return _HaloExchange(self, expert_TK, rank_of_expert_E, row_bytes, device)
