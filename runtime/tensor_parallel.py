"""Tensor parallelism (Megatron-style) for attention and the dense / shared-expert MLPs.

Within a tensor-parallel (TP) group of `size` ranks, every rank holds the same activations
between blocks. Attention splits its query and key/value heads over the group (column
parallel q, k, v; row parallel o) and an MLP splits its hidden width (column parallel up and
gate; row parallel down). Two autograd functions carry the collectives (Megatron's f and g):
`copy_to` is the identity forward and an all-reduce of the gradient backward; `reduce_from`
all-reduces the partial outputs forward and passes the gradient through backward.

The MoE block does not split its experts (expert TP = 1). Instead each TP rank routes and
dispatches its own 1/size of the tokens (`split_tokens`: a slice forward, an all-gather of
the gradient backward) and the results are all-gathered again (`gather_tokens`), so the
expert-parallel group sees every token of the data-parallel replica exactly once.

Weights are built whole from the layer's seeded generator and then sliced, so a TP run
starts from the same model as a single-device run. Shape letters: T = tokens, D = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class TPGroup:
    """This rank's tensor-parallel group: `ranks` are physical ranks in plan order."""

    group: object
    ranks: list[int]
    index: int  # my position in `ranks` (the plan's tp_idx)
    counter: object = None  # runtime.metrics.ByteCounter: TP bytes counted as kind "tp"

    @property
    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, index: int) -> int:
        """Rank inside the process group (sorted physical order) of plan position `index`."""
        return sorted(self.ranks).index(self.ranks[index])

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=self.group)
        if self.counter is not None:
            self.counter.add_allreduce("tp", x.numel() * x.element_size(), self.ranks)
        return x

    def all_gather_rows(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's rows (rank i holds sizes[i] rows) in plan order."""
        width = max(sizes)
        pad = x.new_zeros((width, *x.shape[1:]))
        pad[: x.shape[0]] = x
        parts = [torch.empty_like(pad) for _ in self.ranks]
        dist.all_gather(parts, pad, group=self.group)
        if self.counter is not None:
            nbytes = pad.numel() * pad.element_size()
            for peer in self.ranks:
                if peer != self.ranks[self.index]:
                    self.counter.add("tp", nbytes, peer)
        by_plan = [parts[self.group_rank(i)][: sizes[i]] for i in range(self.size)]
        return torch.cat(by_plan)


def chunk_sizes(rows: int, parts: int) -> list[int]:
    """Rows of each TP rank's token slice (the first rows % parts ranks take one more)."""
    return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, tp):
        sizes = chunk_sizes(x_TD.shape[0], tp.size)
        ctx.tp, ctx.sizes = tp, sizes
        start = sum(sizes[: tp.index])
        return x_TD[start : start + sizes[tp.index]].clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather_rows(grad.contiguous(), ctx.sizes), None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, tp, rows):
        sizes = chunk_sizes(rows, tp.size)
        ctx.tp, ctx.sizes = tp, sizes
        return tp.all_gather_rows(x_TD.contiguous(), sizes)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[: ctx.tp.index])
        return grad[start : start + ctx.sizes[ctx.tp.index]], None, None


def copy_to(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """Enter a column-parallel region (identity; the gradient is summed over the group)."""
    return x if tp is None or tp.size == 1 else _CopyTo.apply(x, tp)


def reduce_from(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """Leave a row-parallel region: sum the partial outputs over the group."""
    return x if tp is None or tp.size == 1 else _ReduceFrom.apply(x, tp)


def split_tokens(x_TD: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """This rank's slice of the tokens (the gradient is all-gathered backward)."""
    return x_TD if tp is None or tp.size == 1 else _SplitTokens.apply(x_TD, tp)


def gather_tokens(x_TD: torch.Tensor, tp: TPGroup | None, rows: int) -> torch.Tensor:
    """Every rank's slice of `rows` tokens, in order (the inverse of split_tokens)."""
    return x_TD if tp is None or tp.size == 1 else _GatherTokens.apply(x_TD, tp, rows)


class RowParallelLinear(nn.Module):
    """y = sum over the group of x_shard @ w_shard^T, then the whole bias once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from(nn.functional.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


def shard_linear(lin: nn.Linear, tp: TPGroup | None, dim: int, groups: int = 0) -> nn.Module:
    """This rank's shard of a whole nn.Linear (the whole layer when tp is None or 1).

    dim 0 (column parallel): a Linear over this rank's output features (its input must come
    through copy_to). dim 1 (row parallel): a RowParallelLinear over its input features,
    which sums the partial outputs. `groups` (default: one per feature) is the number of
    equal blocks (heads) that must stay whole on one rank.
    """
    if tp is None or tp.size == 1:
        return lin
    n = lin.weight.shape[dim]
    groups = groups or n
    if groups % tp.size or n % groups:
        raise ValueError(f"{groups} blocks of {n} features do not split over tp={tp.size}")
    per = n // tp.size
    lo, hi = tp.index * per, (tp.index + 1) * per
    if dim == 1:
        return RowParallelLinear(lin.weight[:, lo:hi], lin.bias, tp)
    out = nn.Linear(lin.in_features, per, bias=lin.bias is not None)
    with torch.no_grad():
        out.weight.copy_(lin.weight[lo:hi])
        if lin.bias is not None:
            out.bias.copy_(lin.bias[lo:hi])
    return out
