"""Per-layer forward/backward time and peak memory at world size 1, beside the planner's
prediction for the same layer (planner.resources.layer_cost).

`python -m runtime.bench.layer_bench [--model M | --plan PLAN] [--cluster C] [--seq-len S]
[--micro-batch B] [--layers i,j] [--scale F] [--time-tol T] [--mem-tol M] [--check]
[--other-cluster C] [--json] [--out PREFIX]`

What is compared is what layer_cost prices for one layer on one rank and one micro-batch at
pp = dp = tp = ep = 1 with no recompute:
- time: the layer's forward + backward (LayerCost.time_s: its compute work, the host time per
  layer of the profile, and the exposed communication, none at world size 1) against the
  measured forward + backward of the runtime's StageModule holding that layer alone, the
  backward driven by a fixed output gradient (no loss);
- memory: weights + gradients (LayerCost.state, bf16) + the activations kept for backward
  (LayerCost.act) + the layer's transient workspaces, against the weights plus the peak that
  torch.cuda.max_memory_allocated rises to above the step's start (the input and the output
  gradient are there already) during forward + backward.
On CUDA: NCCL process group of one rank, bf16, the flat all-to-all dispatcher over it, times
between device synchronisations. On CPU (tests): gloo, fp32 (predicted in fp32 too), peak
memory not separable so only time is compared. Each row carries the error (predicted -
measured) / measured and passes when |time error| <= --time-tol (default 0.10) and |memory
error| <= --mem-tol (default 0.05); `--check` exits 1 when a row fails. `--other-cluster C`
adds C's prediction and errors beside the same measurement (not checked). Default layers: the
first dense layer (if any) and the first MoE layer. Writes PREFIX.json and PREFIX.csv.
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


def predicted(
    model, index: int, cluster, seq_len: int, micro_batch: int, dtype: str = "bf16"
) -> dict:
    """The planner's forward, forward+backward time and peak memory for layer `index` at
    world size 1 (module docstring: what is counted)."""
    from planner.resources.layer_cost import layer_alone

    cost = layer_alone(model, index, cluster, seq_len, micro_batch, dtype)
    workspace = sum(b for _, b in cost.workspace)
    return {
        "pred_fwd_s": sum(w.forward_s for w in cost.work),
        "pred_fwd_bwd_s": cost.time_s,
        "pred_comm_s": sum(s for _, s in cost.comm_s),
        "pred_work_s": {w.name: w.time_s for w in cost.work},
        "pred_mem_bytes": cost.state.weights + cost.state.grads + cost.act.total + workspace,
        "pred_act_bytes": cost.act.total,
        "pred_tables": list(cost.tables),
        "flops_fwd_bwd": sum(w.flops for w in cost.work),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    model, index: int, seq_len: int, micro_batch: int, device, iters: int, group=None
) -> dict:
    """Median forward and backward seconds and peak memory of one layer; its MoE dispatcher
    exchanges over `group` (a one-rank group; None = the default group of a one-rank world)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    module = StageModule(model, [index], first=False, last=False).to(device=device, dtype=dtype)
    for moe in module.moe_layers().values():
        moe.dispatcher = FlatAllToAll(group, 1)
    shape = (micro_batch, seq_len, model.hidden_size)
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    grad_y = torch.randn(*shape, device=device, dtype=dtype)
    fwd, bwd, peak = [], [], 0
    for i in range(iters + 2):
        module.zero_grad(set_to_none=True)
        x.grad = None
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        y = module(x)
        _sync(device)
        t1 = time.perf_counter()
        torch.autograd.backward(y, grad_y)
        _sync(device)
        t2 = time.perf_counter()
        del y
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


def compare(row: dict, time_tol: float, mem_tol: float) -> dict:
    """Errors (predicted - measured) / measured of time and memory, and the verdict."""
    total = row["fwd_s"] + row["bwd_s"]
    out = {
        "measured_tflops": row["flops_fwd_bwd"] / total / 1e12,
        "time_ratio_measured_over_pred": total / row["pred_fwd_bwd_s"],
        "time_error": (row["pred_fwd_bwd_s"] - total) / total,
    }
    ok = abs(out["time_error"]) <= time_tol
    if "mem_bytes" in row:
        out["mem_ratio_measured_over_pred"] = row["mem_bytes"] / row["pred_mem_bytes"]
        out["mem_error"] = (row["pred_mem_bytes"] - row["mem_bytes"]) / row["mem_bytes"]
        ok = ok and abs(out["mem_error"]) <= mem_tol
    out["pass"] = ok
    return out


def bench(
    model,
    cluster,
    seq_len: int,
    micro_batch: int,
    layers,
    iters: int = 5,
    time_tol: float = 0.10,
    mem_tol: float = 0.05,
    other=None,
) -> list:
    """One row per layer: measured next to predicted, with the errors and the verdict; with
    `other` (a second cluster) also that cluster's prediction and errors under `other`."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    device = device or torch.device("cpu")
    started = _init_world_one(cuda)
    rows = []
    for index in layers:
        row = {"layer": index, "kind": model.layers[index].kind, "device": str(device)}
        row["cluster"] = cluster.name
        row.update(predicted(model, index, cluster, seq_len, micro_batch, _dtype_name(device)))
        row.update(measure(model, index, seq_len, micro_batch, device, iters))
        row.update(compare(row, time_tol, mem_tol))
        if other is not None:
            alt = predicted(model, index, other, seq_len, micro_batch, _dtype_name(device))
            alt.update({k: row[k] for k in ("fwd_s", "bwd_s", "mem_bytes") if k in row})
            alt.update(compare(alt, time_tol, mem_tol))
            row["other"] = {"cluster": other.name, **alt}
        rows.append(row)
    if started:
        dist.destroy_process_group()
    return rows


def _dtype_name(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


def _default_layers(model) -> list[int]:
    dense = [i for i, layer in enumerate(model.layers) if layer.kind == "dense"]
    return dense[:1] + list(model.moe_layers[:1])


def _parse_layers(text: str, model) -> list[int]:
    """--layers "i,j": indices into the model's layers, else a SpecError naming the fix."""
    from planner.specs import SpecError

    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        raise SpecError(
            f"--layers {text!r}: give comma-separated layer indices, e.g. 0,1"
        ) from None
    bad = [i for i in layers if not 0 <= i < model.num_layers]
    if bad:
        raise SpecError(
            f"--layers {text}: {bad} outside {model.name}'s layers 0..{model.num_layers - 1}"
        )
    return layers


def _csv(rows: list[dict]) -> str:
    flat = [{k: v for k, v in r.items() if not isinstance(v, dict | list)} for r in rows]
    keys = sorted({k for r in flat for k in r})
    lines = [",".join(keys)]
    lines += [
        ",".join(f"{r[k]:.6g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys)
        for r in flat
    ]
    return "\n".join(lines) + "\n"


def format_row(r: dict, time_tol: float = 0.10, mem_tol: float = 0.05) -> str:
    """Measured beside predicted for one layer, the errors and PASS / FAIL."""
    total = r["fwd_s"] + r["bwd_s"]
    lines = [
        f"layer {r['layer']} ({r['kind']}, {r['device']}, cluster {r['cluster']}): measured "
        f"fwd {r['fwd_s'] * 1e3:.2f} ms + bwd {r['bwd_s'] * 1e3:.2f} ms = {total * 1e3:.2f} ms "
        f"({r['measured_tflops']:.3g} TFLOPS)",
        f"  predicted fwd+bwd {r['pred_fwd_bwd_s'] * 1e3:.2f} ms, time error "
        f"{100 * r['time_error']:+.1f}% (tolerance {100 * time_tol:.0f}%)",
    ]
    host = r["pred_work_s"].get("host", 0.0)
    if host > 0:
        lines[-1] += (
            f"; {100 * (r['pred_fwd_bwd_s'] - host - total) / total:+.1f}% without the "
            f"profile's host time per layer ({host * 1e3:.2f} ms)"
        )
    if "mem_bytes" in r:
        lines.append(
            f"  peak memory measured {r['mem_bytes'] / 2**30:.3f} GiB, predicted "
            f"{r['pred_mem_bytes'] / 2**30:.3f} GiB, memory error {100 * r['mem_error']:+.1f}% "
            f"(tolerance {100 * mem_tol:.0f}%)"
        )
    else:
        lines.append("  peak memory not measured on this device")
    work = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r["pred_work_s"].items())
    lines.append(f"  predicted work (ms): {work}; tables: {', '.join(r['pred_tables']) or 'none'}")
    alt = r.get("other")
    if alt:
        mem = f", memory error {100 * alt['mem_error']:+.1f}%" if "mem_error" in alt else ""
        lines.append(
            f"  cluster {alt['cluster']} predicts {alt['pred_fwd_bwd_s'] * 1e3:.2f} ms, time "
            f"error {100 * alt['time_error']:+.1f}%{mem} (not checked)"
        )
    lines.append(f"  {'PASS' if r['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from planner.specs import SpecError

    try:
        return _main(argv)
    except SpecError as exc:
        print(f"layer_bench: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
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
    p.add_argument("--time-tol", type=float, default=0.10, help="pass: |time error| <= this")
    p.add_argument("--mem-tol", type=float, default=0.05, help="pass: |memory error| <= this")
    p.add_argument("--check", action="store_true", help="exit 1 when a layer fails")
    p.add_argument(
        "--other-cluster", default=None, help="also print this cluster's prediction (unchecked)"
    )
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
    layers = _parse_layers(args.layers, model) if args.layers else _default_layers(model)
    cluster = load_cluster(args.cluster)
    other = load_cluster(args.other_cluster) if args.other_cluster else None
    rows = bench(
        model,
        cluster,
        seq_len,
        args.micro_batch,
        layers,
        args.iters,
        args.time_tol,
        args.mem_tol,
        other,
    )
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
        for r in rows:
            print(format_row(r, args.time_tol, args.mem_tol))
    return 1 if args.check and not all(r["pass"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
