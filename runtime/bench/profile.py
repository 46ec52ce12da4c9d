"""Micro-benchmarks behind `piper profile`: compute and communication throughput by size.

Run under torchrun (`piper profile` launches it): every rank measures, all at once as in
training, the dense GEMM at the model's K x N by tokens M; the routed experts' grouped GEMM
(E experts in one batched call, and looped one call per expert) by tokens per expert at each
expert shape K x N asked for (`--models`: hidden x expert FFN of those presets); causal
attention by sequence length and head dim; device-memory copy bandwidth; and the MoE permute
(gather of T x k routed rows of width d) and unpermute (scatter-add back onto T tokens)
kernels. Then p2p GB/s between a same-node pair and a cross-node pair, and all-to-all GB/s
per rank inside each node and across the whole job; last, the host time of the runtime's
own layers (runtime/bench/host_time.py). Rank 0 writes one raw JSON file that
`planner.calibrate.profile_tables` turns into a cluster YAML.

Conventions (the planner reads them back):
- GEMM and attention throughput is the training one, as the resource model prices a GEMM
  (t = 3 x forward FLOPs / y): y = 3 x forward FLOPs / time of forward + backward. A GEMM's
  backward is its data-gradient and weight-gradient GEMMs; attention's is autograd through
  `scaled_dot_product_attention`. The forward-only figure is kept beside it as `y_fwd`.
- GEMM forward FLOPs = 2 M K N (x E for the experts); attention forward FLOPs (causal, the
  useful half) = 2 b h s^2 d_h.
- memory bandwidth = 2 x bytes copied / time (read + write).
- permute / unpermute GB/s = (1 + k) T d x element bytes / time: the bytes the resource model
  counts for them (read d, write k d per token; read k d, write d), so GB/s / hbm_gbps is the
  hbm_efficiency that prices them as measured.
- p2p GB/s = message bytes / one-way time (half a ping-pong); all-to-all GB/s per rank =
  bytes each rank sends (its whole send buffer) / time of the slowest rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.bench.comm_bench import comm_rows, median_over_ranks, node_of_ranks
from runtime.bench.host_time import measure_layers
from runtime.bench.timing import time_op

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# tokens per expert of the grouped-GEMM sweep on a GPU (issue 15: 16 to 4,096)
EXPERT_TOKENS_GPU = tuple(2**i for i in range(4, 13))
TRAIN_FACTOR = 3  # forward + backward = 3 x forward FLOPs (planner.resources.compute)
ROUTED_EXPERTS = 64  # experts the permute bench's random routing spreads tokens over


@dataclass(frozen=True)
class ExpertShape:
    """One routed-expert GEMM shape: K = model hidden, N = expert FFN width."""

    model: str
    k: int
    n: int


@dataclass(frozen=True)
class ProfileSizes:
    """What to measure. Token counts are M of one GEMM; bytes are per message / per rank."""

    gemm_k: int
    gemm_n: int
    gemm_tokens: tuple[int, ...]
    experts: int  # experts in the grouped-vs-looped GEMM
    expert_tokens: tuple[int, ...]  # tokens per expert
    expert_shapes: tuple[ExpertShape, ...]  # the first is the profile's gemm_grouped table
    attn_heads: int
    attn_head_dim: int  # the profile's attention table; the others get their own tables
    attn_head_dims: tuple[int, ...]
    attn_seq: tuple[int, ...]
    membw_bytes: tuple[int, ...]
    permute_tokens: tuple[int, ...]  # T tokens, each routed to permute_topk experts
    permute_topk: int
    permute_hidden: int
    p2p_bytes: tuple[int, ...]
    a2a_bytes: tuple[int, ...]
    iters: int


def sizes_for(
    quick: bool,
    on_gpu: bool,
    hidden: int | None,
    ffn: int | None,
    shapes: tuple[ExpertShape, ...] = (),
    topk: int | None = None,
) -> ProfileSizes:
    """Small sizes for a CPU or a --quick run, training-sized ones for a GPU. `hidden` x `ffn`
    is the dense GEMM's K x N (default the first of `shapes`); `shapes` the expert GEMMs."""
    small = quick or not on_gpu
    if shapes:
        hidden, ffn = hidden or shapes[0].k, ffn or shapes[0].n
    k = hidden or (256 if small else 4096)
    n = ffn or (512 if small else 14336)
    shapes = shapes or (ExpertShape("", k, n),)
    if small:
        return ProfileSizes(
            gemm_k=k,
            gemm_n=n,
            gemm_tokens=(16, 64, 256, 1024),
            experts=4,
            expert_tokens=(16, 64, 256),
            expert_shapes=shapes,
            attn_heads=4,
            attn_head_dim=32,
            attn_head_dims=(16, 32),
            attn_seq=(128, 256, 512),
            membw_bytes=(2**20, 2**24),
            permute_tokens=(256, 1024),
            permute_topk=topk or 2,
            permute_hidden=min(k, 256),
            p2p_bytes=(2**10, 2**14, 2**18, 2**20),
            a2a_bytes=(2**12, 2**16, 2**20),
            iters=3 if quick else 5,
        )
    return ProfileSizes(
        gemm_k=k,
        gemm_n=n,
        gemm_tokens=tuple(2**i for i in range(4, 16)),
        experts=8,
        expert_tokens=EXPERT_TOKENS_GPU,
        expert_shapes=shapes,
        attn_heads=32,
        attn_head_dim=128,
        attn_head_dims=(64, 128, 192),
        attn_seq=(512, 1024, 2048, 4096, 8192),
        membw_bytes=(2**24, 2**28, 2**30),
        permute_tokens=(4096, 16384, 32768),
        permute_topk=topk or 8,
        permute_hidden=k,
        p2p_bytes=tuple(2**i for i in range(10, 29, 2)),
        a2a_bytes=tuple(2**i for i in range(10, 29, 2)),
        iters=10,
    )


def shapes_of_models(names: list[str]) -> tuple[tuple[ExpertShape, ...], int | None]:
    """Expert GEMM shapes (hidden x expert FFN; dense FFN for a model without experts) of the
    named presets or config.json paths, and the first model's top-k."""
    from planner.inputs.models import load_model

    shapes, topk = [], None
    for name in names:
        model = load_model(name)
        moe = model.first_moe
        shapes.append(
            ExpertShape(
                name, model.hidden_size, moe.expert_ffn if moe else model.layers[0].dense_ffn
            )
        )
        if topk is None and moe is not None:
            topk = moe.top_k
    return tuple(dict.fromkeys(shapes)), topk


def _train_matmuls(mm: Callable, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """Forward, data-gradient and weight-gradient GEMMs of y = x @ w (batched when 3-D)."""
    return mm(x, w), mm(dy, w.transpose(-1, -2)), mm(x.transpose(-1, -2), dy)


def bench_gemm(
    sz: ProfileSizes, dtype: torch.dtype, device: torch.device
) -> tuple[list[float], list[float]]:
    """Training and forward TFLOPS of x[M, K] @ w[K, N] for each M in sz.gemm_tokens."""
    w = torch.randn(sz.gemm_k, sz.gemm_n, dtype=dtype, device=device)
    train, fwd = [], []
    for m in sz.gemm_tokens:
        x = torch.randn(m, sz.gemm_k, dtype=dtype, device=device)
        dy = torch.randn(m, sz.gemm_n, dtype=dtype, device=device)
        flops = 2.0 * m * sz.gemm_k * sz.gemm_n
        t = time_op(lambda x=x, dy=dy: _train_matmuls(torch.matmul, x, w, dy), device, sz.iters)
        train.append(TRAIN_FACTOR * flops / t / 1e12)
        fwd.append(flops / time_op(lambda x=x: x @ w, device, sz.iters) / 1e12)
    return train, fwd


def bench_expert_gemm(
    sz: ProfileSizes, dtype: torch.dtype, device: torch.device, shape: ExpertShape | None = None
) -> dict[str, list[float]]:
    """TFLOPS of E expert GEMMs of M tokens each at `shape` (default the first): `grouped`
    (training: forward, dgrad, wgrad each one batched call), `grouped_fwd` (forward alone)
    and `looped` (training, one call per expert and GEMM)."""
    shape = shape or sz.expert_shapes[0]
    e, k, n = sz.experts, shape.k, shape.n
    w = torch.randn(e, k, n, dtype=dtype, device=device)
    out: dict[str, list[float]] = {"grouped": [], "grouped_fwd": [], "looped": []}
    for m in sz.expert_tokens:
        x = torch.randn(e, m, k, dtype=dtype, device=device)
        dy = torch.randn(e, m, n, dtype=dtype, device=device)
        flops = 2.0 * e * m * k * n

        def looped(x=x, dy=dy):
            return [_train_matmuls(torch.matmul, x[i], w[i], dy[i]) for i in range(e)]

        t = time_op(lambda x=x, dy=dy: _train_matmuls(torch.bmm, x, w, dy), device, sz.iters)
        out["grouped"].append(TRAIN_FACTOR * flops / t / 1e12)
        t = time_op(lambda x=x: torch.bmm(x, w), device, sz.iters)
        out["grouped_fwd"].append(flops / t / 1e12)
        out["looped"].append(TRAIN_FACTOR * flops / time_op(looped, device, sz.iters) / 1e12)
    return out


def bench_attention(
    sz: ProfileSizes, dtype: torch.dtype, device: torch.device, head_dim: int | None = None
) -> tuple[list[float], list[float]]:
    """Causal scaled-dot-product attention TFLOPS by sequence length at `head_dim` (default
    sz.attn_head_dim): training (3 x 2 b h s^2 d_h / forward + backward time) and forward."""
    d = head_dim or sz.attn_head_dim
    train, fwd = [], []
    for s in sz.attn_seq:
        q, k, v = (
            torch.randn(1, sz.attn_heads, s, d, dtype=dtype, device=device, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(1, sz.attn_heads, s, d, dtype=dtype, device=device)

        def forward(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def step(q=q, k=k, v=v, grad=grad):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad(out, (q, k, v), grad)

        flops = 2.0 * sz.attn_heads * s * s * d
        train.append(TRAIN_FACTOR * flops / time_op(step, device, sz.iters) / 1e12)
        with torch.no_grad():
            fwd.append(flops / time_op(forward, device, sz.iters) / 1e12)
    return train, fwd


def bench_membw(sz: ProfileSizes, device: torch.device) -> list[float]:
    """GB/s of a device-memory copy (bytes read + written)."""
    out = []
    for nbytes in sz.membw_bytes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        t = time_op(lambda src=src, dst=dst: dst.copy_(src), device, sz.iters)
        out.append(2.0 * nbytes / t / 1e9)
    return out


def routed_rows(
    tokens: int, topk: int, device: torch.device, experts: int = ROUTED_EXPERTS
) -> torch.Tensor:
    """Token index of each of the T x k routed copies in expert order (what a dispatcher's
    permute gathers): each token picks k distinct experts of `experts` at random."""
    gen = torch.Generator().manual_seed(tokens * 31 + topk)
    choice = torch.rand(tokens, max(experts, topk), generator=gen).topk(topk, dim=1).indices
    order = torch.argsort(choice.reshape(-1), stable=True)
    return (order // topk).to(device)


def permute(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The T x k routed copies of x[T, d] in expert order."""
    return x.index_select(0, rows)


def unpermute(y: torch.Tensor, rows: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each token's k expert outputs summed back onto it (the combine's scatter-add)."""
    return torch.zeros(tokens, y.shape[1], dtype=y.dtype, device=y.device).index_add_(0, rows, y)


def bench_permute(
    sz: ProfileSizes, dtype: torch.dtype, device: torch.device
) -> tuple[list[float], list[float]]:
    """GB/s of permute and unpermute by tokens T (bytes = (1 + k) T d x element size)."""
    d, k = sz.permute_hidden, sz.permute_topk
    fwd, back = [], []
    for t_tokens in sz.permute_tokens:
        rows = routed_rows(t_tokens, k, device)
        x = torch.randn(t_tokens, d, dtype=dtype, device=device)
        y = torch.randn(t_tokens * k, d, dtype=dtype, device=device)
        nbytes = (1 + k) * t_tokens * d * x.element_size()
        fwd.append(
            nbytes / time_op(lambda x=x, rows=rows: permute(x, rows), device, sz.iters) / 1e9
        )
        t = time_op(lambda y=y, rows=rows, n=t_tokens: unpermute(y, rows, n), device, sz.iters)
        back.append(nbytes / t / 1e9)
    return fwd, back


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


def measure_compute(sz: ProfileSizes, dtype: torch.dtype, device: torch.device) -> dict:
    """The raw JSON's `compute` block on this rank (module docstring: conventions)."""
    med = median_over_ranks
    gemm, gemm_fwd = bench_gemm(sz, dtype, device)
    shapes = []
    for shape in sz.expert_shapes:
        res = {key: med(vals) for key, vals in bench_expert_gemm(sz, dtype, device, shape).items()}
        shapes.append({**asdict(shape), "x": list(sz.expert_tokens), **res})
    heads = []
    for d in dict.fromkeys((sz.attn_head_dim, *sz.attn_head_dims)):
        train, fwd = bench_attention(sz, dtype, device, d)
        heads.append({"head_dim": d, "x": list(sz.attn_seq), "y": med(train), "y_fwd": med(fwd)})
    perm, unperm = bench_permute(sz, dtype, device)
    permute_meta = {
        "topk": sz.permute_topk,
        "hidden": sz.permute_hidden,
        "x": list(sz.permute_tokens),
    }
    first = shapes[0]
    return {
        "gemm": {"x": list(sz.gemm_tokens), "y": med(gemm), "y_fwd": med(gemm_fwd)},
        "gemm_grouped": {"x": first["x"], "y": first["grouped"], "k": first["k"], "n": first["n"]},
        "gemm_looped": {"x": first["x"], "y": first["looped"]},
        "gemm_grouped_shapes": shapes,
        "attention": {"x": heads[0]["x"], "y": heads[0]["y"], "head_dim": heads[0]["head_dim"]},
        "attention_head_dims": heads,
        "membw": {"x": list(sz.membw_bytes), "y": med(bench_membw(sz, device))},
        "permute": {**permute_meta, "y": med(perm)},
        "unpermute": {**permute_meta, "y": med(unperm)},
    }


def run_profile(args: argparse.Namespace, device: torch.device) -> dict:
    """All measurements of this rank; compute numbers are medians over ranks."""
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = _DTYPES[dtype_name]
    models = [m for m in (args.models or "").split(",") if m]
    shapes, topk = shapes_of_models(models) if models else ((), None)
    sz = sizes_for(args.quick, device.type == "cuda", args.hidden, args.ffn, shapes, topk)
    torch.manual_seed(1234 + dist.get_rank())
    compute = measure_compute(sz, dtype, device)
    node_of = node_of_ranks(args.ranks_per_node)
    comm = comm_rows(sz, node_of, device)
    layers = measure_layers(device, sz.iters)
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
        "compute": compute,
        "comm": comm,
        "layers": layers,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Piper micro-benchmarks (run under torchrun)")
    p.add_argument("--raw-out", required=True, help="JSON file rank 0 writes")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    p.add_argument("--hidden", type=int, default=None, help="dense GEMM K (model hidden size)")
    p.add_argument("--ffn", type=int, default=None, help="dense GEMM N (expert FFN width)")
    p.add_argument(
        "--models",
        default=None,
        help="comma-separated presets: the grouped GEMM runs at each one's hidden x expert "
        "FFN (the first is the profile's gemm_grouped table and, without --hidden/--ffn, the "
        "dense GEMM's shape); its top-k sizes the permute bench",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from planner.run.options import die_with_torchrun

    die_with_torchrun()  # no benchmark outlives a killed `piper profile` or torchrun
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("runtime.bench.profile: --device cuda but torch sees no CUDA device")
    if args.models:
        from planner.specs import SpecError

        try:
            shapes_of_models([m for m in args.models.split(",") if m])
        except SpecError as exc:
            raise SystemExit(f"runtime.bench.profile: --models: {exc}") from None
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
