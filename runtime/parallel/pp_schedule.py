"""The torch.distributed.pipelining pieces of runtime/parallel/pipeline.py, imported only by
a rank whose pipeline has more than one stage (the library imports torch._dynamo, ~1.5 s of
CPU per process that a pp = 1 run does not need)."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.stage import stage_backward

from runtime.metrics import ByteCounter


class CountingStage(PipelineStage):
    """A PipelineStage that records the bytes of every activation / gradient it sends.

    With an FSDP stage module, every micro-batch's backward reduce-scatters its gradients
    into the shards, as without pipelining (runtime/parallel/fsdp.py); the library's default
    instead keeps whole gradients until the step's last backward."""

    counter: ByteCounter | None = None

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        if not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full":
            raise NotImplementedError(f"FSDP stages run full backward, not {backward_type!r}")
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """The step's end: FSDP reduced every backward already; only scale by 1 / m."""
        if not isinstance(self.submod, FSDPModule):
            return super().perform_reduce_grad(grad_scale_factor)
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)

    def _count(self, ops):
        if self.counter is not None:
            for op in ops:
                self.counter.add("p2p", op.tensor.numel() * op.tensor.element_size(), op.peer)
        return ops

    def _forward_metadata_inference(self, *args, **kwargs):
        """The library's one-time shape-inference forward: not training, so the MoE layers
        do not count its tokens (its all-to-all bytes are counted: they were sent)."""
        with self._not_training():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args, **kwargs):
        """The library's one-time backward shape inference, which on the last stage runs the
        loss (with MTP, the MTP modules): neither their tokens nor that loss count."""
        with self._not_training():
            return super()._backward_metadata_inference(*args, **kwargs)

    @contextlib.contextmanager
    def _not_training(self):
        moes = self.submod.moe_layers().values()
        parts = len(self.submod.loss_parts)
        for moe in moes:
            moe.counting = False
        try:
            yield
        finally:
            for moe in moes:
                moe.counting = True
            del self.submod.loss_parts[parts:]

    def _to_tensor(self, arg):
        """Materialize inferred inputs as zeros, not uninitialized memory (deterministic)."""
        out = super()._to_tensor(arg)
        if isinstance(out, torch.Tensor) and not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                out.zero_()
        return out

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._count(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._count(super().get_bwd_send_ops(bwd_chunk_id))


class PlanOrderInterleaved1F1B(ScheduleInterleaved1F1B):
    """Interleaved 1F1B where process-group rank g sits at plan pipeline position
    `position_of_group_rank[g]` (the library's schedule assumes position g)."""

    def __init__(self, stages, n_microbatches, loss_fn, position_of_group_rank: dict[int, int]):
        self._position = position_of_group_rank
        super().__init__(stages, n_microbatches, loss_fn=loss_fn)

    def _calculate_single_rank_operations(self, rank):
        return super()._calculate_single_rank_operations(self._position[rank])


def make_schedule(stages: list, num_microbatches: int, loss_fn, position: dict[int, int]):
    """The step's schedule over this rank's stages: interleaved 1F1B in plan order with
    several chunks, else 1F1B (GPipe when micro-batches < pp, which 1F1B refuses: the same
    math, more memory). position: process-group rank -> plan pipeline position."""
    if len(stages) > 1:
        return PlanOrderInterleaved1F1B(stages, num_microbatches, loss_fn, position)
    pp = stages[0].num_stages
    schedule = Schedule1F1B if num_microbatches >= pp else ScheduleGPipe
    return schedule(stages[0], num_microbatches, loss_fn=loss_fn)
