"""Per-layer forward/backward time and peak memory at world size 1, beside the planner's
prediction for the same layer (planner.resources.layer_cost).

`python -m runtime.bench.layer_bench [--model M | --plan PLAN] [--cluster C] [--seq-len S]
[--micro-batch B] [--layers i,j] [--scale F] [--json] [--out PREFIX]`

On CUDA: NCCL process group of one rank, bf16 weights, the runtime's own StageModule with the
flat all-to-all dispatcher over that group; CUDA events time forward and backward, and
torch.cuda.max_memory_allocated minus the weights gives the activation + gradient peak.
On CPU (tests): gloo, fp32, wall-clock timing, peak RSS is not separable so memory is omitted.
Default layers: the first dense layer (if any) and the first MoE layer. Writes PREFIX.json
and PREFIX.csv. Predicted memory: weights + grads (bf16, 2 + 2 B/param) + activations kept
for backward (the planner's ActBytes); measured: peak allocated during forward + backward.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from planner.parallel import ParallelConfig
from planner.specs import TrainingSpec
from runtime.dispatch.flat import FlatAllToAll
from runtime.model.transformer import StageModule


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_world_one(cuda: bool) -> bool:
    """Start a one-rank process group unless one exists; True when this call started it."""
    if dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    return True


def predicted(model, index: int, cluster, seq_len: int, micro_batch: int) -> dict:
    """The planner's forward, forward+backward time and memory for layer `index`."""
    from planner.resources.layer_cost import layer_cost

    training = TrainingSpec(seq_len=seq_len, global_batch=micro_batch, dtype="bf16")
    par = ParallelConfig(pp=1, dp=1, ep=1, micro_batch=micro_batch)
    cost = layer_cost(model, index, cluster, training, par)
    params = cost.params_dense + cost.params_expert
    flops = sum(w.flops for w in cost.work)
    return {
        "pred_fwd_s": sum(w.forward_s for w in cost.work),
        "pred_fwd_bwd_s": cost.compute_s,
        "pred_mem_bytes": 4 * params + cost.act.total,
        "pred_act_bytes": cost.act.total,
        "flops_fwd_bwd": flops,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, index: int, seq_len: int, micro_batch: int, device, iters: int) -> dict:
    """Median forward and backward seconds and peak memory of one layer."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    module = StageModule(model, [index], first=False, last=False).to(device=device, dtype=dtype)
    for moe in module.moe_layers().values():
        moe.dispatcher = FlatAllToAll(None, 1)
    x = torch.randn(micro_batch, seq_len, model.hidden_size, device=device, dtype=dtype)
    x.requires_grad_(True)
    fwd, bwd, peak = [], [], 0
    for i in range(iters + 2):
        module.zero_grad(set_to_none=True)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        y = module(x)
        _sync(device)
        t1 = time.perf_counter()
        y.float().square().mean().backward()
        _sync(device)
        t2 = time.perf_counter()
        if i >= 2:  # two warm-up iterations
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            if device.type == "cuda":
                peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    out = {"fwd_s": sorted(fwd)[len(fwd) // 2], "bwd_s": sorted(bwd)[len(bwd) // 2]}
    if device.type == "cuda":
        out["mem_bytes"] = weights + peak  # weights + activations + grads at the peak
    return out


def bench(model, cluster, seq_len: int, micro_batch: int, layers, iters: int = 5) -> list:
    """One row per layer: measured next to predicted, with ratios."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    device = device or torch.device("cpu")
    started = _init_world_one(cuda)
    rows = []
    for index in layers:
        row = {"layer": index, "kind": model.layers[index].kind, "device": str(device)}
        row.update(predicted(model, index, cluster, seq_len, micro_batch))
        row.update(measure(model, index, seq_len, micro_batch, device, iters))
        total = row["fwd_s"] + row["bwd_s"]
        row["measured_tflops"] = row["flops_fwd_bwd"] / total / 1e12
        row["time_ratio_measured_over_pred"] = total / row["pred_fwd_bwd_s"]
        if "mem_bytes" in row:
            row["mem_ratio_measured_over_pred"] = row["mem_bytes"] / row["pred_mem_bytes"]
        rows.append(row)
    if started:
        dist.destroy_process_group()
    return rows


def _default_layers(model) -> list[int]:
    dense = [i for i, layer in enumerate(model.layers) if layer.kind == "dense"]
    return dense[:1] + list(model.moe_layers[:1])


def _csv(rows: list[dict]) -> str:
    keys = sorted({k for r in rows for k in r})
    lines = [",".join(keys)]
    lines += [
        ",".join(f"{r[k]:.6g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys)
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def _print_rows(rows: list[dict]) -> None:
    for r in rows:
        mem = ""
        if "mem_bytes" in r:
            mem = (
                f"  mem {r['mem_bytes'] / 2**30:.2f} GiB vs pred {r['pred_mem_bytes'] / 2**30:.2f}"
            )
        print(
            f"layer {r['layer']} ({r['kind']}): fwd {r['fwd_s'] * 1e3:.2f} ms bwd "
            f"{r['bwd_s'] * 1e3:.2f} ms = {r['measured_tflops']:.1f} TFLOPS; predicted "
            f"fwd+bwd {r['pred_fwd_bwd_s'] * 1e3:.2f} ms (measured/pred "
            f"{r['time_ratio_measured_over_pred']:.2f}){mem}"
        )


def main(argv: list[str] | None = None) -> int:
    from planner.inputs.clusters import load_cluster
    from planner.inputs.models import load_model
    from planner.outputs.files import write_files
    from planner.plan import load_plan
    from planner.run.scale import scale_layer

    p = argparse.ArgumentParser(prog="python -m runtime.bench.layer_bench")
    p.add_argument("--model", default="mixtral-8x7b")
    p.add_argument("--plan", default=None, help="take the model (and seq len) from a plan")
    p.add_argument("--cluster", default="h200")
    p.add_argument("--seq-len", type=int, default=None, help="default: plan's or 4096")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--layers", default=None, help="comma-separated layer indices")
    p.add_argument("--scale", type=float, default=1.0, help="shrink widths (CPU smoke runs)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.csv")
    args = p.parse_args(argv)
    seq_len = args.seq_len or 4096
    if args.plan:
        plan = load_plan(args.plan)
        model = plan.model_spec(args.plan)
        seq_len = args.seq_len or int(plan.training.get("seq_len", 4096))
    else:
        model = load_model(args.model)
    if args.scale < 1.0:
        model = replace(
            model,
            layers=tuple(scale_layer(x, args.scale) for x in model.layers),
            hidden_size=max(8, round(model.hidden_size * args.scale / 8) * 8),
        )
    layers = [int(x) for x in args.layers.split(",")] if args.layers else _default_layers(model)
    rows = bench(model, load_cluster(args.cluster), seq_len, args.micro_batch, layers, args.iters)
    if args.out:
        write_files(
            os.path.dirname(args.out) or ".",
            {
                os.path.basename(args.out) + ".json": json.dumps(rows, indent=2) + "\n",
                os.path.basename(args.out) + ".csv": _csv(rows),
            },
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
