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

Sizes are known everywhere before any payload moves: one all_gather of each rank's per-expert
row counts (and per-node unique-token counts) gives every rank the full traffic matrix.

Shape letters as in runtime/dispatch.py (T, K, D, E, L, N, P = T * K, S ranks); R rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch import Exchange, ExchangeDispatcher, block_transpose_index, sort_pairs

_TAG_I, _TAG_II, _TAG_II_INDEX, _TAG_III = 11, 12, 13, 14


def _segments(counts: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive blocks with the given sizes."""
    out, start = [], 0
    for count in counts:
        out.append((start, start + count))
        start += count
    return out


class _HaloExchange:
    """The three-phase exchange for one routing decision (see module docstring)."""

    def __init__(self, owner: Halo, expert_TK: Tensor, rank_of_expert_E: Tensor) -> None:
        topo, size, me = owner.topo, owner.size, owner.rank
        self.owner, self.topo, self.me = owner, topo, me
        self.dedup = owner.dedup
        self.num_tokens, self.topk = expert_TK.shape
        self.order_P, counts_E, counts_S = sort_pairs(expert_TK, rank_of_expert_E, size)
        self.my_node = topo.node_of[me]
        self.seg_of_dest = _segments(counts_S.tolist())
        token_sorted_P = self.order_P // self.topk
        # Sorted-pair positions bound for each node (its ranks ascending), and unique tokens.
        self.rows_to_node: list[Tensor] = []
        self.unique_tokens: list[Tensor] = []
        self.pack_index: list[Tensor] = []
        for members in topo.members_of_node:
            rows = torch.cat(
                [torch.arange(*self.seg_of_dest[r]) for r in members]
                or [torch.zeros(0, dtype=torch.long)]
            )
            self.rows_to_node.append(rows)
            uniq, inverse = torch.unique(token_sorted_P[rows], sorted=True, return_inverse=True)
            self.unique_tokens.append(uniq)
            self.pack_index.append(inverse)
        unique_N = torch.tensor([u.numel() for u in self.unique_tokens], dtype=torch.long)
        self._gather_counts(torch.cat([counts_E, unique_N]), rank_of_expert_E)

    def _gather_counts(self, mine: Tensor, rank_of_expert_E: Tensor) -> None:
        """All-gathers per-expert and per-node counts; derives every phase's sizes."""
        topo, size, me, owner = self.topo, self.owner.size, self.me, self.owner
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=owner.group)
        for peer in range(size):
            owner.stats.add_bytes(topo, me, peer, 8 * mine.numel())
        num_experts = rank_of_expert_E.numel()
        table = torch.stack(every)
        counts_SE, self.unique_SN = table[:, :num_experts], table[:, num_experts:].tolist()
        pairs_SS = torch.zeros(size, size, dtype=torch.long)
        pairs_SS.index_add_(1, rank_of_expert_E, counts_SE)
        self.pairs_SS = pairs_SS.tolist()
        local_E = rank_of_expert_E == me
        counts_SL = counts_SE[:, local_E]
        self.regroup_N = block_transpose_index(counts_SL)
        self.tokens_per_local_expert_L = counts_SL.sum(dim=0)
        node = self.my_node
        self.node_peers = [r for r in topo.members_of_node[node] if r != me]
        self.remote_nodes = [b for b in range(topo.num_nodes) if b != node]
        # srcs_via[gw]: remote sources whose Phase II rows for my node go to gateway gw.
        self.srcs_via = {gw: [] for gw in topo.members_of_node[node]}
        for src in range(size):
            if topo.node_of[src] != node:
                self.srcs_via[topo.gateway(src, node)].append(src)

    # ---- helpers -------------------------------------------------------------------------

    def _pairs_to_node(self, src: int, node: int) -> int:
        return sum(self.pairs_SS[src][r] for r in self.topo.members_of_node[node])

    def _post(self, ops: list) -> list:
        return dist.batch_isend_irecv(ops) if ops else []

    def _send(self, ops: list, tensor: Tensor, peer: int, tag: int) -> None:
        if tensor.numel() == 0:
            return
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), self._g(peer), tag=tag))
        self.owner.stats.add_bytes(self.topo, self.me, peer, tensor.numel() * tensor.element_size())

    def _recv(self, ops: list, rows: int, like: Tensor, peer: int, tag: int) -> Tensor:
        buf = like.new_empty((rows, *like.shape[1:]))
        if rows:
            ops.append(dist.P2POp(dist.irecv, buf, self._g(peer), tag=tag))
        return buf

    def _g(self, group_rank: int) -> int:
        return self.topo.global_ranks[group_rank]

    # ---- forward: sources -> experts -------------------------------------------------------

    def forward_tokens(self, x_TD: Tensor) -> Tensor:
        return self._forward(x_TD, self.order_P // self.topk, dedup=self.dedup)

    def forward_pairs(self, x_PD: Tensor) -> Tensor:
        return self._forward(x_PD, self.order_P, dedup=False)

    def _forward(self, x_RD: Tensor, source_row_P: Tensor, dedup: bool) -> Tensor:
        me, node, topo = self.me, self.my_node, self.topo
        ops_i: list = []
        from_peer: dict[int, Tensor] = {}
        for peer in self.node_peers:  # Phase I
            self._send(ops_i, x_RD[source_row_P[slice(*self.seg_of_dest[peer])]], peer, _TAG_I)
            rows = self.pairs_SS[peer][me]
            from_peer[peer] = self._recv(ops_i, rows, x_RD, peer, _TAG_I)
        ops_ii: list = []
        packs: dict[int, Tensor] = {}
        indices: dict[int, Tensor] = {}
        for b in self.remote_nodes:  # Phase II: one packed message per remote node
            gw = topo.gateway(me, b)
            if dedup:
                self._send(ops_ii, x_RD[self.unique_tokens[b]], gw, _TAG_II)
                self._send(ops_ii, self.pack_index[b], gw, _TAG_II_INDEX)
            else:
                self._send(ops_ii, x_RD[source_row_P[self.rows_to_node[b]]], gw, _TAG_II)
        index_like = torch.zeros(0, dtype=torch.long)
        for src in self.srcs_via[me]:
            pairs = self._pairs_to_node(src, node)
            rows = self.unique_SN[src][node] if dedup else pairs
            packs[src] = self._recv(ops_ii, rows, x_RD, src, _TAG_II)
            if dedup:
                indices[src] = self._recv(ops_ii, pairs, index_like, src, _TAG_II_INDEX)
        works_i = self._post(ops_i)
        for work in self._post(ops_ii):
            work.wait()
        relayed = self._phase_iii(packs, indices, x_RD)
        for work in works_i:
            work.wait()
        pieces = []
        for src in range(self.owner.size):
            if src == me:
                pieces.append(x_RD[source_row_P[slice(*self.seg_of_dest[me])]])
            elif topo.node_of[src] == node:
                pieces.append(from_peer[src])
            else:
                pieces.append(relayed[src])
        return torch.cat(pieces)[self.regroup_N]

    def _phase_iii(self, packs: dict, indices: dict, like: Tensor) -> dict[int, Tensor]:
        """Gateway forwards packed rows to their final ranks; returns rows relayed to me by src."""
        me, node = self.me, self.my_node
        members = self.topo.members_of_node[node]
        full = {s: packs[s][indices[s]] if s in indices else packs[s] for s in packs}
        ops: list = []
        bufs: dict[int, Tensor] = {}
        for dst in members:  # as a gateway
            parts = [self._piece(full[s], s, dst) for s in self.srcs_via[me]]
            data = torch.cat(parts) if parts else like.new_empty((0, *like.shape[1:]))
            if dst == me:
                bufs[me] = data
            else:
                self._send(ops, data, dst, _TAG_III)
        for gw in members:  # as a final destination
            if gw != me:
                rows = sum(self.pairs_SS[s][me] for s in self.srcs_via[gw])
                bufs[gw] = self._recv(ops, rows, like, gw, _TAG_III)
        for work in self._post(ops):
            work.wait()
        relayed: dict[int, Tensor] = {}
        for gw in members:
            counts = [self.pairs_SS[s][me] for s in self.srcs_via[gw]]
            for s, (a, b) in zip(self.srcs_via[gw], _segments(counts), strict=True):
                relayed[s] = bufs[gw][a:b]
        return relayed

    def _piece(self, full_RD: Tensor, src: int, dst: int) -> Tensor:
        """Rows of src's packed (pair-ordered) message for my node that go to rank dst."""
        members = self.topo.members_of_node[self.my_node]
        segs = _segments([self.pairs_SS[src][r] for r in members])
        return full_RD[slice(*segs[members.index(dst)])]

    # ---- reverse: experts -> sources -------------------------------------------------------

    def reverse(self, y_ND: Tensor) -> Tensor:
        me, node, topo, size = self.me, self.my_node, self.topo, self.owner.size
        by_src_ND = torch.empty_like(y_ND)
        by_src_ND[self.regroup_N] = y_ND
        seg = _segments([self.pairs_SS[s][me] for s in range(size)])
        ops_i: list = []
        back: dict[int, Tensor] = {}
        for peer in self.node_peers:  # reverse Phase I
            self._send(ops_i, by_src_ND[slice(*seg[peer])], peer, _TAG_I)
            back[peer] = self._recv(ops_i, self.pairs_SS[me][peer], y_ND, peer, _TAG_I)
        ops_iii: list = []
        at_gateway: dict[int, Tensor] = {}
        for gw in topo.members_of_node[node]:  # reverse Phase III: to the gateway of each src
            parts = [by_src_ND[slice(*seg[s])] for s in self.srcs_via[gw]]
            data = torch.cat(parts) if parts else y_ND.new_empty((0, *y_ND.shape[1:]))
            if gw == me:
                at_gateway[me] = data
            else:
                self._send(ops_iii, data, gw, _TAG_III)
        for dst in self.node_peers:
            rows = sum(self.pairs_SS[s][dst] for s in self.srcs_via[me])
            at_gateway[dst] = self._recv(ops_iii, rows, y_ND, dst, _TAG_III)
        works_i = self._post(ops_i)
        for work in self._post(ops_iii):
            work.wait()
        ops_ii: list = []
        for src, rows_RD in self._regather(at_gateway, y_ND).items():  # reverse Phase II
            self._send(ops_ii, rows_RD, src, _TAG_II)
        from_node: dict[int, Tensor] = {}
        for b in self.remote_nodes:
            rows = self._pairs_to_node(me, b)
            from_node[b] = self._recv(ops_ii, rows, y_ND, topo.gateway(me, b), _TAG_II)
        for work in self._post(ops_ii) + works_i:
            work.wait()
        sorted_PD = y_ND.new_empty((self.order_P.numel(), *y_ND.shape[1:]))
        sorted_PD[slice(*self.seg_of_dest[me])] = by_src_ND[slice(*seg[me])]
        for peer in self.node_peers:
            sorted_PD[slice(*self.seg_of_dest[peer])] = back[peer]
        for b in self.remote_nodes:
            sorted_PD[self.rows_to_node[b]] = from_node[b]
        y_PD = torch.empty_like(sorted_PD)
        y_PD[self.order_P] = sorted_PD
        return y_PD

    def _regather(self, at_gateway: dict[int, Tensor], like: Tensor) -> dict[int, Tensor]:
        """As a gateway: rebuilds each remote source's pair-ordered rows from my node's ranks."""
        members = self.topo.members_of_node[self.my_node]
        srcs = self.srcs_via[self.me]
        per_dst = {dst: _segments([self.pairs_SS[s][dst] for s in srcs]) for dst in members}
        out = {}
        for i, src in enumerate(srcs):
            parts = [at_gateway[dst][slice(*per_dst[dst][i])] for dst in members]
            out[src] = torch.cat(parts) if parts else like.new_empty((0, *like.shape[1:]))
        return out


class Halo(ExchangeDispatcher):
    """Hierarchical three-phase all-to-all dispatcher (HALO), optionally deduplicated.

    Args:
      group: the EP process group (None = default group); every member calls each method.
      ranks_per_node: ranks per (emulated) node; a member's node is its GLOBAL rank // this
        (default: LOCAL_WORLD_SIZE, else the whole world is one node).
      dedup: send a token once per remote node even when several of its experts live there.
    """

    def __init__(self, group=None, ranks_per_node: int | None = None, dedup: bool = False):
        super().__init__(group, ranks_per_node)
        self.dedup = dedup

    def _exchange(self, expert_TK: Tensor, rank_of_expert_E: Tensor, dim: int) -> Exchange:
        return _HaloExchange(self, expert_TK, rank_of_expert_E)
