"""HALO's path decision: one direct round or three phases, from the exchange's traffic matrix.

Every rank of the EP group knows the same traffic matrix after the counts round, so every
rank takes the same decision without another message. Below `direct_below_bytes` per
node-pair message (latency-bound sizes) the rows go straight to their ranks. Above it, with
a HaloCost, an alpha-beta estimate of both paths decides; without one, the structural rule:
dedup sends fewer rows across nodes; without it the bytes crossing nodes are the same, and
the relay saves messages only with more than two nodes (a rank posts 2 (g - 1) + (Q - 1)
messages instead of Q g - 1, (Q - 2)(g - 1) fewer), so two nodes, or one rank per node, gain
nothing for the hop.

Shape letters: S ranks of the EP group, Q nodes it spans, E experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.dispatch.topology import GroupTopology

# Below this many bytes per node-pair message, one direct round beats two hops (the crossover
# measured on the emulated network of benchmarks/halo_emulated.py; see runtime/HALO.md).
DEFAULT_DIRECT_BELOW_BYTES = 1 << 20


@dataclass(frozen=True)
class HaloTraffic:
    """The rows of one exchange between every two ranks (identical on every rank).

    Attributes:
      topo: node layout of the EP group.
      pairs_SS: rows rank s sends to rank d [S, S] (int64).
      to_node_SQ: rows rank s sends to node q, its own node's column 0 [S, Q] (int64).
      unique_SQ: with dedup, unique tokens rank s sends to node q [S, Q] (int64); None
        without dedup.
    """

    topo: GroupTopology
    pairs_SS: Tensor
    to_node_SQ: Tensor
    unique_SQ: Tensor | None = None

    @property
    def largest_node_pair_rows(self) -> int:
        """Rows of the largest message from one rank to another node."""
        return int(self.to_node_SQ.max()) if self.to_node_SQ.numel() else 0


def halo_traffic(
    topo: GroupTopology, counts_SE: Tensor, rank_of_expert_E: Tensor, unique_SQ: Tensor | None
) -> HaloTraffic:
    """The HaloTraffic of every rank's pairs per expert.

    Args:
      topo: node layout of the EP group.
      counts_SE: pairs rank s routes to expert e [S, E] (int64).
      rank_of_expert_E: EP rank of each expert [E].
      unique_SQ: unique tokens per (rank, node) with dedup [S, Q], else None.
    """
    size = topo.size
    pairs_SS = torch.zeros(size, size, dtype=torch.long)
    pairs_SS.index_add_(1, rank_of_expert_E, counts_SE)
    node_S = node_tensors(topo)[0]
    to_node_SQ = torch.zeros(size, topo.num_nodes, dtype=torch.long)
    to_node_SQ.index_add_(1, node_S, pairs_SS)
    to_node_SQ[torch.arange(size), node_S] = 0
    return HaloTraffic(topo, pairs_SS, to_node_SQ, unique_SQ)


@dataclass(frozen=True)
class HaloCost:
    """Alpha-beta costs with which HALO chooses between one direct round and three phases.

    Attributes:
      message_s: cost of one message at the sender (software + latency), seconds.
      intra_gbps: one rank's send (and receive) bandwidth to ranks of its node, GB/s.
      node_link_gbps: one node's link to the network, per direction, GB/s (shared by its
        ranks).

    Both estimates take the exact traffic matrix of the exchange: the busiest rank's messages
    x message_s, plus the slowest of its intra-node bytes and the busiest node link; the
    three phases add the gateways' relays after Phase II. Dedup counts unique rows across
    nodes.
    """

    message_s: float
    intra_gbps: float
    node_link_gbps: float

    def direct_s(self, traffic: HaloTraffic, row_bytes: int) -> float:
        """One all-to-all round, every row straight to its rank."""
        pairs, same = traffic.pairs_SS, node_tensors(traffic.topo)[1]
        off_diag = ~torch.eye(pairs.shape[0], dtype=torch.bool)
        msgs = int(((pairs > 0) & off_diag).sum(dim=1).max())
        intra = int((pairs * (same & off_diag)).sum(dim=1).max())
        link = _busiest_node_link(traffic.topo, traffic.to_node_SQ)
        return msgs * self.message_s + max(
            intra * row_bytes / (self.intra_gbps * 1e9),
            link * row_bytes / (self.node_link_gbps * 1e9),
        )

    def three_phase_s(self, traffic: HaloTraffic, row_bytes: int) -> float:
        """Phase I beside Phase II, then the gateways' Phase III relays."""
        pairs = traffic.pairs_SS
        _, same, gateway_SS = node_tensors(traffic.topo)
        size = pairs.shape[0]
        off_diag = ~torch.eye(size, dtype=torch.bool)
        phase_i = ((pairs > 0) & same & off_diag).sum(dim=1)
        phase_ii = (traffic.to_node_SQ > 0).sum(dim=1)
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
        to_node = traffic.to_node_SQ
        if traffic.unique_SQ is not None:
            to_node = traffic.unique_SQ * (traffic.to_node_SQ > 0)
        link = _busiest_node_link(traffic.topo, to_node)
        intra_s = 1.0 / (self.intra_gbps * 1e9)
        return msgs * self.message_s + max(
            intra * row_bytes * intra_s,
            link * row_bytes / (self.node_link_gbps * 1e9) + relay * row_bytes * intra_s,
        )


def takes_direct_path(
    traffic: HaloTraffic, row_bytes: int, direct_below_bytes: int, cost: HaloCost | None
) -> bool:
    """Whether the exchange sends every row straight to its rank in one round.

    Args:
      traffic: the exchange's traffic matrix (unique_SQ set when dedup is on).
      row_bytes: bytes of one row (D x element size).
      direct_below_bytes: the largest node-pair message below this goes direct; 0 = never
        direct (always three phases, whatever `cost` says).
      cost: the cluster's HaloCost, or None for the structural rule (module docstring).
    """
    if direct_below_bytes <= 0:
        return False
    if row_bytes * traffic.largest_node_pair_rows < direct_below_bytes:
        return True
    return not _relay_pays(traffic, row_bytes, cost)


def _relay_pays(traffic: HaloTraffic, row_bytes: int, cost: HaloCost | None) -> bool:
    """Whether the three phases should beat one direct round (module docstring)."""
    if cost is not None:
        return cost.three_phase_s(traffic, row_bytes) < cost.direct_s(traffic, row_bytes)
    if traffic.unique_SQ is not None:
        return True
    topo = traffic.topo
    most = max((len(m) for m in topo.members_of_node), default=1)
    return topo.num_nodes > 2 and most > 1


@functools.lru_cache(maxsize=64)
def node_tensors(topo: GroupTopology) -> tuple[Tensor, Tensor, Tensor]:
    """node of each rank [S]; same-node mask [S, S]; gateway_SS[s, d]: the rank on d's node
    that receives s's Phase II rows for that node. They depend on the group only, so every
    dispatch of a dispatcher shares them."""
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


def _busiest_node_link(topo: GroupTopology, to_node_SQ: Tensor) -> int:
    """Rows the busiest node sends to, or receives from, other nodes (own-node column 0)."""
    node_S = node_tensors(topo)[0]
    sent_Q = torch.zeros(topo.num_nodes, dtype=torch.long).index_add_(
        0, node_S, to_node_SQ.sum(dim=1)
    )
    received_Q = to_node_SQ.sum(dim=0)
    return int(torch.maximum(sent_Q, received_Q).max()) if sent_Q.numel() else 0
