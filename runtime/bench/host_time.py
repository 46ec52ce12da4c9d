"""Host time per layer: the runtime's own layers timed where their compute is negligible.

`piper profile` prices a layer from GEMM, attention and memory-bandwidth tables; what those
tables leave out is the time the host spends per layer and micro-batch (Python, autograd,
the dispatcher's bookkeeping and its collective calls, kernel launches). Every rank times the
forward + backward of one layer of each kind of HOST_MODEL (the first dense and the first MoE
layer) alone, as runtime/bench/layer_bench.py does, its MoE dispatcher on a one-rank group
of its own (so the exchange is called and moves nothing across ranks), at HOST_SEQ_LEN x
HOST_MICRO_BATCH tokens. The raw JSON's `layers` block holds the medians over ranks;
planner.calibrate.profile_tables subtracts the priced compute to get layer_overhead_us.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.bench.comm_bench import median_over_ranks
from runtime.bench.layer_bench import measure

HOST_MODEL = "tiny-moe"  # the runtime's layer code at shapes whose compute is a few percent
HOST_SEQ_LEN = 64
HOST_MICRO_BATCH = 1


def measure_layers(device: torch.device, iters: int) -> dict:
    """The raw JSON's `layers` block: per kind of HOST_MODEL's layers, the median over ranks
    of forward and backward seconds (module docstring)."""
    from planner.inputs.models import load_model

    model = load_model(HOST_MODEL)
    own = None
    for r in range(dist.get_world_size()):  # every rank creates every group, in order
        g = dist.new_group([r])
        if r == dist.get_rank():
            own = g
    firsts: dict[str, int] = {}
    for i, layer in enumerate(model.layers):
        firsts.setdefault(layer.kind, i)
    rows = []
    for kind, index in firsts.items():
        t = measure(model, index, HOST_SEQ_LEN, HOST_MICRO_BATCH, device, iters, group=own)
        fwd, bwd = median_over_ranks([t["fwd_s"], t["bwd_s"]])
        count = sum(1 for layer in model.layers if layer.kind == kind)
        rows.append({"layer": index, "kind": kind, "count": count, "fwd_s": fwd, "bwd_s": bwd})
    return {"model": HOST_MODEL, "seq_len": HOST_SEQ_LEN, "micro_batch": HOST_MICRO_BATCH,
            "rows": rows}  # fmt: skip
