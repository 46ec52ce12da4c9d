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

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch import Exchange, ExchangeDispatcher, block_transpose_index, sort_pairs

_TAG_I, _TAG_II, _TAG_II_INDEX, _TAG_III, _TAG_WEIGHT = 11, 12, 13, 14, 15
DEFAULT_DIRECT_BELOW_BYTES = 0


def _segments(counts: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive blocks with the given sizes."""
    out, start = [], 0
    for count in counts:
        out.append((start, start + count))
        start += count
    return out


class _HaloExchange:
    """The three-phase exchange for one routing decision (see module docstring)."""

    def __init__(
        self, owner: Halo, expert_TK: Tensor, rank_of_expert_E: Tensor, row_bytes: int, device
    ) -> None:
        topo, size, me = owner.topo, owner.size, owner.rank
        self.owner, self.topo, self.me, self.my_node = owner, topo, me, topo.node_of[me]
        self.num_tokens, self.topk = expert_TK.shape
        self.order_P, counts_E, counts_S = sort_pairs(expert_TK, rank_of_expert_E, size)
        self.seg_of_dest = _segments(counts_S.tolist())
        self.token_sorted_P = self.order_P // self.topk
        # Sorted-pair positions bound for each node (its ranks ascending), and unique tokens.
        self.rows_to_node: list[Tensor] = []
        self.unique_tokens: list[Tensor] = []
        self.pack_index: list[Tensor] = []
        for members in topo.members_of_node:
            rows = torch.cat(
                [torch.arange(*self.seg_of_dest[r]) for r in members]
                or [torch.zeros(0, dtype=torch.long)]
            )
            uniq, inverse = torch.unique(
                self.token_sorted_P[rows], sorted=True, return_inverse=True
            )
            self.rows_to_node.append(rows)
            self.unique_tokens.append(uniq)
            self.pack_index.append(inverse)
        unique_N = torch.tensor([u.numel() for u in self.unique_tokens], dtype=torch.long)
        self._gather_counts(torch.cat([counts_E, unique_N]), rank_of_expert_E)
        self._choose_paths(row_bytes)
        self.gateway_index: dict[int, Tensor] = {}  # src -> pack index (dedup, as a gateway)
        self.saved: dict = {}  # weighted combine: what its backward needs
        self._to_device(device)

    def _to_device(self, device: torch.device) -> None:
        """Moves the index tensors next to the data (planning above ran on the CPU)."""
        self.device = device
        for name in ("order_P", "token_sorted_P", "regroup_N", "tokens_per_local_expert_L"):
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
        num_experts = rank_of_expert_E.numel()
        table = table.cpu().reshape(size, mine.numel())
        counts_SE, self.unique_SN = table[:, :num_experts], table[:, num_experts:].tolist()
        pairs_SS = torch.zeros(size, size, dtype=torch.long)
        pairs_SS.index_add_(1, rank_of_expert_E, counts_SE)
        self.pairs_SS = pairs_SS.tolist()
        counts_SL = counts_SE[:, rank_of_expert_E == me]
        self.regroup_N = block_transpose_index(counts_SL)
        self.tokens_per_local_expert_L = counts_SL.sum(dim=0)

    def _choose_paths(self, row_bytes: int) -> None:
        """Peers of Phase I, remote nodes of Phase II and the gateways' sources (or direct)."""
        topo, size, node = self.topo, self.owner.size, self.my_node
        node_pair_bytes = [
            row_bytes * sum(self.pairs_SS[s][r] for r in topo.members_of_node[b])
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

    # ---- p2p helpers -----------------------------------------------------------------------

    def _pairs_to_node(self, src: int, node: int) -> int:
        return sum(self.pairs_SS[src][r] for r in self.topo.members_of_node[node])

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
    def _cat(parts: list[Tensor], like: Tensor) -> Tensor:
        return torch.cat(parts) if parts else like.new_empty((0, *like.shape[1:]))

    # ---- forward: sources -> experts -------------------------------------------------------

    def forward_tokens(self, x_TD: Tensor) -> Tensor:
        """Dispatch: token rows (one per (token, node) across nodes with dedup)."""
        tok = self.token_sorted_P
        if not self.dedup:
            return self._forward(lambda pos: x_TD[tok[pos]], x_TD, self._expand_plain)
        return self._forward(
            lambda pos: x_TD[tok[pos]],
            x_TD,
            lambda src, pack: pack[self.gateway_index[src]],
            pack=lambda b: x_TD[self.unique_tokens[b]],
            send_index=True,
        )

    def forward_pairs(self, x_PD: Tensor) -> Tensor:
        """Backward of combine: one row per (token, choice)."""
        return self._forward(lambda pos: x_PD[self.order_P[pos]], x_PD, self._expand_plain)

    @staticmethod
    def _expand_plain(src: int, pack: Tensor) -> Tensor:
        return pack

    def _forward(self, rows_at, like, expand, pack=None, send_index=False, extra=None) -> Tensor:
        """Phases I + II, then III; returns rows grouped by (local expert, source).

        rows_at(pos) gives the rows of sorted pairs `pos`; pack(b) the Phase II message for node
        b (default: rows_at of its pairs); expand(src, message) turns a gateway's message into
        pair-ordered rows; extra(ops) may add ops to the Phase III batch.
        """
        me, node = self.me, self.my_node
        ops_i: list = []
        from_peer: dict[int, Tensor] = {}
        for peer in self.node_peers:  # Phase I
            self._send(ops_i, rows_at(slice(*self.seg_of_dest[peer])), peer, _TAG_I)
            from_peer[peer] = self._recv(ops_i, self.pairs_SS[peer][me], like, peer, _TAG_I)
        ops_ii: list = []
        for b in self.remote_nodes:  # Phase II: one packed message per remote node
            gw = self.topo.gateway(me, b)
            self._send(ops_ii, pack(b) if pack else rows_at(self.rows_to_node[b]), gw, _TAG_II)
            if send_index:
                self._send(ops_ii, self.pack_index[b], gw, _TAG_II_INDEX)
        packs, indices = {}, {}
        for src in self.srcs_via[me]:
            pairs = self._pairs_to_node(src, node)
            rows = self.unique_SN[src][node] if pack else pairs
            packs[src] = self._recv(ops_ii, rows, like, src, _TAG_II)
            if send_index:
                index_like = torch.zeros(0, dtype=torch.long, device=self.device)
                indices[src] = self._recv(ops_ii, pairs, index_like, src, _TAG_II_INDEX)
        works_i = self._post(ops_i)
        for work in self._post(ops_ii):
            work.wait()
        self.gateway_index.update(indices)
        full = {src: expand(src, packs[src]) for src in packs}
        relayed = self._phase_iii(full, like, extra)
        for work in works_i:
            work.wait()
        pieces = []
        for src in range(self.owner.size):
            if src == me:
                pieces.append(rows_at(slice(*self.seg_of_dest[me])))
            else:
                pieces.append(from_peer[src] if src in from_peer else relayed[src])
        return torch.cat(pieces)[self.regroup_N]

    def _phase_iii(self, full: dict, like: Tensor, extra=None) -> dict[int, Tensor]:
        """Gateway forwards pair rows to their final ranks; returns rows relayed to me by src."""
        me, members = self.me, self.topo.members_of_node[self.my_node]
        ops: list = []
        bufs: dict[int, Tensor] = {}
        for dst in members:  # as a gateway
            data = self._cat([self._piece(full[s], s, dst) for s in self.srcs_via[me]], like)
            if dst == me:
                bufs[me] = data
            else:
                self._send(ops, data, dst, _TAG_III)
        for gw in members:  # as a final destination
            if gw != me:
                rows = sum(self.pairs_SS[s][me] for s in self.srcs_via[gw])
                bufs[gw] = self._recv(ops, rows, like, gw, _TAG_III)
        if extra:
            extra(ops)
        for work in self._post(ops):
            work.wait()
        relayed: dict[int, Tensor] = {}
        for gw in members:
            counts = [self.pairs_SS[s][me] for s in self.srcs_via[gw]]
            for s, (a, b) in zip(self.srcs_via[gw], _segments(counts), strict=True):
                relayed[s] = bufs[gw][a:b]
        return relayed

    def _piece(self, full_RD: Tensor, src: int, dst: int) -> Tensor:
        """Rows of src's pair-ordered message for my node that go to rank dst."""
        members = self.topo.members_of_node[self.my_node]
        segs = _segments([self.pairs_SS[src][r] for r in members])
        return full_RD[slice(*segs[members.index(dst)])]

    # ---- reverse: experts -> sources -------------------------------------------------------

    def reverse(self, y_ND: Tensor) -> Tensor:
        """Combine (unweighted) / backward of dispatch: rows [P, D] in (token, choice) order."""
        local, from_node = self._reverse(y_ND)
        sorted_PD = y_ND.new_empty((self.order_P.numel(), *y_ND.shape[1:]))
        for peer, rows in local.items():
            sorted_PD[slice(*self.seg_of_dest[peer])] = rows
        for b in self.remote_nodes:
            sorted_PD[self.rows_to_node[b]] = from_node[b]
        y_PD = torch.empty_like(sorted_PD)
        y_PD[self.order_P] = sorted_PD
        return y_PD

    def _reverse(self, y_ND: Tensor, weight_P: Tensor | None = None):
        """Reverse I with III, then II. Returns (pair rows from my node's ranks by rank,
        rows from each remote node: pair rows, or per-token weighted sums if weight_P)."""
        me, node, size = self.me, self.my_node, self.owner.size
        by_src_ND = torch.empty_like(y_ND)
        by_src_ND[self.regroup_N] = y_ND
        seg = _segments([self.pairs_SS[s][me] for s in range(size)])
        ops_i: list = []
        local = {me: by_src_ND[slice(*seg[me])]}
        for peer in self.node_peers:  # reverse Phase I
            self._send(ops_i, by_src_ND[slice(*seg[peer])], peer, _TAG_I)
            local[peer] = self._recv(ops_i, self.pairs_SS[me][peer], y_ND, peer, _TAG_I)
        ops_iii: list = []
        at_gateway: dict[int, Tensor] = {}
        for gw in self.topo.members_of_node[node]:  # reverse Phase III, to each src's gateway
            data = self._cat([by_src_ND[slice(*seg[s])] for s in self.srcs_via[gw]], y_ND)
            if gw == me:
                at_gateway[me] = data
            else:
                self._send(ops_iii, data, gw, _TAG_III)
        for dst in self.node_peers:
            rows = sum(self.pairs_SS[s][dst] for s in self.srcs_via[me])
            at_gateway[dst] = self._recv(ops_iii, rows, y_ND, dst, _TAG_III)
        weights = self._exchange_weights(ops_iii, weight_P) if weight_P is not None else {}
        works_i = self._post(ops_i)
        for work in self._post(ops_iii):
            work.wait()
        ops_ii: list = []
        for src, rows_RD in self._regather(at_gateway, y_ND).items():  # reverse Phase II
            if weight_P is not None:
                rows_RD = self._gateway_sum(src, rows_RD, weights[src])
            self._send(ops_ii, rows_RD, src, _TAG_II)
        from_node: dict[int, Tensor] = {}
        for b in self.remote_nodes:
            rows = self.unique_SN[me][b] if weight_P is not None else self._pairs_to_node(me, b)
            from_node[b] = self._recv(ops_ii, rows, y_ND, self.topo.gateway(me, b), _TAG_II)
        for work in self._post(ops_ii) + works_i:
            work.wait()
        return local, from_node

    def _regather(self, at_gateway: dict[int, Tensor], like: Tensor) -> dict[int, Tensor]:
        """As a gateway: rebuilds each remote source's pair-ordered rows from my node's ranks."""
        members = self.topo.members_of_node[self.my_node]
        srcs = self.srcs_via[self.me]
        per_dst = {dst: _segments([self.pairs_SS[s][dst] for s in srcs]) for dst in members}
        return {
            src: self._cat([at_gateway[dst][slice(*per_dst[dst][i])] for dst in members], like)
            for i, src in enumerate(srcs)
        }

    # ---- gate-weighted combine with per-node reduction (dedup) -----------------------------

    @property
    def reduces_weighted(self) -> bool:
        """Whether combine(weight_TK) sums on the remote node (dedup, not direct)."""
        return self.dedup

    def reverse_weighted(self, y_ND: Tensor, weight_TK: Tensor) -> Tensor:
        """y_TD = sum_k weight_TK[t, k] * (expert output of (t, k)); gateways pre-sum per node."""
        weight_P = weight_TK.reshape(-1)[self.order_P].to(y_ND.dtype)
        local, from_node = self._reverse(y_ND, weight_P)
        ranks = sorted(local)
        positions = [torch.arange(*self.seg_of_dest[r], device=self.device) for r in ranks]
        local_pos = self._cat(positions, self.order_P)
        local_rows = self._cat([local[r] for r in ranks], y_ND)
        y_TD = y_ND.new_zeros((self.num_tokens, y_ND.shape[1]))
        y_TD.index_add_(0, self.token_sorted_P[local_pos], local_rows * weight_P[local_pos, None])
        for b in self.remote_nodes:
            y_TD.index_add_(0, self.unique_tokens[b], from_node[b])
        self.saved.update(weight_P=weight_P, local_pos=local_pos, local_rows=local_rows)
        return y_TD

    def _exchange_weights(self, ops: list, weight_P: Tensor) -> dict[int, Tensor]:
        """Sources send the gates of their pairs to each remote gateway; returns mine by src."""
        for b in self.remote_nodes:
            gw = self.topo.gateway(self.me, b)
            self._send(ops, weight_P[self.rows_to_node[b]], gw, _TAG_WEIGHT)
        return {
            src: self._recv(ops, self._pairs_to_node(src, self.my_node), weight_P, src, _TAG_WEIGHT)
            for src in self.srcs_via[self.me]
        }

    def _gateway_sum(self, src: int, rows_RD: Tensor, weight_R: Tensor) -> Tensor:
        """As a gateway: one weighted-sum row per unique token of src (saved for backward)."""
        self.saved.setdefault("gateway_rows", {})[src] = rows_RD
        self.saved.setdefault("gateway_weight", {})[src] = weight_R
        partial = rows_RD.new_zeros((self.unique_SN[src][self.my_node], rows_RD.shape[1]))
        return partial.index_add_(0, self.gateway_index[src], rows_RD * weight_R[:, None])

    def backward_weighted(self, grad_TD: Tensor) -> tuple[Tensor, Tensor]:
        """Gradients of reverse_weighted: (grad of expert rows [N, D], grad of gates [T, K])."""
        tok, saved = self.token_sorted_P, self.saved
        weight_P, rows_by_src = saved["weight_P"], saved.get("gateway_rows", {})
        grad_weight: dict[int, Tensor] = {}
        from_node: dict[int, Tensor] = {}

        def expand(src: int, pack: Tensor) -> Tensor:
            grad_RD = pack[self.gateway_index[src]]
            grad_weight[src] = (grad_RD * rows_by_src[src]).sum(dim=1)
            return grad_RD * saved["gateway_weight"][src][:, None]

        def extra(ops: list) -> None:  # gate gradients go back to their sources with Phase III
            for src in self.srcs_via[self.me]:
                self._send(ops, grad_weight[src], src, _TAG_WEIGHT)
            for b in self.remote_nodes:
                rows, gw = self._pairs_to_node(self.me, b), self.topo.gateway(self.me, b)
                from_node[b] = self._recv(ops, rows, weight_P, gw, _TAG_WEIGHT)

        grad_ND = self._forward(
            lambda pos: grad_TD[tok[pos]] * weight_P[pos, None],
            grad_TD,
            expand,
            pack=lambda b: grad_TD[self.unique_tokens[b]],
            extra=extra,
        )
        grad_weight_sorted_P = weight_P.new_empty(weight_P.shape)
        local_pos = saved["local_pos"]
        grad_weight_sorted_P[local_pos] = (grad_TD[tok[local_pos]] * saved["local_rows"]).sum(1)
        for b in self.remote_nodes:
            grad_weight_sorted_P[self.rows_to_node[b]] = from_node[b]
        grad_weight_P = torch.empty_like(grad_weight_sorted_P)
        grad_weight_P[self.order_P] = grad_weight_sorted_P
        return grad_ND, grad_weight_P.reshape(self.num_tokens, self.topk)


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
