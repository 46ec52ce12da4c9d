"""Micro-benchmarks behind `piper profile`: compute and communication throughput by size.

Run under torchrun (`piper profile` launches it): every rank measures GEMM TFLOPS (one GEMM
of M tokens at the model's K x N; expert GEMMs grouped in one batched call vs looped per
expert), causal attention TFLOPS by sequence length and memory bandwidth, all at once as in
training; then p2p GB/s between a same-node pair and a cross-node pair, and all-to-all GB/s
per rank inside each node and across the whole job. Rank 0 writes one raw JSON file that
`planner.calibrate.profile_tables` turns into a cluster YAML.

Conventions (the planner reads them back): GEMM FLOPs = 2 M K N; attention FLOPs (forward,
causal, the useful half) = 2 b h s^2 d_h; memory bandwidth = 2 x bytes copied / time (read +
write); p2p GB/s = message bytes / one-way time (half a ping-pong); all-to-all GB/s per
rank = bytes each rank sends (its whole send buffer) / time of the slowest rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ProfileSizes:
    """What to measure. Token counts are M of one GEMM; bytes are per message / per rank."""

    gemm_k: int
    gemm_n: int
    gemm_tokens: tuple[int, ...]
    experts: int  # experts in the grouped-vs-looped GEMM
    expert_tokens: tuple[int, ...]  # tokens per expert
    attn_heads: int
    attn_head_dim: int
    attn_seq: tuple[int, ...]
    membw_bytes: tuple[int, ...]
    p2p_bytes: tuple[int, ...]
    a2a_bytes: tuple[int, ...]
    iters: int


def sizes_for(quick: bool, on_gpu: bool, hidden: int | None, ffn: int | None) -> ProfileSizes:
    """Small sizes for a CPU or a --quick run, training-sized ones for a GPU."""
    if quick or not on_gpu:
        return ProfileSizes(
            gemm_k=hidden or 256,
            gemm_n=ffn or 512,
            gemm_tokens=(16, 64, 256, 1024),
            experts=4,
            expert_tokens=(8, 32, 128),
            attn_heads=4,
            attn_head_dim=32,
            attn_seq=(128, 256, 512),
            membw_bytes=(2**20, 2**24),
            p2p_bytes=(2**10, 2**14, 2**18, 2**20),
            a2a_bytes=(2**12, 2**16, 2**20),
            iters=3 if quick else 5,
        )
    return ProfileSizes(
        gemm_k=hidden or 4096,
        gemm_n=ffn or 14336,
        gemm_tokens=tuple(2**i for i in range(4, 16)),
        experts=8,
        expert_tokens=tuple(2**i for i in range(3, 14)),
        attn_heads=32,
        attn_head_dim=128,
        attn_seq=(512, 1024, 2048, 4096, 8192),
        membw_bytes=(2**24, 2**28, 2**30),
        p2p_bytes=tuple(2**i for i in range(10, 29, 2)),
        a2a_bytes=tuple(2**i for i in range(10, 29, 2)),
        iters=10,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn` over `iters` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_gemm(sz: ProfileSizes, dtype: torch.dtype, device: torch.device) -> list[float]:
    """TFLOPS of x[M, K] @ w[K, N] for each M in sz.gemm_tokens."""
    w = torch.randn(sz.gemm_k, sz.gemm_n, dtype=dtype, device=device)
    out = []
    for m in sz.gemm_tokens:
        x = torch.randn(m, sz.gemm_k, dtype=dtype, device=device)
        t = time_op(lambda x=x: x @ w, device, sz.iters)
        out.append(2.0 * m * sz.gemm_k * sz.gemm_n / t / 1e12)
    return out


def bench_expert_gemm(
    sz: ProfileSizes, dtype: torch.dtype, device: torch.device
) -> tuple[list[float], list[float]]:
    """TFLOPS of E expert GEMMs of M tokens each: one batched call vs a Python loop."""
    e, k, n = sz.experts, sz.gemm_k, sz.gemm_n
    w = torch.randn(e, k, n, dtype=dtype, device=device)
    grouped, looped = [], []
    for m in sz.expert_tokens:
        x = torch.randn(e, m, k, dtype=dtype, device=device)
        flops = 2.0 * e * m * k * n
        grouped.append(flops / time_op(lambda x=x: torch.bmm(x, w), device, sz.iters) / 1e12)
        looped.append(
            flops / time_op(lambda x=x: [x[i] @ w[i] for i in range(e)], device, sz.iters) / 1e12
        )
    return grouped, looped


def bench_attention(sz: ProfileSizes, dtype: torch.dtype, device: torch.device) -> list[float]:
    """Causal scaled-dot-product attention TFLOPS (forward, 2 b h s^2 d_h useful FLOPs)."""
    out = []
    for s in sz.attn_seq:
        q, k, v = (
            torch.randn(1, sz.attn_heads, s, sz.attn_head_dim, dtype=dtype, device=device)
            for _ in range(3)
        )
        t = time_op(
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            device,
            sz.iters,
        )
        out.append(2.0 * sz.attn_heads * s * s * sz.attn_head_dim / t / 1e12)
    return out


def bench_membw(sz: ProfileSizes, device: torch.device) -> list[float]:
    """GB/s of a device-memory copy (bytes read + written)."""
    out = []
    for nbytes in sz.membw_bytes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        t = time_op(lambda src=src, dst=dst: dst.copy_(src), device, sz.iters)
        out.append(2.0 * nbytes / t / 1e9)
    return out


def bench_p2p(pair: tuple[int, int], sizes: tuple[int, ...], device, iters: int) -> list[float]:
    """One-way GB/s between the two ranks of `pair` (ping-pong); every rank must call it."""
    rank = dist.get_rank()
    out = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        dist.barrier()
        if rank not in pair:
            out.append(0.0)
            continue
        peer = pair[1] if rank == pair[0] else pair[0]

        def pingpong(buf=buf, peer=peer) -> None:
            if rank == pair[0]:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        t = time_op(pingpong, device, iters)
        out.append(nbytes / (t / 2) / 1e9)
    dist.barrier()
    return out


def bench_a2a(group, group_size: int, sizes: tuple[int, ...], device, iters: int) -> list[float]:
    """All-to-all GB/s per rank (send-buffer bytes / slowest rank's time) in `group`."""
    out = []
    for nbytes in sizes:
        per_peer = max(nbytes // group_size, 1)
        send = torch.ones(per_peer * group_size, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        dist.barrier()
        t = time_op(
            lambda send=send, recv=recv: dist.all_to_all_single(recv, send, group=group),
            device,
            iters,
        )
        slowest = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out.append(per_peer * group_size / float(slowest.item()) / 1e9)
    return out


def _median_over_ranks(values: list[float]) -> list[float]:
    gathered: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [statistics.median(col) for col in zip(*gathered, strict=True)]


def node_of_ranks(ranks_per_node: int | None) -> list[int]:
    """Node index of every rank: from the declared node size, else from hostnames."""
    world = dist.get_world_size()
    if ranks_per_node:
        return [r // ranks_per_node for r in range(world)]
    names: list[str | None] = [None] * world
    dist.all_gather_object(names, socket.gethostname())
    order = list(dict.fromkeys(names))
    return [order.index(n) for n in names]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _comm(sz: ProfileSizes, node_of: list[int], device: torch.device) -> list[dict]:
    """p2p and all-to-all rows, each {kind, ranks, x, y}; every rank calls, rank 0 keeps."""
    world = dist.get_world_size()
    rows: list[dict] = []
    same = [r for r in range(1, world) if node_of[r] == node_of[0]]
    other = [r for r in range(1, world) if node_of[r] != node_of[0]]
    for peer in same[:1] + other[:1]:
        y = bench_p2p((0, peer), sz.p2p_bytes, device, sz.iters)
        rows.append({"kind": "p2p", "ranks": [0, peer], "x": list(sz.p2p_bytes), "y": y})
    nodes = sorted(set(node_of))
    members = [[r for r in range(world) if node_of[r] == n] for n in nodes]
    groups = [dist.new_group(m) for m in members]  # every rank creates every group
    mine = next(i for i, m in enumerate(members) if dist.get_rank() in m)
    if len(members[mine]) > 1 and all(len(m) == len(members[0]) for m in members):
        y = bench_a2a(groups[mine], len(members[mine]), sz.a2a_bytes, device, sz.iters)
        rows.append({"kind": "a2a", "ranks": members[0], "x": list(sz.a2a_bytes), "y": y})
    if len(nodes) > 1:
        y = bench_a2a(None, world, sz.a2a_bytes, device, sz.iters)
        rows.append({"kind": "a2a", "ranks": list(range(world)), "x": list(sz.a2a_bytes), "y": y})
    return rows


def run_profile(args: argparse.Namespace, device: torch.device) -> dict:
    """All measurements of this rank; compute numbers are medians over ranks."""
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = _DTYPES[dtype_name]
    sz = sizes_for(args.quick, device.type == "cuda", args.hidden, args.ffn)
    torch.manual_seed(1234 + dist.get_rank())
    gemm = _median_over_ranks(bench_gemm(sz, dtype, device))
    grouped, looped = bench_expert_gemm(sz, dtype, device)
    grouped, looped = _median_over_ranks(grouped), _median_over_ranks(looped)
    attention = _median_over_ranks(bench_attention(sz, dtype, device))
    membw = _median_over_ranks(bench_membw(sz, device))
    node_of = node_of_ranks(args.ranks_per_node)
    comm = _comm(sz, node_of, device)
    return {
        "machine": {
            "hostname": socket.gethostname(),
            "device": _device_name(device),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "backend": dist.get_backend(),
            "nproc": dist.get_world_size(),
            "ranks_per_node": sum(1 for n in node_of if n == node_of[0]),
            "dtype": dtype_name,
            "quick": bool(args.quick),
        },
        "sizes": asdict(sz),
        "compute": {
            "gemm": {"x": list(sz.gemm_tokens), "y": gemm},
            "gemm_grouped": {"x": list(sz.expert_tokens), "y": grouped},
            "gemm_looped": {"x": list(sz.expert_tokens), "y": looped},
            "attention": {"x": list(sz.attn_seq), "y": attention},
            "membw": {"x": list(sz.membw_bytes), "y": membw},
        },
        "comm": comm,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Piper micro-benchmarks (run under torchrun)")
    p.add_argument("--raw-out", required=True, help="JSON file rank 0 writes")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    p.add_argument("--hidden", type=int, default=None, help="GEMM K (model hidden size)")
    p.add_argument("--ffn", type=int, default=None, help="GEMM N (expert intermediate size)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("runtime.bench.profile: --device cuda but torch sees no CUDA device")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        raw = run_profile(args, device)
        if dist.get_rank() == 0:
            with open(args.raw_out, "w", encoding="utf-8") as fh:
                json.dump(raw, fh, indent=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
