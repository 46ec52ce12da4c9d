"""Expert tensor parallelism: every routed expert's FFN width split over an expert-TP group.

The etp ranks of an expert-TP group (runtime/parallel/mesh.py: same stage, edp_idx and
ep_idx) hold the same experts, each rank a 1/etp slice of every expert's FFN width F:
column-parallel up and gate (w_in, w_gate [X, D, F/etp], b_in, b_gate [X, F/etp]), row-
parallel down (w_out [X, F/etp, D]). Each rank routes its own tokens and exchanges them over
its EP group (the ranks with its etp_idx) as without etp; the rows the group's members
received are then all-gathered over the expert-TP group, every member applies its slice of
each expert to the rows of all of them, and the partial outputs are reduce-scattered back,
each member receiving the sum over the slices for its own rows, which it combines over its EP
group. This is Megatron-Core's expert TP (`--expert-tensor-parallel-size`; its
MoEAlltoAllTokenDispatcher all-gathers the permuted tokens over the expert-TP group after the
EP all-to-all and reduce-scatters the expert outputs before the reverse all-to-all,
megatron/core/transformer/moe/token_dispatcher.py). The all-gather's backward is a
reduce-scatter and the other way round (runtime/parallel/tensor_parallel.py's sequence-
parallel pair, with the received row counts as the slices). The output bias b_out, which
the row-parallel sum would add etp times, is held by etp rank 0 only.

Weights are sliced from the whole experts the seeded generator built, so the run starts
from the single-device model. Bytes: the all-gather and reduce-scatter as ring passes over
the padded row buffers, and the per-slot row counts, all as kind "etp".

Shape letters: T tokens, K top-k, D hidden, N rows received by this rank, M rows of the
whole expert-TP group, X local slots, P members of the expert-TP group.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from runtime.metrics import ByteCounter
from runtime.model.moe import Experts
from runtime.parallel.mesh import Mesh
from runtime.parallel.tensor_parallel import TPGroup, sp_gather, sp_reduce_scatter

_COLUMN = ("w_in", "w_gate", "b_in", "b_gate")  # the FFN width is their last axis


def width_axis(name: str) -> int | None:
    """The FFN-width axis of one expert's parameter `name` (slot axis dropped) that expert TP
    splits; None for b_out, which etp rank 0 holds whole."""
    if name in _COLUMN:
        return 0 if name.startswith("b_") else 1
    return 0 if name == "w_out" else None


def shard_experts(experts: Experts, etp: int, index: int) -> None:
    """Keep slice `index` of `etp` of every expert's FFN width (in place, before training)."""
    f = experts.w_in.shape[-1]
    if f % etp:
        raise ValueError(f"expert FFN width {f} does not split over etp={etp}")
    lo, hi = index * f // etp, (index + 1) * f // etp
    with torch.no_grad():
        for name in _COLUMN:
            p = getattr(experts, name)
            if p is not None:
                setattr(experts, name, nn.Parameter(p[..., lo:hi].clone()))
        experts.w_out = nn.Parameter(experts.w_out[:, lo:hi, :].clone())
    if index > 0:
        experts.b_out = None  # added once, by etp rank 0


class ExpertTPDispatcher:
    """A TokenDispatcher that wraps the EP exchange with the expert-TP gather and scatter.

    Args:
        inner: the EP group's dispatcher (flat, HALO, local). group, ranks: the expert-TP
        process group and its members (physical, plan order). index: my etp_idx.
        counter: where the expert-TP bytes go.
    """

    def __init__(
        self, inner, group, ranks: list[int], index: int, counter: ByteCounter | None
    ) -> None:
        self.inner, self.stats = inner, inner.stats
        self.tp = TPGroup(group, ranks, index, 0, 1, counter, row_sizes=(), kind="etp")

    def dispatch(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, rank_of_expert_E):
        """The inner dispatch, then every member's rows: [M, D] slot-major, counts per slot."""
        x_ND, counts, handle = self.inner.dispatch(x_TD, expert_TK, rank_of_expert_E)
        counts_X = torch.as_tensor(counts, dtype=torch.long).reshape(-1)
        counts_PX = self._gather_counts(counts_X)
        tp = replace(self.tp, row_sizes=tuple(counts_PX.sum(dim=1).tolist()))
        x_MD = sp_gather(x_ND, tp)  # member-major: member p's rows in its slot order
        order_M = _slot_major(counts_PX)
        return x_MD[order_M], counts_PX.sum(dim=0).tolist(), (handle, tp, order_M)

    def combine(self, y_MD: torch.Tensor, handle, weight_TK=None) -> torch.Tensor:
        """Partial outputs of my width slice -> my rows' sums over the group -> inner combine."""
        inner_handle, tp, order_M = handle
        member_major = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(len(order_M)))
        y_ND = sp_reduce_scatter(y_MD[member_major], tp)
        return self.inner.combine(y_ND, inner_handle, weight_TK)

    def _gather_counts(self, counts_X: torch.Tensor) -> torch.Tensor:
        """[P, X] rows per slot of every member, members in plan order."""
        tp = self.tp
        parts = [torch.empty_like(counts_X) for _ in tp.ranks]
        dist.all_gather(parts, counts_X, group=tp.group)
        if tp.counter is not None:
            nbytes = counts_X.numel() * counts_X.element_size() * tp.size
            tp.counter.add_ring(tp.kind, nbytes, tp.ranks, passes=1)
        return torch.stack([parts[tp._group_rank(i)] for i in range(tp.size)])


def _slot_major(counts_PX: torch.Tensor) -> torch.Tensor:
    """Row order that groups member-major rows by slot: slot 0 of members 0..P-1, then slot 1..."""
    p, x = counts_PX.shape
    starts_PX = (counts_PX.reshape(-1).cumsum(0) - counts_PX.reshape(-1)).reshape(p, x)
    pieces = [
        torch.arange(int(starts_PX[m, s]), int(starts_PX[m, s] + counts_PX[m, s]))
        for s in range(x)
        for m in range(p)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def apply_expert_tp(module, mesh: Mesh, counter: ByteCounter | None) -> None:
    """Split every MoE layer of a rank's module (StageModule or RankChunks) over its
    expert-TP group: slice the experts and wrap the dispatchers (once the slots are final)."""
    for moe in module.moe_layers().values():
        shard_experts(moe.experts, len(mesh.etp_ranks), mesh.me.etp_idx)
        moe.dispatcher = ExpertTPDispatcher(
            moe.dispatcher, mesh.etp_group, mesh.etp_ranks, mesh.me.etp_idx, counter
        )
