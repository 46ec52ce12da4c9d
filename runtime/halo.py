"""HALO: hierarchical, locality-optimized all-to-all behind the TokenDispatcher protocol.

For EP ranks (node n, local j):
  Phase I   rows for ranks on my own node go there directly (intra-node p2p).
  Phase II  rows for each remote node n' are packed into one message and sent to my rail peer
            (n', j) (the node's "gateway" for me, see runtime/topo.py), so a pair of nodes
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
row counts (and per-node unique-token counts) gives every rank the full traffic matrix. When
the largest node-to-node message is below `direct_below_bytes` (latency-bound sizes), every
rank decides the same way to send rows straight to their final ranks in one round, like the
flat all-to-all, since two hops then cost more than they save.

Shape letters as in runtime/dispatch.py (T, K, D, E, L, N, P = T * K, S ranks); R rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch import Exchange, ExchangeDispatcher, block_transpose_index, sort_pairs
from runtime.halo_weighted import WeightedReduction

_TAG_I, _TAG_II, _TAG_II_OWN, _TAG_II_INDEX, _TAG_III = 11, 12, 13, 14, 15
DEFAULT_DIRECT_BELOW_BYTES = 256 * 1024  # below: latency-bound, one direct round wins


def _segments(counts: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive blocks with the given sizes."""
    out, start = [], 0
    for count in counts:
        out.append((start, start + count))
        start += count
    return out


class _HaloExchange(WeightedReduction):
    """The three-phase exchange for one routing decision (see module docstring).

    Every Phase II message from a source to a node's gateway is split in two: first the rows
    the gateway forwards, then the rows for the gateway itself, so Phase III starts while the
    second part is still on the wire (and, in reverse, the gateway's own rows go back first).
    """

    def __init__(
        self, owner: Halo, expert_TK: Tensor, rank_of_expert_E: Tensor, row_bytes: int, device
    ) -> None:
        topo, size, me = owner.topo, owner.size, owner.rank
        self.owner, self.topo, self.me, self.my_node = owner, topo, me, topo.node_of[me]
        self.num_tokens, self.topk = expert_TK.shape
        self.order_P, counts_E, counts_S = sort_pairs(expert_TK, rank_of_expert_E, size)
        self.seg_of_dest = _segments(counts_S.tolist())
        self.token_sorted_P = self.order_P // self.topk
        self._pack_plan()
        unique_N = torch.tensor([u.numel() for u in self.unique_tokens], dtype=torch.long)
        forwarded_N = torch.tensor(self.forwarded_unique, dtype=torch.long)
        self._gather_counts(torch.cat([counts_E, unique_N, forwarded_N]), rank_of_expert_E)
        self._choose_paths(row_bytes)
        self.gateway_index: dict[int, Tensor] = {}  # src -> pack index (dedup, as a gateway)
        self.saved: dict = {}  # weighted combine: what its backward needs
        self._to_device(device)

    def _member_order(self, src: int, node: int) -> list[int]:
        """Ranks of `node` in the order src packs their rows: its gateway there last."""
        gw = self.topo.gateway(src, node)
        return [m for m in self.topo.members_of_node[node] if m != gw] + [gw]

    def _pack_plan(self) -> None:
        """Per node: sorted-pair positions in member order, its unique tokens (those the
        gateway forwards first) and each pair's position among them."""
        self.rows_to_node, self.unique_tokens, self.pack_index = [], [], []
        self.forwarded_unique: list[int] = []
        empty = torch.zeros(0, dtype=torch.long)
        for node in range(self.topo.num_nodes):
            order = self._member_order(self.me, node)
            fwd = torch.cat([torch.arange(*self.seg_of_dest[r]) for r in order[:-1]] + [empty])
            own = torch.arange(*self.seg_of_dest[order[-1]])
            tokens_fwd = torch.unique(self.token_sorted_P[fwd])
            tokens_own = torch.unique(self.token_sorted_P[own])
            tokens_own = tokens_own[~torch.isin(tokens_own, tokens_fwd)]
            uniq = torch.cat([tokens_fwd, tokens_own])
            position_T = torch.full((self.num_tokens,), -1, dtype=torch.long)
            position_T[uniq] = torch.arange(uniq.numel())
            rows = torch.cat([fwd, own])
            self.rows_to_node.append(rows)
            self.unique_tokens.append(uniq)
            self.pack_index.append(position_T[self.token_sorted_P[rows]])
            self.forwarded_unique.append(tokens_fwd.numel())

    def _to_device(self, device: torch.device) -> None:
        """Moves the index tensors next to the data (planning above ran on the CPU)."""
        self.device = device
        names = ("order_P", "token_sorted_P", "regroup_N", "out_pos_N", "tokens_per_local_expert_L")
        for name in names:
            setattr(self, name, getattr(self, name).to(device))
        for name in ("rows_to_node", "unique_tokens", "pack_index"):
            setattr(self, name, [t.to(device) for t in getattr(self, name)])

    def _gather_counts(self, mine: Tensor, rank_of_expert_E: Tensor) -> None:
        """Shares per-expert and per-node counts with every rank; derives the traffic matrix."""
        topo, size, me, owner = self.topo, self.owner.size, self.me, self.owner
        # An all-gather as one all_to_all round (gloo's all_gather is a ring of S - 1 steps).
        table = owner.meta(torch.empty(size * mine.numel(), dtype=torch.long))
        dist.all_to_all_single(table, owner.meta(mine.repeat(size)), group=owner.group)
        for peer in range(size):
            owner.stats.add_bytes(topo, me, peer, 8 * mine.numel())
        num_experts, num_nodes = rank_of_expert_E.numel(), topo.num_nodes
        table = table.cpu().reshape(size, mine.numel())
        counts_SE = table[:, :num_experts]
        self.unique_SN = table[:, num_experts : num_experts + num_nodes].tolist()
        self.forwarded_unique_SN = table[:, num_experts + num_nodes :].tolist()
        pairs_SS = torch.zeros(size, size, dtype=torch.long)
        pairs_SS.index_add_(1, rank_of_expert_E, counts_SE)
        self.pairs_SS = pairs_SS.tolist()
        counts_SL = counts_SE[:, rank_of_expert_E == me]
        self.regroup_N = block_transpose_index(counts_SL)
        self.tokens_per_local_expert_L = counts_SL.sum(dim=0)
        # Output position of each received row, rows stored source-major (inverse of regroup).
        self.out_pos_N = torch.empty_like(self.regroup_N)
        self.out_pos_N[self.regroup_N] = torch.arange(self.regroup_N.numel())
        self.from_src_seg = _segments([self.pairs_SS[s][me] for s in range(size)])

    def _choose_paths(self, row_bytes: int) -> None:
        """Peers of Phase I, remote nodes of Phase II and the gateways' sources (or direct)."""
        topo, size, node = self.topo, self.owner.size, self.my_node
        node_pair_bytes = [
            row_bytes * self._pairs_to_node(s, b)
            for s in range(size)
            for b in range(topo.num_nodes)
            if b != topo.node_of[s]
        ]
        self.direct = max(node_pair_bytes, default=0) < self.owner.direct_below_bytes
        self.dedup = self.owner.dedup and not self.direct
        local = range(size) if self.direct else topo.members_of_node[node]
        self.node_peers = [r for r in local if r != self.me]
        self.remote_nodes = [] if self.direct else [b for b in range(topo.num_nodes) if b != node]
        # srcs_via[gw]: remote sources whose Phase II rows for my node go to gateway gw.
        self.srcs_via = {gw: [] for gw in topo.members_of_node[node]}
        for src in range(size):
            if not self.direct and topo.node_of[src] != node:
                self.srcs_via[topo.gateway(src, node)].append(src)

    # ---- sizes and p2p helpers -------------------------------------------------------------

    def _pairs_to_node(self, src: int, node: int) -> int:
        return sum(self.pairs_SS[src][r] for r in self.topo.members_of_node[node])

    def _forwarded_rows(self, src: int, node: int, unique: bool) -> int:
        """Rows of src's Phase II message to `node` that its gateway forwards (sent first)."""
        if unique:
            return self.forwarded_unique_SN[src][node]
        return sum(self.pairs_SS[src][r] for r in self._member_order(src, node)[:-1])

    def _seg_at_gateway(self, src: int, dst: int) -> tuple[int, int]:
        """Pair positions of src -> dst inside src's message to my node (member order)."""
        order = self._member_order(src, self.my_node)
        return _segments([self.pairs_SS[src][r] for r in order])[order.index(dst)]

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
            return self._forward(lambda pos: x_TD[tok[pos]], x_TD)
        return self._forward(
            lambda pos: x_TD[tok[pos]],
            x_TD,
            pack=lambda b: x_TD[self.unique_tokens[b]],
            send_index=True,
        )

    def forward_pairs(self, x_PD: Tensor) -> Tensor:
        """Backward of combine: one row per (token, choice)."""
        return self._forward(lambda pos: x_PD[self.order_P[pos]], x_PD)

    def _forward(self, rows_at, like, pack=None, send_index=False, expand=None, extra=None):
        """Phases I + II, then III; returns rows grouped by (local expert, source).

        rows_at(pos): rows of sorted pairs `pos`. pack(b): the Phase II message to node b
        (default: the rows of its pairs), indexed per pair by the pack index. expand(src,
        message): pair rows from a whole message (then Phase III waits for all of it).
        extra(ops): adds ops to the Phase III batch.
        """
        if self.direct:
            return self._all_to_all(rows_at(slice(None)), forward=True)[self.regroup_N]
        me, node = self.me, self.my_node
        ops_i: list = []
        from_peer: dict[int, Tensor] = {}
        for peer in self.node_peers:  # Phase I
            self._send(ops_i, rows_at(slice(*self.seg_of_dest[peer])), peer, _TAG_I)
            from_peer[peer] = self._recv(ops_i, self.pairs_SS[peer][me], like, peer, _TAG_I)
        ops_fwd: list = []
        ops_own: list = []
        for b in self.remote_nodes:  # Phase II: per remote node, forwarded rows first
            gw = self.topo.gateway(me, b)
            message = pack(b) if pack else rows_at(self.rows_to_node[b])
            first = self._forwarded_rows(me, b, pack is not None)
            if send_index:
                self._send(ops_fwd, self.pack_index[b], gw, _TAG_II_INDEX)
            self._send(ops_fwd, message[:first], gw, _TAG_II)
            self._send(ops_own, message[first:], gw, _TAG_II_OWN)
        fwd, own = {}, {}
        for src in self.srcs_via[me]:
            pairs = self._pairs_to_node(src, node)
            total = self.unique_SN[src][node] if pack else pairs
            first = self._forwarded_rows(src, node, pack is not None)
            if send_index:
                index_like = torch.zeros(0, dtype=torch.long, device=self.device)
                self.gateway_index[src] = self._recv(ops_fwd, pairs, index_like, src, _TAG_II_INDEX)
            fwd[src] = self._recv(ops_fwd, first, like, src, _TAG_II)
            own[src] = self._recv(ops_own, total - first, like, src, _TAG_II_OWN)
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
        out_ND = like.new_empty((self.regroup_N.numel(), *like.shape[1:]))
        for src, (a, b) in enumerate(self.from_src_seg):
            if src == me:
                rows = rows_at(slice(*self.seg_of_dest[me]))
            else:
                rows = from_peer[src] if src in from_peer else relayed[src]
            out_ND[self.out_pos_N[a:b]] = rows
        return out_ND

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
            for s, (a, b) in zip(self.srcs_via[gw], _segments(counts), strict=True):
                relayed[s] = bufs[gw][a:b]
        return relayed

    def _piece(self, message: Tensor, src: int, dst: int, unique: bool) -> Tensor:
        """Rows of src's Phase II message to my node for rank dst (copies tokens if unique)."""
        a, b = self._seg_at_gateway(src, dst)
        return message[self.gateway_index[src][a:b]] if unique else message[a:b]

    def _own_index(self, src: int) -> Tensor:
        """Positions, in src's unique-token message, of the rows for my own experts."""
        a, b = self._seg_at_gateway(src, self.me)
        return self.gateway_index[src][a:b]

    @staticmethod
    def _gather_two(first: Tensor, second: Tensor, index: Tensor) -> Tensor:
        """cat([first, second])[index] without building the concatenation."""
        out = first.new_empty((index.numel(), *first.shape[1:]))
        in_first = index < first.shape[0]
        out[in_first] = first[index[in_first]]
        out[~in_first] = second[index[~in_first] - first.shape[0]]
        return out

    # ---- reverse: experts -> sources -------------------------------------------------------

    def reverse(self, y_ND: Tensor) -> Tensor:
        """Combine (unweighted) / backward of dispatch: rows [P, D] in (token, choice) order."""
        if self.direct:
            by_src_ND = torch.empty_like(y_ND)
            by_src_ND[self.regroup_N] = y_ND
            sorted_PD = self._all_to_all(by_src_ND, forward=False)
            y_PD = torch.empty_like(sorted_PD)
            y_PD[self.order_P] = sorted_PD
            return y_PD
        local, from_fwd, from_own = self._reverse(y_ND)
        y_PD = y_ND.new_empty((self.order_P.numel(), *y_ND.shape[1:]))
        for peer, rows in local.items():
            y_PD[self.order_P[slice(*self.seg_of_dest[peer])]] = rows
        for b in self.remote_nodes:  # member order: forwarded ranks' rows, then the gateway's
            pos_P = self.order_P[self.rows_to_node[b]]
            first = from_fwd[b].shape[0]
            y_PD[pos_P[:first]] = from_fwd[b]
            y_PD[pos_P[first:]] = from_own[b]
        return y_PD

    def _reverse(self, y_ND: Tensor, weight_P: Tensor | None = None):
        """Reverse I, III and the gateways' own rows at once, then reverse II.

        Returns (pair rows from my node's ranks, by rank; per remote node the rows its gateway
        forwarded (with weight_P: one gate-weighted sum per unique token); per remote node the
        gateway's own rows (none with weight_P)); both in member order.
        """
        me, size, weighted = self.me, self.owner.size, weight_P is not None
        by_src_ND = torch.empty_like(y_ND)
        by_src_ND[self.regroup_N] = y_ND
        seg = _segments([self.pairs_SS[s][me] for s in range(size)])
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
            own_rows = 0 if weighted else self.pairs_SS[me][gw]
            rows = self.unique_SN[me][b] if weighted else self._pairs_to_node(me, b) - own_rows
            from_fwd[b] = self._recv(ops_early, rows, y_ND, gw, _TAG_II)
            from_own[b] = self._recv(ops_early, own_rows, y_ND, gw, _TAG_II_OWN)
        if weighted:
            weights = self._exchange_weights(ops_iii, weight_P)
        else:  # as a gateway, my own rows for each source go back at once
            for s in self.srcs_via[me]:
                self._send(ops_early, by_src_ND[slice(*seg[s])], s, _TAG_II_OWN)
        works_early = self._post(ops_early)
        self._wait(self._post(ops_iii))
        ops_ii: list = []
        for s, rows_RD in self._regather(at_gateway, y_ND).items():  # reverse Phase II
            if weighted:
                rows_RD = torch.cat([rows_RD, by_src_ND[slice(*seg[s])]])
                rows_RD = self._gateway_sum(s, rows_RD, weights[s])
            self._send(ops_ii, rows_RD, s, _TAG_II)
        self._wait(self._post(ops_ii) + works_early)
        return local, from_fwd, from_own

    def _regather(self, at_gateway: dict[int, Tensor], like: Tensor) -> dict[int, Tensor]:
        """As a gateway: each remote source's rows from the other ranks of my node, in that
        source's member order (my own rows, last in that order, are not included)."""
        me, node, srcs = self.me, self.my_node, self.srcs_via[self.me]
        per_dst = {d: _segments([self.pairs_SS[s][d] for s in srcs]) for d in at_gateway}
        return {
            src: self._cat(
                [
                    at_gateway[dst][slice(*per_dst[dst][i])]
                    for dst in self._member_order(src, node)
                    if dst != me
                ],
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
        rows straight to their final ranks in one round (latency-bound sizes); 0 = never.
    """

    def __init__(
        self,
        group=None,
        ranks_per_node: int | None = None,
        dedup: bool = False,
        direct_below_bytes: int = DEFAULT_DIRECT_BELOW_BYTES,
    ) -> None:
        super().__init__(group, ranks_per_node)
        self.dedup = dedup
        self.direct_below_bytes = direct_below_bytes

    def _exchange(
        self, expert_TK: Tensor, rank_of_expert_E: Tensor, row_bytes: int, device: torch.device
    ) -> Exchange:
        return _HaloExchange(self, expert_TK, rank_of_expert_E, row_bytes, device)
