"""A rank's local experts slot by slot (the loop) vs in grouped GEMMs (torch._grouped_mm).

For 4, 8 and 16 local experts (runtime.model.moe.Experts, SwiGLU, d = 512, expert FFN 1024
by default) and rows per expert drawn unevenly (a Zipf-like split of rows-per-expert x
experts rows, as routing gives), times forward + backward of each path, `--repeats` times
after one warm-up, and prints the medians side by side with loop / grouped and the largest
difference of the outputs and gradients between the two. On a GPU (`--device cuda`) it
synchronizes before reading the clock. The machine may be shared: the medians say what
this run saw, and the load average is in the header.

Usage: python benchmarks/runtime_experts.py [--repeats 7] [--d 512] [--ffn 1024]
       [--rows-per-expert 256] [--dtype fp32|bf16] [--device cpu|cuda]
What it prints goes to results/runtime_experts.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_md import recorded

from planner.specs import MoESpec
from runtime.model.moe import Experts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def uneven_counts(experts: int, rows_per_expert: int) -> list[int]:
    """rows_per_expert x experts rows split in proportion to 1 / (i + 1), i = 0..experts-1
    (the largest remainders take the rounding), so slot 0 gets the most rows."""
    total = experts * rows_per_expert
    weights = [1.0 / (i + 1) for i in range(experts)]
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(experts), key=lambda i: counts[i] - exact[i])
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _time(experts: Experts, gemm: str, x_ND, counts, w_ND, device) -> tuple[float, tuple]:
    """Seconds of one forward + backward, and (output, input grad, weight grads)."""
    experts.gemm = gemm
    experts.zero_grad(set_to_none=True)
    x = x_ND.detach().requires_grad_(True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    y = experts(x, counts)
    (y.float() * w_ND).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    grads = tuple(p.grad for p in experts.parameters())
    return time.perf_counter() - start, (y.detach(), x.grad, *grads)


def compare(local: int, args, device) -> dict:
    """Median seconds of both paths for `local` experts, and their largest difference."""
    dtype = DTYPES[args.dtype]
    spec = MoESpec(local, 2, expert_ffn=args.ffn, gated=True)
    experts = Experts(args.d, spec, list(range(local)), seed=0, layer=0).to(device, dtype)
    counts = uneven_counts(local, args.rows_per_expert)
    gen = torch.Generator().manual_seed(local)
    x = torch.randn(sum(counts), args.d, generator=gen).to(device, dtype)
    w = torch.randn(sum(counts), args.d, generator=gen).to(device)
    times: dict[str, list[float]] = {"loop": [], "grouped": []}
    outs = {}
    for i in range(args.repeats + 1):
        for gemm in ("loop", "grouped") if i % 2 else ("grouped", "loop"):
            seconds, outs[gemm] = _time(experts, gemm, x, counts, w, device)
            if i:  # the first round warms up
                times[gemm].append(seconds)
    diff = max(
        float((a.float() - b.float()).abs().max())
        for a, b in zip(outs["loop"], outs["grouped"], strict=True)
    )
    return {
        "local": local,
        "rows": sum(counts),
        "loop_ms": 1e3 * statistics.median(times["loop"]),
        "grouped_ms": 1e3 * statistics.median(times["grouped"]),
        "diff": diff,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--rows-per-expert", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--results", default="results/runtime_experts.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    device = torch.device(args.device)
    title = "Local experts: loop vs grouped GEMMs (forward + backward)"
    with recorded(args.results, title, enabled=not args.no_results):
        print(
            f"device {device.type}, {args.dtype}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; SwiGLU experts d={args.d} "
            f"ffn={args.ffn}; rows per expert {args.rows_per_expert} on average, split "
            f"~1/(i+1); median of {args.repeats} after a warm-up"
        )
        print(f"{'local experts':>13} {'rows':>6} {'loop ms':>9} {'grouped ms':>11} "
              f"{'loop/grouped':>13} {'max |diff|':>11}")  # fmt: skip
        for local in (4, 8, 16):
            r = compare(local, args, device)
            print(
                f"{r['local']:>13} {r['rows']:>6} {r['loop_ms']:>9.2f} {r['grouped_ms']:>11.2f} "
                f"{r['loop_ms'] / r['grouped_ms']:>12.2f}x {r['diff']:>11.2e}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
