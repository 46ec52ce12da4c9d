"""HALO: hierarchical, locality-optimized all-to-all behind the TokenDispatcher protocol.

For EP ranks (node n, local j):
  Phase I   rows for ranks on my own node go there directly (intra-node p2p).
  Phase II  rows for each remote node n' are packed into one message and sent to my rail peer
            (n', j) (the node's "gateway" for me, runtime/dispatch/topology.py), so a pair of
            nodes exchanges g large messages instead of g * g small ones.
  Phase III each gateway forwards the rows it received to their final ranks on its node.
Phase I runs concurrently with Phase II -> Phase III (asynchronous batched p2p). With
`dedup=True`, a token with several of its top-k experts on one remote node crosses the network
once in the dispatch and is copied by the gateway in Phase III. The reverse exchange (combine,
backward of dispatch) retraces the same path with one row per (token, choice).

`combine(..., weight_TK=gates)` returns the gate-weighted sum over K; with dedup the gateway
sums a token's weighted expert outputs from its node, so that direction also crosses the
network once per (token, node) (backward likewise: one gradient row per (token, node) goes
out, the gate gradients come back as scalars).

Each dispatch is preparation, then communication. Preparation (runtime/dispatch/halo_plan.py)
builds a frozen HaloPlan from this rank's routing and one counts round that gives every rank
the full traffic matrix, and with it the path (runtime/dispatch/halo_cost.py): below
`direct_below_bytes` per node-pair message, or when the relay cannot pay, every rank decides
the same way to send rows straight to their final ranks in one round, like the flat
all-to-all. Communication executes that plan: runtime/dispatch/halo_phases.py (the phases)
and runtime/dispatch/halo_weighted.py (the gate-weighted combine).

Shape letters as in runtime/dispatch/base.py (T, K, D, E, L, N, P = T * K, S ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch import halo_phases, halo_weighted
from runtime.dispatch.base import EPGroup, Exchange, take_rows
from runtime.dispatch.dispatcher import ExchangeDispatcher
from runtime.dispatch.halo_cost import DEFAULT_DIRECT_BELOW_BYTES, HaloCost
from runtime.dispatch.halo_plan import HaloOptions, HaloPlan, plan_halo


class HaloExchange:
    """One routing decision's HALO exchange: its frozen plan, executed on the EP group.

    `gateway_index` holds, per remote source whose gateway I am, the pack index that source
    sent beside its unique-token message; the dedup dispatch fills it, the weighted combine
    and its backward read it.
    """

    def __init__(self, plan: HaloPlan, ep: EPGroup) -> None:
        self.plan, self.ep = plan, ep
        self.num_tokens, self.topk = plan.num_tokens, plan.topk
        self.tokens_per_local_expert_L = plan.tokens_per_local_expert_L
        self.gateway_index: dict[int, Tensor] = {}

    @property
    def direct(self) -> bool:
        """Whether this exchange sends every row straight to its rank in one round."""
        return self.plan.direct

    @property
    def reduces_weighted(self) -> bool:
        """Whether combine(weight_TK) sums on the remote node (dedup, not direct)."""
        return self.plan.dedup

    def forward_tokens(self, x_TD: Tensor) -> Tensor:
        """Dispatch: token rows (one per (token, node) across nodes with dedup)."""
        plan, tok = self.plan, self.plan.token_sorted_P
        if not plan.dedup:
            return halo_phases.forward(plan, self.ep, lambda pos: take_rows(x_TD, tok[pos]), x_TD)
        return halo_phases.forward(
            plan,
            self.ep,
            lambda pos: take_rows(x_TD, tok[pos]),
            x_TD,
            pack=lambda b: take_rows(x_TD, plan.unique_tokens[b]),
            gateway_index=self.gateway_index,
        )

    def forward_pairs(self, x_PD: Tensor) -> Tensor:
        """Backward of combine: one row per (token, choice)."""
        order_P = self.plan.order_P
        return halo_phases.forward(
            self.plan, self.ep, lambda pos: take_rows(x_PD, order_P[pos]), x_PD
        )

    def reverse(self, y_ND: Tensor) -> Tensor:
        """Combine (unweighted) / backward of dispatch: rows [P, D] in (token, choice) order."""
        return halo_phases.reverse(self.plan, self.ep, y_ND)

    def reverse_weighted(
        self, y_ND: Tensor, weight_TK: Tensor
    ) -> tuple[Tensor, halo_weighted.WeightedSums]:
        """Gate-weighted combine y_TD [T, D], gateways summing per node; and its saved sums."""
        return halo_weighted.reverse_weighted(
            self.plan, self.ep, self.gateway_index, y_ND, weight_TK
        )

    def backward_weighted(
        self, grad_TD: Tensor, saved: halo_weighted.WeightedSums
    ) -> tuple[Tensor, Tensor]:
        """Gradients of reverse_weighted: (grad of expert rows [N, D], grad of gates [T, K])."""
        return halo_weighted.backward_weighted(
            self.plan, self.ep, self.gateway_index, saved, grad_TD
        )


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
        self.options = HaloOptions(dedup, direct_below_bytes, cost)

    def _exchange(
        self, expert_TK: Tensor, rank_of_expert_E: Tensor, row_bytes: int, device: torch.device
    ) -> Exchange:
        ep = self.ep
        plan = plan_halo(
            expert_TK,
            rank_of_expert_E,
            ep.topo,
            ep.me,
            self._gather_counts,
            self.options,
            row_bytes,
            device,
        )
        return HaloExchange(plan, ep)

    def _gather_counts(self, mine: Tensor) -> Tensor:
        """Every rank's `mine` (int64 [C]) as a table [S, C], in one all_to_all round
        (gloo's all_gather is a ring of S - 1 steps)."""
        ep, size = self.ep, self.ep.size
        table = ep.meta(torch.empty(size * mine.numel(), dtype=torch.long))
        dist.all_to_all_single(table, ep.meta(mine.repeat(size)), group=ep.group)
        for peer in range(size):
            ep.count(peer, 8 * mine.numel())
        return table.cpu().reshape(size, mine.numel())
