"""Tensor parallelism with sequence parallelism (Megatron-style) for attention, the dense /
shared-expert MLPs, the embedding, the output head and the loss.

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

The embedding and the output head are vocabulary-parallel, as in Megatron-Core: each rank
holds ceil(V / n) rows of each (`vocab_rows`; the vocabulary padded with zero rows to a
multiple of n, which no token id reaches and no logit reads). `VocabParallelEmbedding`
looks up the ids in its rows, zeroes the others and reduce-scatters the partial embeddings
to token slices (Megatron's VocabParallelEmbedding with reduce_scatter_embeddings,
megatron/core/tensor_parallel/layers.py:336-380). `VocabParallelHead` gathers the token
slices and applies its rows (a column-parallel linear over the vocabulary,
megatron/core/models/gpt/gpt_model.py:277-288), giving this rank's logits [B, S, V / n];
`vocab_parallel_cross_entropy` takes the loss from them with three all-reduces of one
number per token (max, sum of exponentials, the target's logit;
megatron/core/tensor_parallel/cross_entropy.py:119-210), so the loss is the same on every
TP rank and each rank's logit gradient is its columns of the whole one. Weights are built
whole from the layer's seeded generator and then sliced (`shard_linear`, `vocab_rows`), so
a TP run starts from the same model as a single-device run. The replicated weights (norms,
routers, the row-parallel biases, the shared expert's gate, MLA's down-projections) see only
this rank's tokens or heads and get partial gradients, summed over the group by the
gradient sync. With bf16 compute the token slices, and so the gathers and reduce-scatters,
are bf16 (the embedding casts before its reduce-scatter); the cross entropy's all-reduces
stay fp32. Shape letters: T = tokens, D = hidden, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from runtime.precision import to_compute_dtype


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

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """x reduced in place over the group (counted as a ring all-reduce)."""
        dist.all_reduce(x, op=op, group=self.group)
        if self.counter is not None:
            self.counter.add_allreduce(self.kind, x.numel() * x.element_size(), self.ranks)
        return x

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


def sp_gather(x_TD: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _SPGather.apply(x_TD, tp)


def sp_reduce_scatter(x_TD: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _SPReduceScatter.apply(x_TD, tp)


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
        return y if self.bias is None else y + self.bias.to(y.dtype)


def shard_linear(lin: nn.Linear, tp: TPGroup | None, dim: int, groups: int = 0) -> nn.Module:
    """This rank's shard of a whole nn.Linear (the whole layer when tp is None).

    dim 0 (column parallel): a Linear over this rank's output features (its input is the
    gathered micro-batch). dim 1 (row parallel): a RowParallelLinear over its input features.
    `groups` (default: one per feature) is the number of equal blocks (heads) that must stay
    whole on one rank. Every sharded weight is marked `tp_sharded` and `tp_dim` (the split
    axis, read by `tp_layout`).
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
        out.weight.tp_sharded, out.weight.tp_dim = True, 1
        return out
    out = nn.Linear(lin.in_features, per, bias=lin.bias is not None)
    with torch.no_grad():
        out.weight.copy_(lin.weight[lo:hi])
        if lin.bias is not None:
            out.bias.copy_(lin.bias[lo:hi])
    for p in out.parameters():
        p.tp_sharded, p.tp_dim = True, 0
    return out


def vocab_rows(vocab: int, tp: TPGroup) -> tuple[int, int, int]:
    """(first id, rows held, real rows) of this rank's vocabulary slice: ceil(V / n) rows from
    index * ceil(V / n); rows past V are padding (Megatron pads to a multiple of
    make_vocab_size_divisible_by * n, megatron/training/vocab_utils.py:58; here the multiple
    is n, so the single-device model needs none)."""
    per = -(-vocab // tp.size)
    start = tp.index * per
    real = min(per, vocab - start)
    if real <= 0:
        raise ValueError(f"vocab_size {vocab} leaves tp rank {tp.index} of {tp.size} no rows")
    return start, per, real


def vocab_shard(whole_VD: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's rows of a whole [V, D] embedding or head weight, zero-padded to ceil(V / n)."""
    start, per, real = vocab_rows(whole_VD.shape[0], tp)
    out = whole_VD.new_zeros((per, *whole_VD.shape[1:]))
    out[:real] = whole_VD[start : start + real]
    return out


def _vocab_parameter(whole_VD: torch.Tensor, tp: TPGroup) -> nn.Parameter:
    weight = nn.Parameter(vocab_shard(whole_VD.detach(), tp))
    weight.tp_sharded, weight.tp_dim, weight.tp_vocab = True, 0, whole_VD.shape[0]
    return weight


def tp_layout(p: torch.Tensor, size: int) -> tuple[int, int] | None:
    """(split axis, its length in the whole weight) of a TP-sharded parameter of a group of
    `size` ranks; None for a replicated one. Rank i holds the torch.chunk slice i of that
    axis: equal slices, except the vocabulary's (`vocab_rows`: the last may be short, its
    padding rows are not part of the whole). A 1-D shard without `tp_dim` (attention sinks)
    splits its only axis."""
    if not getattr(p, "tp_sharded", False) or size == 1:
        return None
    dim = getattr(p, "tp_dim", 0)
    return dim, getattr(p, "tp_vocab", p.shape[dim] * size)


class _VocabSlice(nn.Module):
    """This rank's rows start .. start + real of a [V, D] vocabulary weight (vocab_rows)."""

    def __init__(self, whole_VD: torch.Tensor, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.vocab = tp, whole_VD.shape[0]
        self.start, _, self.real = vocab_rows(self.vocab, tp)
        self.weight = _vocab_parameter(whole_VD, tp)


class VocabParallelEmbedding(_VocabSlice):
    """This rank's rows of the input embedding: token ids [B, S] -> this rank's token slice
    [T / n, D] of the embeddings (ids outside its rows give zeros before the reduce-scatter),
    in the compute dtype (runtime.model.layers.Embedding), so the reduce-scatter carries it."""

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        ids = ids_BS.reshape(-1)
        outside = (ids < self.start) | (ids >= self.start + self.real)
        local = (ids - self.start).masked_fill(outside, 0)
        x_TD = nn.functional.embedding(local, self.weight).masked_fill(outside[:, None], 0.0)
        return sp_reduce_scatter(to_compute_dtype(x_TD), self.tp)


class VocabParallelHead(_VocabSlice):
    """The output head over this rank's vocabulary rows: the token slice [T / n, D] ->
    logits [B, S, real rows] of the whole micro-batch for ids start .. start + real."""

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        x = sp_gather(x_TD, tp).view(tp.tokens // tp.seq_len, tp.seq_len, -1)
        return nn.functional.linear(x, self.weight[: self.real])


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from vocab-parallel logits (Megatron-Core's
    _VocabParallelCrossEntropy, without label smoothing); backward is local: softmax minus
    the one-hot of the target on this rank's columns."""

    @staticmethod
    def forward(ctx, logits_TV, target_T, start, tp):
        logits = logits_TV.float()
        logits_max = tp.all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)
        logits = logits - logits_max[:, None]
        outside = (target_T < start) | (target_T >= start + logits.shape[-1])
        local = (target_T - start).masked_fill(outside, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        predicted = tp.all_reduce(logits[rows, local].masked_fill(outside, 0.0))
        exp = logits.exp()
        sum_exp = tp.all_reduce(exp.sum(dim=-1))
        softmax = exp / sum_exp[:, None]
        ctx.save_for_backward(softmax, outside, local)
        ctx.dtype = logits_TV.dtype
        return torch.log(sum_exp) - predicted

    @staticmethod
    def backward(ctx, grad_T):
        softmax, outside, local = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        return (grad * grad_T[:, None]).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_BSV: torch.Tensor, target_BS: torch.Tensor, start: int, tp: TPGroup
) -> torch.Tensor:
    """Mean next-token cross entropy from this rank's logit columns (ids start .. start +
    width), the same value on every TP rank."""
    logits_TV = logits_BSV.reshape(-1, logits_BSV.shape[-1])
    return _VocabParallelCrossEntropy.apply(logits_TV, target_BS.reshape(-1), start, tp).mean()
