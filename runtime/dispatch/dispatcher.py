"""ExchangeDispatcher: a TokenDispatcher that prepares one Exchange per routing, then moves rows.

`dispatch` checks its inputs, asks its subclass for the Exchange of this routing (the
preparation: pair order, counts, paths) and runs it under autograd functions whose backward
is the opposite exchange. `combine` reuses that Exchange through the DispatchHandle.

Shape letters as in runtime/dispatch/base.py (T, K, D, N, P = T * K).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.dispatch.base import (
    DispatchHandle,
    DispatchStats,
    EPGroup,
    Exchange,
    default_ranks_per_node,
)
from runtime.dispatch.topology import topology_of_group


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, exchange, stats):
        ctx.exchange, ctx.stats = exchange, stats
        start = time.perf_counter()
        out = exchange.forward_tokens(x_TD)
        stats.dispatch_s += time.perf_counter() - start
        return out

    @staticmethod
    def backward(ctx, grad_ND):
        start = time.perf_counter()
        ex = ctx.exchange
        grad_PD = ex.reverse(grad_ND.contiguous())
        grad_TD = grad_PD.reshape(ex.num_tokens, ex.topk, grad_PD.shape[1]).sum(dim=1)
        ctx.stats.dispatch_s += time.perf_counter() - start
        return grad_TD, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, exchange, stats):
        ctx.exchange, ctx.stats = exchange, stats
        start = time.perf_counter()
        y_PD = exchange.reverse(y_ND)
        stats.combine_s += time.perf_counter() - start
        return y_PD.reshape(exchange.num_tokens, exchange.topk, y_PD.shape[1])

    @staticmethod
    def backward(ctx, grad_TKD):
        start = time.perf_counter()
        ex = ctx.exchange
        grad_ND = ex.forward_pairs(
            grad_TKD.reshape(ex.num_tokens * ex.topk, grad_TKD.shape[2]).contiguous()
        )
        ctx.stats.combine_s += time.perf_counter() - start
        return grad_ND, None, None


class _WeightedCombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, weight_TK, exchange, stats):
        ctx.exchange, ctx.stats, ctx.weight_dtype = exchange, stats, weight_TK.dtype
        start = time.perf_counter()
        y_TD, ctx.saved = exchange.reverse_weighted(y_ND, weight_TK)
        stats.combine_s += time.perf_counter() - start
        return y_TD

    @staticmethod
    def backward(ctx, grad_TD):
        start = time.perf_counter()
        grad_ND, grad_weight_TK = ctx.exchange.backward_weighted(grad_TD.contiguous(), ctx.saved)
        ctx.stats.combine_s += time.perf_counter() - start
        return grad_ND, grad_weight_TK.to(ctx.weight_dtype), None, None


class ExchangeDispatcher:
    """TokenDispatcher built from an Exchange factory (subclasses define `_exchange`).

    Args:
      group: the EP process group (None = default group).
      ranks_per_node: ranks per (emulated) node; a member's node is its GLOBAL rank // this
        (default: LOCAL_WORLD_SIZE, else the whole world is one node).
    """

    def __init__(self, group=None, ranks_per_node: int | None = None) -> None:
        rpn = ranks_per_node or default_ranks_per_node() or dist.get_world_size()
        self.stats = DispatchStats()
        # Collectives on NCCL groups need CUDA tensors; index planning stays on the CPU.
        on_nccl = dist.get_backend(group) == "nccl"
        self.ep = EPGroup(
            group=group,
            topo=topology_of_group(group, rpn),
            me=dist.get_rank(group),
            stats=self.stats,
            meta_device=torch.device("cuda", torch.cuda.current_device()) if on_nccl else None,
        )

    def _exchange(
        self, expert_TK: Tensor, rank_of_expert_E: Tensor, row_bytes: int, device: torch.device
    ) -> Exchange:
        raise NotImplementedError

    def dispatch(
        self, x_TD: Tensor, expert_TK: Tensor, rank_of_expert_E: Tensor
    ) -> tuple[Tensor, Tensor, DispatchHandle]:
        """See TokenDispatcher.dispatch."""
        if x_TD.dim() != 2 or expert_TK.dim() != 2 or expert_TK.shape[0] != x_TD.shape[0]:
            raise ValueError(
                f"dispatch: x_TD {tuple(x_TD.shape)} and expert_TK {tuple(expert_TK.shape)} "
                "must be [T, D] and [T, K]"
            )
        start = time.perf_counter()
        rank_of_expert_E = rank_of_expert_E.long().cpu()
        size = self.ep.size
        if (
            rank_of_expert_E.numel()
            and not 0 <= int(rank_of_expert_E.min()) <= int(rank_of_expert_E.max()) < size
        ):
            raise ValueError(f"dispatch: rank_of_expert_E must lie in [0, {size})")
        row_bytes = x_TD.shape[1] * x_TD.element_size()
        expert_TK = expert_TK.long().cpu()
        exchange = self._exchange(expert_TK, rank_of_expert_E, row_bytes, x_TD.device)
        self.stats.dispatch_s += time.perf_counter() - start
        out_ND = _DispatchFn.apply(x_TD.contiguous(), exchange, self.stats)
        return out_ND, exchange.tokens_per_local_expert_L, DispatchHandle(exchange)

    def combine(
        self, expert_output_ND: Tensor, handle: DispatchHandle, weight_TK: Tensor | None = None
    ) -> Tensor:
        """See TokenDispatcher.combine."""
        exchange = handle.exchange
        if weight_TK is not None and exchange.reduces_weighted:
            y_ND = expert_output_ND.contiguous()
            return _WeightedCombineFn.apply(y_ND, weight_TK, exchange, self.stats)
        y_TKD = _CombineFn.apply(expert_output_ND.contiguous(), exchange, self.stats)
        if weight_TK is None:
            return y_TKD
        return (y_TKD * weight_TK.to(y_TKD.dtype)[:, :, None]).sum(dim=1)
