"""Routing over expert slots: a replicated expert's (token, choice) rows split over its copies.

The MoE layer routes each (token, choice) pair to a global slot instead of an expert
(slot s of EP rank r is g = offset_R[r] + s, ranks in order) and hands the dispatcher slot
ids where it would hand expert ids, with `rank_of_slot_G` as the routing table: every
dispatcher moves rows to slots exactly as it moves them to experts, so replicas change no
exchange (runtime/dispatch/base.py). An expert held once has one slot. A replicated expert's
n pairs on this rank, in (token, choice) order, split into contiguous runs, one per copy
(copies by rank), by systematic sampling: copy j takes positions [b_j, b_{j+1}) with
b_j = floor(n C_j + u), C_j the summed shares of copies 0..j-1 and u = (source + 1/2) / R
for this source rank of R. Each copy gets n x share rounded down or up, the rounding
differs between source ranks, so over the group a copy's rows stay within R/2 of its share.
The split is a function of this rank's routing and the table only: deterministic, and no
rank needs another's choice.

Shape letters: T tokens, K top-k, P = T * K pairs, E experts, C the most copies of one
expert, G slots of the EP group, R its ranks.
"""

from __future__ import annotations

import torch

from planner.run.spec import ExpertSlots


class SlotRouter:
    """The routing tables of one slot table, built once per table (CPU tensors).

    Args:
        table: slot table in EP group ranks. num_experts: E.
    """

    def __init__(self, table: ExpertSlots, num_experts: int) -> None:
        rows = table.slots_RS
        offsets = [sum(len(r) for r in rows[:i]) for i in range(len(rows))]
        self.ranks = len(rows)
        self.rank_of_slot_G = torch.tensor([r for r, row in enumerate(rows) for _ in row])
        copies = [table.holders(e) for e in range(num_experts)]
        width = max(len(c) for c in copies)
        self.slot_EC = torch.zeros(num_experts, width, dtype=torch.long)
        self.cum_EC = torch.full((num_experts, max(width - 1, 0)), torch.inf, dtype=torch.float64)
        for e, held in enumerate(copies):
            slots = [offsets[r] + s for r, s in held]
            self.slot_EC[e] = torch.tensor(slots + slots[-1:] * (width - len(slots)))
            shares = torch.tensor([table.share_RS[r][s] for r, s in held], dtype=torch.float64)
            self.cum_EC[e, : len(held) - 1] = shares.cumsum(0)[:-1]

    def route(self, expert_TK: torch.Tensor, source: int) -> torch.Tensor:
        """Global slot of each (token, choice) pair [T, K], on expert_TK's device.

        source: this rank's place in the EP group (the u of the module doc)."""
        expert_P = expert_TK.reshape(-1).long().cpu()
        if self.cum_EC.shape[1] == 0:  # no replicas: each expert's one slot
            return self.slot_EC[expert_P, 0].view_as(expert_TK).to(expert_TK.device)
        num_experts = self.slot_EC.shape[0]
        order_P = torch.sort(expert_P, stable=True).indices
        counts_E = torch.bincount(expert_P, minlength=num_experts)
        starts_E = counts_E.cumsum(0) - counts_E
        pos_P = torch.empty_like(expert_P)
        pos_P[order_P] = torch.arange(expert_P.numel()) - starts_E[expert_P[order_P]]
        n_P = counts_E[expert_P].double()
        u = (source + 0.5) / self.ranks
        bound_PC = torch.floor(n_P[:, None] * self.cum_EC[expert_P] + u)
        copy_P = (bound_PC <= pos_P[:, None]).sum(dim=1)
        slot_P = self.slot_EC[expert_P, copy_P]
        return slot_P.view_as(expert_TK).to(expert_TK.device)
