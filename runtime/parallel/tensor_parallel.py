"""Tensor parallelism with sequence parallelism (Megatron-style) for attention and the dense /
shared-expert MLPs.

Within a tensor-parallel (TP) group of `size` ranks, the residual stream is split by
tokens: each rank holds its own slice of the micro-batch's B * S tokens (`chunk_sizes`)
between layers, through the norms, the MoE block and the pipeline sends. Attention and
MLPs gather the whole micro-batch before their column-parallel matrices (q, k, v split by
heads; up and gate by hidden width) and reduce-scatter the partial outputs of their
row-parallel matrix (o; down) back to token slices. Each all-gather's backward is a
reduce-scatter and the other way round (`sp_gather`, `sp_reduce_scatter`). This is the
layout the planner's resource model assumes (T = b s / tp tokens per rank).

The MoE block does not split its experts (expert TP = 1): each rank routes and dispatches
the tokens of its own slice, so the expert-parallel group (ep consecutive ranks of the
dp * tp block) sees every token of its replicas exactly once.

The first stage embeds the whole micro-batch and keeps its slice (`split_tokens`); the last
stage gathers the slices before the head (`gather_tokens`), so logits and loss are the same
on every TP rank. Weights are built whole from the layer's seeded generator and then sliced
(`shard_linear`), so a TP run starts from the same model as a single-device run. The
replicated weights that see only this rank's tokens or heads (norms, routers, the row-
parallel biases, the shared expert's gate) get partial gradients, summed over the group
by the gradient sync. Shape letters: T = tokens, D = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class TPGroup:
    """This rank's tensor-parallel group: `ranks` are physical ranks in plan order.

    tokens: B * S, the tokens of one micro-batch (what the slices split); seq_len: S.
    row_sizes: each member's rows when they are not the even split of `tokens` (the expert-TP
    group's received rows, runtime/parallel/expert_tp.py). kind: the byte counter's kind.
    """

    group: object
    ranks: list[int]
    index: int  # my position in `ranks` (the plan's tp_idx)
    tokens: int
    seq_len: int
    counter: object = None  # runtime.metrics.ByteCounter: bytes counted as `kind`
    row_sizes: tuple[int, ...] | None = None
    kind: str = "tp"

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def sizes(self) -> list[int]:
        if self.row_sizes is not None:
            return list(self.row_sizes)
        return chunk_sizes(self.tokens, self.size)

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.index])

    def _group_rank(self, index: int) -> int:
        """Rank inside the process group (sorted physical order) of plan position `index`."""
        return sorted(self.ranks).index(self.ranks[index])

    def _count(self, nbytes: int) -> None:
        if self.counter is not None:  # ring model: (n - 1) / n of the whole buffer
            self.counter.add_ring(self.kind, nbytes, self.ranks, passes=1)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[my slice, ...] -> [all tokens, ...], slices in plan order."""
        sizes, width = self.sizes, max(self.sizes)
        pad = x.new_zeros((width, *x.shape[1:]))
        pad[: x.shape[0]] = x
        parts = [torch.empty_like(pad) for _ in self.ranks]
        dist.all_gather(parts, pad, group=self.group)
        self._count(pad.numel() * pad.element_size() * self.size)
        return torch.cat([parts[self._group_rank(i)][: sizes[i]] for i in range(self.size)])

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[all tokens, ...] partial sums -> [my slice, ...] of the sum over the group."""
        sizes, width = self.sizes, max(self.sizes)
        buf = x.new_zeros((self.size * width, *x.shape[1:]))
        offset = 0
        for i, n in enumerate(sizes):  # slice i goes to the group rank of plan position i
            at = self._group_rank(i) * width
            buf[at : at + n] = x[offset : offset + n]
            offset += n
        out = x.new_empty((width, *x.shape[1:]))
        dist.reduce_scatter_single(out, buf, group=self.group)
        self._count(buf.numel() * buf.element_size())
        return out[: sizes[self.index]]


def chunk_sizes(rows: int, parts: int) -> list[int]:
    """Rows of each TP rank's token slice (the first rows % parts ranks take one more)."""
    return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]


class _SPGather(torch.autograd.Function):
    """Token slices -> the whole micro-batch, before column-parallel matrices."""

    @staticmethod
    def forward(ctx, x_TD, tp):
        ctx.tp = tp
        return tp.all_gather_rows(x_TD.contiguous())

    @staticmethod
    def backward(ctx, grad):  # each rank's columns contributed a part of the gradient
        return ctx.tp.reduce_scatter_rows(grad.contiguous()), None


class _SPReduceScatter(torch.autograd.Function):
    """Partial outputs of a row-parallel matrix -> this rank's token slice of their sum."""

    @staticmethod
    def forward(ctx, x_TD, tp):
        ctx.tp = tp
        return tp.reduce_scatter_rows(x_TD.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather_rows(grad.contiguous()), None


class _SplitTokens(torch.autograd.Function):
    """Whole micro-batch, the same on every rank -> my slice (after the embedding)."""

    @staticmethod
    def forward(ctx, x_TD, tp):
        ctx.tp = tp
        return x_TD[tp.start : tp.start + tp.sizes[tp.index]].clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather_rows(grad.contiguous()), None


class _GatherTokens(torch.autograd.Function):
    """My slice -> the whole micro-batch, used the same on every rank (before the head)."""

    @staticmethod
    def forward(ctx, x_TD, tp):
        ctx.tp = tp
        return tp.all_gather_rows(x_TD.contiguous())

    @staticmethod
    def backward(ctx, grad):
        tp = ctx.tp
        return grad[tp.start : tp.start + tp.sizes[tp.index]], None


def sp_gather(x_TD: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _SPGather.apply(x_TD, tp)


def sp_reduce_scatter(x_TD: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _SPReduceScatter.apply(x_TD, tp)


def split_tokens(x_TD: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """This rank's slice of tokens that every rank holds alike (gradient all-gathered)."""
    return x_TD if tp is None else _SplitTokens.apply(x_TD, tp)


def gather_tokens(x_TD: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """Every rank's slice, in order, for a computation every rank repeats alike."""
    return x_TD if tp is None else _GatherTokens.apply(x_TD, tp)


class RowParallelLinear(nn.Module):
    """A row-parallel matrix: this rank's input features -> its slice of the summed output,
    plus the whole bias (replicated; its gradient is partial, like a norm's)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        y = sp_reduce_scatter(y.reshape(-1, y.shape[-1]), self.tp)
        return y if self.bias is None else y + self.bias


def shard_linear(lin: nn.Linear, tp: TPGroup | None, dim: int, groups: int = 0) -> nn.Module:
    """This rank's shard of a whole nn.Linear (the whole layer when tp is None).

    dim 0 (column parallel): a Linear over this rank's output features (its input is the
    gathered micro-batch). dim 1 (row parallel): a RowParallelLinear over its input features.
    `groups` (default: one per feature) is the number of equal blocks (heads) that must stay
    whole on one rank. Every sharded weight is marked `tp_sharded`.
    """
    if tp is None:
        return lin
    n = lin.weight.shape[dim]
    groups = groups or n
    if groups % tp.size or n % groups:
        raise ValueError(f"{groups} blocks of {n} features do not split over tp={tp.size}")
    per = n // tp.size
    lo, hi = tp.index * per, (tp.index + 1) * per
    if dim == 1:
        out = RowParallelLinear(lin.weight[:, lo:hi], lin.bias, tp)
        out.weight.tp_sharded = True
        return out
    out = nn.Linear(lin.in_features, per, bias=lin.bias is not None)
    with torch.no_grad():
        out.weight.copy_(lin.weight[lo:hi])
        if lin.bias is not None:
            out.bias.copy_(lin.bias[lo:hi])
    for p in out.parameters():
        p.tp_sharded = True
    return out
