"""Routing plan of one HALO exchange: which rows go where, in which order, how many.

Built on every rank of the EP group from its own routing and one exchange of counts, so all
ranks agree on every message size before any payload moves. runtime/dispatch/halo.py moves the rows.

Per (source rank, remote node), the source's pairs for that node are ordered by "member
order": the node's ranks ascending, except the source's gateway there, which comes last, so
the gateway can forward the first part of the message before the rest has arrived. With
dedup, the message holds unique tokens: those any non-gateway rank needs first.

Shape letters as in runtime/dispatch/flat.py (T, K, E, L, N, P = T * K, S ranks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch.flat import BlockTranspose, sort_pairs
from runtime.dispatch.topology import GroupTopology


def segments(counts: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive blocks with the given sizes."""
    out, start = [], 0
    for count in counts:
        out.append((start, start + count))
        start += count
    return out


@dataclass(frozen=True)
class HaloCost:
    """Alpha-beta costs with which HALO chooses between one direct round and three phases.

    Attributes:
      message_s: cost of one message at the sender (software + latency), seconds.
      intra_gbps: one rank's send (and receive) bandwidth to ranks of its node, GB/s.
      node_link_gbps: one node's link to the network, per direction, GB/s (shared by its
        ranks).

    Both estimates take the exact traffic matrix of the exchange (every rank knows it): the
    busiest rank's messages x message_s, plus the slowest of its intra-node bytes and the
    busiest node link; the three phases add the gateways' relays after Phase II. Dedup counts
    unique rows across nodes.
    """

    message_s: float
    intra_gbps: float
    node_link_gbps: float

    def direct_s(self, plan: HaloPlan, row_bytes: int) -> float:
        """One all-to-all round, every row straight to its rank."""
        pairs, same, _ = _tensors(plan)
        off_diag = ~torch.eye(pairs.shape[0], dtype=torch.bool)
        msgs = int(((pairs > 0) & off_diag).sum(dim=1).max())
        intra = int((pairs * (same & off_diag)).sum(dim=1).max())
        link = _busiest_node_link(plan, plan.to_node_SQ)
        return msgs * self.message_s + max(
            intra * row_bytes / (self.intra_gbps * 1e9),
            link * row_bytes / (self.node_link_gbps * 1e9),
        )

    def three_phase_s(self, plan: HaloPlan, row_bytes: int) -> float:
        """Phase I beside Phase II, then the gateways' Phase III relays."""
        pairs, same, gateway_SS = _tensors(plan)
        size = pairs.shape[0]
        off_diag = ~torch.eye(size, dtype=torch.bool)
        phase_i = ((pairs > 0) & same & off_diag).sum(dim=1)
        phase_ii = (plan.to_node_SQ > 0).sum(dim=1)
        # relay_SD[g, d]: rows gateway g forwards to d, from the sources that reach d's node
        # through g (other nodes' ranks; not d's own rows when d is the gateway itself)
        relayed = ~same & (gateway_SS != torch.arange(size)[None, :])
        relay_SD = torch.zeros(size, size, dtype=torch.long)
        relay_SD.index_put_(
            (gateway_SS[relayed], torch.nonzero(relayed)[:, 1]), pairs[relayed], accumulate=True
        )
        msgs = int((phase_i + phase_ii + (relay_SD > 0).sum(dim=1)).max())
        intra = int((pairs * (same & off_diag)).sum(dim=1).max())
        relay = int(relay_SD.sum(dim=1).max())
        to_node = plan.to_node_SQ
        if plan.owner.dedup:
            to_node = torch.tensor(plan.unique_SN, dtype=torch.long) * (plan.to_node_SQ > 0)
        link = _busiest_node_link(plan, to_node)
        intra_s = 1.0 / (self.intra_gbps * 1e9)
        return msgs * self.message_s + max(
            intra * row_bytes * intra_s,
            link * row_bytes / (self.node_link_gbps * 1e9) + relay * row_bytes * intra_s,
        )


def _tensors(plan: HaloPlan) -> tuple[Tensor, Tensor, Tensor]:
    """pairs [S, S]; same-node mask [S, S]; gateway_SS[s, d]: the rank on d's node that
    receives s's Phase II rows for that node."""
    _, same, gateway_SS = _topology_tensors(plan.topo)
    return torch.tensor(plan.pairs_SS, dtype=torch.long), same, gateway_SS


@functools.lru_cache(maxsize=64)
def _topology_tensors(topo: GroupTopology) -> tuple[Tensor, Tensor, Tensor]:
    """node of each rank [S]; same-node mask [S, S]; gateway_SS [S, S]. They depend on the
    group only, so every dispatch of a dispatcher shares them."""
    node_S = torch.tensor(topo.node_of, dtype=torch.long)
    local_S = torch.tensor(topo.local_of, dtype=torch.long)
    count_Q = torch.tensor([len(m) for m in topo.members_of_node], dtype=torch.long)
    width = int(count_Q.max())
    member_QJ = torch.full((topo.num_nodes, width), -1, dtype=torch.long)
    for q, members in enumerate(topo.members_of_node):
        member_QJ[q, : len(members)] = torch.tensor(members, dtype=torch.long)
    dst_node = node_S[None, :].expand(len(node_S), -1)
    slot = local_S[:, None] % count_Q[dst_node]
    gateway_SS = member_QJ[dst_node, slot]
    same = node_S[:, None] == node_S[None, :]
    return node_S, same, gateway_SS


def _busiest_node_link(plan: HaloPlan, to_node_SQ: Tensor) -> int:
    """Rows the busiest node sends to, or receives from, other nodes (own-node column 0)."""
    node_S = _topology_tensors(plan.topo)[0]
    sent_Q = torch.zeros(plan.topo.num_nodes, dtype=torch.long).index_add_(
        0, node_S, to_node_SQ.sum(dim=1)
    )
    received_Q = to_node_SQ.sum(dim=0)
    return int(torch.maximum(sent_Q, received_Q).max()) if sent_Q.numel() else 0


class HaloPlan:
    """Sizes and index tensors of one routing decision (base of the HALO exchange)."""

    def __init__(
        self, owner, expert_TK: Tensor, rank_of_expert_E: Tensor, row_bytes: int, device
    ) -> None:
        topo, size, me = owner.topo, owner.size, owner.rank
        self.owner, self.topo, self.me, self.my_node = owner, topo, me, topo.node_of[me]
        self.num_tokens, self.topk = expert_TK.shape
        self.order_P, counts_E, counts_S = sort_pairs(expert_TK, rank_of_expert_E, size)
        self.seg_of_dest = segments(counts_S.tolist())
        self.token_sorted_P = self.order_P // self.topk
        # The pack plan needs only my routing, so the unique-token counts per node (dedup)
        # travel in the same round as the per-expert counts: one metadata round per dispatch.
        mine = [counts_E]
        if owner.dedup:
            self._pack_plan(dedup=True)
            mine.append(torch.tensor([u.numel() for u in self.unique_tokens], dtype=torch.long))
            mine.append(torch.tensor(self.forwarded_unique, dtype=torch.long))
        table = self._all_gather(torch.cat(mine))
        num_experts, num_nodes = counts_E.numel(), self.topo.num_nodes
        self._traffic(table[:, :num_experts], rank_of_expert_E)
        if owner.dedup:
            self.unique_SN = table[:, num_experts : num_experts + num_nodes].tolist()
            self.forwarded_unique_SN = table[:, num_experts + num_nodes :].tolist()
        self._choose_paths(row_bytes)
        if self.direct:  # only the three phases use the pack plan
            self._no_pack_plan()
        elif not owner.dedup:
            self._pack_plan(dedup=False)
        self.gateway_index: dict[int, Tensor] = {}  # src -> pack index (dedup, as a gateway)
        self.saved: dict = {}  # weighted combine: what its backward needs
        self._to_device(device)

    def _member_order(self, src: int, node: int) -> list[int]:
        """Ranks of `node` in the order src packs their rows: its gateway there last."""
        gw = self.topo.gateway(src, node)
        return [m for m in self.topo.members_of_node[node] if m != gw] + [gw]

    def _no_pack_plan(self) -> None:
        self.rows_to_node, self.unique_tokens, self.pack_index = [], [], []
        self.forwarded_unique = []

    def _pack_plan(self, dedup: bool) -> None:
        """Per other node: sorted-pair positions in member order; with dedup also its unique
        tokens (those the gateway forwards first) and each pair's position among them."""
        self.rows_to_node, self.unique_tokens, self.pack_index = [], [], []
        self.forwarded_unique: list[int] = []
        empty = torch.zeros(0, dtype=torch.long)
        for node in range(self.topo.num_nodes):
            if node == self.my_node:
                for plan in (self.rows_to_node, self.unique_tokens, self.pack_index):
                    plan.append(empty)
                self.forwarded_unique.append(0)
                continue
            order = self._member_order(self.me, node)
            fwd = torch.cat([torch.arange(*self.seg_of_dest[r]) for r in order[:-1]] + [empty])
            own = torch.arange(*self.seg_of_dest[order[-1]])
            rows = torch.cat([fwd, own])
            self.rows_to_node.append(rows)
            if not dedup:
                self.unique_tokens.append(empty)
                self.pack_index.append(empty)
                self.forwarded_unique.append(0)
                continue
            tokens_fwd = torch.unique(self.token_sorted_P[fwd])
            tokens_own = torch.unique(self.token_sorted_P[own])
            tokens_own = tokens_own[~torch.isin(tokens_own, tokens_fwd)]
            uniq = torch.cat([tokens_fwd, tokens_own])
            position_T = torch.full((self.num_tokens,), -1, dtype=torch.long)
            position_T[uniq] = torch.arange(uniq.numel())
            self.unique_tokens.append(uniq)
            self.pack_index.append(position_T[self.token_sorted_P[rows]])
            self.forwarded_unique.append(tokens_fwd.numel())

    def _to_device(self, device: torch.device) -> None:
        """Moves the index tensors next to the data (planning above ran on the CPU)."""
        self.device = device
        names = ("order_P", "token_sorted_P", "tokens_per_local_expert_L")
        for name in names:
            setattr(self, name, getattr(self, name).to(device))
        for name in ("rows_to_node", "unique_tokens", "pack_index"):
            setattr(self, name, [t.to(device) for t in getattr(self, name)])

    def _all_gather(self, mine: Tensor) -> Tensor:
        """Every rank's `mine` (int64 [C]) as a table [S, C], in one all_to_all round
        (gloo's all_gather is a ring of S - 1 steps)."""
        owner, size = self.owner, self.owner.size
        table = owner.meta(torch.empty(size * mine.numel(), dtype=torch.long))
        dist.all_to_all_single(table, owner.meta(mine.repeat(size)), group=owner.group)
        for peer in range(size):
            owner.stats.add_bytes(self.topo, self.me, peer, 8 * mine.numel())
        return table.cpu().reshape(size, mine.numel())

    def _traffic(self, counts_SE: Tensor, rank_of_expert_E: Tensor) -> None:
        """Pairs between every two ranks, and how my received rows regroup by expert."""
        size, me = self.owner.size, self.me
        pairs_SS = torch.zeros(size, size, dtype=torch.long)
        pairs_SS.index_add_(1, rank_of_expert_E, counts_SE)
        self.pairs_SS = pairs_SS.tolist()
        # rows each source sends to each other node (its own node's column zeroed)
        node_of_S = _topology_tensors(self.topo)[0]
        to_node_SQ = torch.zeros(size, self.topo.num_nodes, dtype=torch.long)
        to_node_SQ.index_add_(1, node_of_S, pairs_SS)
        to_node_SQ[torch.arange(size), node_of_S] = 0
        self.to_node_SQ = to_node_SQ
        self.largest_node_pair_rows = int(to_node_SQ.max()) if to_node_SQ.numel() else 0
        counts_SL = counts_SE[:, rank_of_expert_E == me]
        self.regroup = BlockTranspose(counts_SL)  # received rows: (source, expert) blocks
        self.tokens_per_local_expert_L = counts_SL.sum(dim=0)

    def _choose_paths(self, row_bytes: int) -> None:
        """Peers of Phase I, remote nodes of Phase II and the gateways' sources (or direct)."""
        topo, size, node = self.topo, self.owner.size, self.my_node
        threshold = self.owner.direct_below_bytes
        self.direct = threshold > 0 and (
            row_bytes * self.largest_node_pair_rows < threshold or not self._relay_pays(row_bytes)
        )
        self.dedup = self.owner.dedup and not self.direct
        local = range(size) if self.direct else topo.members_of_node[node]
        self.node_peers = [r for r in local if r != self.me]
        self.remote_nodes = [] if self.direct else [b for b in range(topo.num_nodes) if b != node]
        # srcs_via[gw]: remote sources whose Phase II rows for my node go to gateway gw.
        self.srcs_via = {gw: [] for gw in topo.members_of_node[node]}
        for src in range(size):
            if not self.direct and topo.node_of[src] != node:
                self.srcs_via[topo.gateway(src, node)].append(src)

    def _relay_pays(self, row_bytes: int) -> bool:
        """Whether the three phases should beat one direct round.

        With a HaloCost (owner.cost), by its estimate of both on this exchange's exact
        traffic. Without one, structurally: dedup sends fewer rows across nodes; without it
        the bytes crossing nodes are the same, and the relay saves messages only with more
        than two nodes (a rank posts 2 (g - 1) + (Q - 1) messages instead of Q g - 1,
        (Q - 2)(g - 1) fewer), so two nodes gain nothing for the hop."""
        cost = getattr(self.owner, "cost", None)
        if cost is not None:
            return cost.three_phase_s(self, row_bytes) < cost.direct_s(self, row_bytes)
        if self.owner.dedup:
            return True
        most = max((len(m) for m in self.topo.members_of_node), default=1)
        return self.topo.num_nodes > 2 and most > 1

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
        return segments([self.pairs_SS[src][r] for r in order])[order.index(dst)]
