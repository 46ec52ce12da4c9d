"""LocalDispatcher: the TokenDispatcher of one rank that holds every expert.

Shape letters as in runtime/dispatch/base.py (T, K, D, E, N, P = T * K).
"""

from __future__ import annotations

import torch

from runtime.dispatch.base import DispatchStats


class LocalDispatcher:
    """TokenDispatcher for one rank holding every expert: a stable sort by expert id."""

    def __init__(self) -> None:
        self.stats = DispatchStats()

    def dispatch(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, rank_of_expert_E):
        num_experts = len(rank_of_expert_E)
        flat = expert_TK.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        x_ND = x_TD[order // expert_TK.shape[1]]
        return x_ND, counts, (order, expert_TK.shape)

    def combine(self, y_ND: torch.Tensor, handle, weight_TK=None) -> torch.Tensor:
        order, (t, k) = handle
        y = torch.empty((t * k, y_ND.shape[1]), dtype=y_ND.dtype, device=y_ND.device)
        y_TKD = y.index_copy(0, order, y_ND).view(t, k, y_ND.shape[1])
        if weight_TK is None:
            return y_TKD
        return (y_TKD * weight_TK.to(y_TKD.dtype)[:, :, None]).sum(dim=1)
