"""Compute per rank: FLOPs of each layer from its shapes and the time they take on a device.

Formulas and constants are derived in planner/RESOURCE_MODEL.md (section "Compute").
FLOPs count multiply-adds as 2; training = forward + backward = 3 x forward (backward does
the data-gradient and the weight-gradient GEMMs). Attention scores are causal: each query
attends (s + 1) / 2 keys on average (or the sliding window).

Under an FP8 / FP4 recipe only the linear layers' GEMMs run in low precision, each with a
`quantize` pass (planner.resources.precision); attention, router and head stay in bf16.

Time of a GEMM group, analytic: a roofline with a skinny-GEMM penalty,
    t = max(F / (peak * eff * M / (M + M_HALF_ROWS)), bytes / HBM) + kernels * KERNEL_LAUNCH_S,
or, when the cluster has a measured `gemm_<dtype>` table (y = achieved TFLOPS at M rows),
    t = F / y(M)  (routed experts prefer `gemm_grouped_<dtype>`, x = tokens per expert).
Attention scores use `attention_<dtype>` (y at sequence length) likewise.

Notation: b micro-batch, s sequence, d hidden, T = b s / (tp cp) tokens per rank, k top-k,
E experts, f expert ffn width, mats = 3 for gated MLPs (SwiGLU) else 2. The tensor-parallel
GEMMs (attention projections, dense MLPs, shared experts, head) see all b s / cp tokens of
their tp group (sequence parallelism gathers them) with 1/tp of the weights, so their FLOPs
summed over the tp ranks are those of tp = 1 (tests/planner/resources/test_compute_tp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.parallel import ParallelConfig
from planner.resources.memory import act_bytes_per_element, rank_tokens
from planner.resources.params import attention_params
from planner.resources.precision import (
    LOW_PRECISION,
    cast_time_s,
    compute_dtype,
    gemm_peak_tflops,
    linear_dtype,
)
from planner.resources.tables import lookup
from planner.specs import AttentionSpec, ClusterSpec, LayerSpec, ModelSpec, TrainingSpec

TRAIN_FACTOR = 3  # forward + backward = 3 x forward FLOPs
KERNEL_LAUNCH_S = 5e-6  # ASSUMPTION: per-kernel launch + tail cost (fwd, dgrad, wgrad each)
M_HALF_ROWS = 128  # ASSUMPTION: a GEMM with 128 rows reaches half its large-GEMM efficiency
ELEMENTWISE_PASSES = 4  # ASSUMPTION: norms/activations/permutes touch each saved byte ~4 times
# Fused attention kernels (FlashAttention-2/3, cuDNN) work in tiles of ATTN_TILE queries x
# ATTN_TILE keys: a causal or windowed mask still computes the whole diagonal tiles.
ATTN_TILE = 128
# A GEMM's efficiency also falls with its reduction length K: each output tile pays a fixed
# prologue and epilogue beside its K / tile MMA steps, so eff ~ K / (K + K_HALF). DeepGEMM's
# FP8 dense GEMMs on H800 (deepseek-ai/DeepGEMM README.md:15-36 @78cacf7, M = 4096) follow
# 1426 K / (K + 730) TFLOPS within 3% from K = 512 to 16,384; a bf16 MMA step takes twice as
# long as an FP8 one, so the same fixed cost is worth half as many elements of K (ASSUMPTION).
# Tensor parallelism shortens K: the row-parallel GEMMs (attention output, MLP down
# projection) reduce over 1/tp of their input, the column-parallel ones' data gradients over
# 1/tp of their output. fp8_blockwise is DeepGEMM's own recipe (1 x 128 / 128 x 128 scales);
# an FP4 MMA step takes half as long as an FP8 one, so FP4's K_HALF is twice FP8's (ASSUMPTION).
K_HALF = {"fp8": 730.0, "mxfp8": 730.0, "fp8_blockwise": 730.0, "nvfp4": 1460.0, "mxfp4": 1460.0}
K_HALF_DEFAULT = 365.0
# Kernel efficiency grows with the head dim as d / (d + ATTN_HEAD_DIM_HALF) (FlashAttention-3,
# Shah et al. 2024, H100 bf16: head dim 64 reaches ~0.7 of head dim 128's TFLOPS); the
# profile's attention_efficiency is the value at head dim 128, and the gain stops at 192.
ATTN_HEAD_DIM_HALF = 96.0
ATTN_REFERENCE_HEAD_DIM = 128.0
ATTN_HEAD_DIM_CAP = 192.0


@dataclass(frozen=True)
class Work:
    """One kind of work of one layer on one rank, per micro-batch, forward + backward."""

    name: str  # attn_proj, attn_core, router, experts, shared, dense_mlp, head, elementwise
    flops: float
    time_s: float
    forward_s: float  # the forward part alone (what recompute repeats)
    tables: tuple[str, ...] = ()  # measured tables used
    cast_io_elems: float = 0.0  # low-precision GEMMs: activation + output-gradient elements
    cast_weights: float = 0.0  # low-precision GEMMs: weights quantized once per step


def causal_context(training: TrainingSpec, att: AttentionSpec) -> float:
    """Average number of keys one query attends to under a causal (sliding-window) mask."""
    s = training.seq_len
    w = att.sliding_window
    if w is None or w >= s:
        return (s + 1) / 2
    return w - w * (w - 1) / (2 * s)  # first w queries see 1..w keys, the rest see w


def kernel_context(training: TrainingSpec, att: AttentionSpec) -> float:
    """Keys per query the fused kernel computes: whole ATTN_TILE x ATTN_TILE tiles, so
    (s + tile) / 2 under a causal mask and w + tile under a sliding window w (capped at s)."""
    s, w, b = training.seq_len, att.sliding_window, ATTN_TILE
    if w is None or w >= s:
        return min((s + b) / 2, s)
    return min(w + b, s)


def attention_head_efficiency(att: AttentionSpec) -> float:
    """The head-dim factor of attention efficiency, 1 at head dim 128 (ATTN_HEAD_DIM_HALF);
    MLA uses the mean of its qk and v head dims."""
    if att.kind == "mla":
        d = (att.qk_nope_head_dim + att.qk_rope_head_dim + att.v_head_dim) / 2
    else:
        d = att.head_dim
    d = min(float(d), ATTN_HEAD_DIM_CAP)
    ref = ATTN_REFERENCE_HEAD_DIM
    return (d / (d + ATTN_HEAD_DIM_HALF)) / (ref / (ref + ATTN_HEAD_DIM_HALF))


def reduction_factor(shapes: tuple[tuple[float, float], ...], dtype: str) -> float:
    """Efficiency factor of the reduction lengths of the forward + backward GEMMs of matrices
    `shapes` ((in, out) per rank, FLOPs in proportion to in x out): the forward reduces over
    `in`, the data gradient over `out`, each at K / (K + K_HALF); the weight gradient reduces
    over the rows (gemm_time's rows factor covers it). The FLOP-weighted harmonic mean, 1 with
    no shapes."""
    if not shapes:
        return 1.0
    half = K_HALF.get(dtype, K_HALF_DEFAULT)
    work = time = 0.0
    for k_in, k_out in shapes:
        w = k_in * k_out
        work += 3 * w
        time += w * (1 + (k_in + half) / k_in + (k_out + half) / k_out)
    return work / time


def gemm_time(
    cluster: ClusterSpec,
    training: TrainingSpec,
    rows: float,
    flops: float,
    bytes_moved: float,
    kernels: int,
    grouped: bool = False,
    dtype: str | None = None,
    shapes: tuple[tuple[float, float], ...] = (),
) -> tuple[float, tuple[str, ...]]:
    """Seconds for GEMMs of `flops` total with `rows` rows (M) each, moving `bytes_moved`
    bytes through HBM in `kernels` launches; and the measured tables used. `grouped` (the
    routed experts) prefers the profiler's `gemm_grouped_<dtype>` table (x = tokens per
    expert) over `gemm_<dtype>`. `dtype`: the GEMM's precision (default the training's).
    `shapes`: the matrices' (in, out) per rank, for the reduction-length factor of the
    analytic path (reduction_factor); a measured table already holds its shapes' factor."""
    if flops <= 0:
        return 0.0, ()
    dtype = dtype or training.dtype
    names = [f"gemm_{dtype}"]
    if grouped:
        names.insert(0, f"gemm_grouped_{dtype}")
    for name in names:
        measured = lookup(cluster, name, max(rows, 1.0))
        if measured is not None:
            return flops / (measured * 1e12), (name,)
    peak = gemm_peak_tflops(cluster, dtype) * 1e12
    half = cluster.grouped_gemm_half_rows if grouped else M_HALF_ROWS
    eff = cluster.gemm_efficiency * rows / (rows + half) * reduction_factor(shapes, dtype)
    compute_s = flops / (peak * eff)
    memory_s = bytes_moved / cluster.hbm_bytes_per_s
    return max(compute_s, memory_s) + kernels * KERNEL_LAUNCH_S, ()


def _gemm_work(
    name: str,
    cluster: ClusterSpec,
    training: TrainingSpec,
    rows: float,
    fwd_flops: float,
    weight_params: float,
    io_elems: float,
    mats: int,
    linear: bool = True,
    shapes: tuple[tuple[float, float], ...] = (),
) -> Work:
    """Forward + backward of GEMMs with `weight_params` weights and `io_elems` input+output
    elements per forward: weights are read 3 times (fwd, dgrad, wgrad writes dW) and the
    activations 3 times; 3 kernels per matrix. `linear` GEMMs run in the recipe's precision,
    the others (router, head) in bf16. `shapes`: (in, out) per matrix and rank."""
    a = act_bytes_per_element(training)
    bytes_moved = a * 3 * (weight_params + io_elems)
    flops = TRAIN_FACTOR * fwd_flops
    grouped = name == "experts"
    dtype = linear_dtype(training) if linear else compute_dtype(training)
    t, tables = gemm_time(
        cluster, training, rows, flops, bytes_moved, 3 * mats, grouped, dtype, shapes
    )
    if linear and dtype in LOW_PRECISION:
        return Work(name, flops, t, t / TRAIN_FACTOR, tables, io_elems, weight_params)
    return Work(name, flops, t, t / TRAIN_FACTOR, tables)


def quantize_work(
    cluster: ClusterSpec, training: TrainingSpec, parallel: ParallelConfig, works: list[Work]
) -> list[Work]:
    """One `quantize` Work for the casts of the low-precision GEMMs among `works` (none in
    bf16); half of it (the inputs X) runs in the forward pass."""
    io = sum(w.cast_io_elems for w in works)
    weights = sum(w.cast_weights for w in works)
    if io <= 0 and weights <= 0:
        return []
    t = cast_time_s(cluster, training, io, weights, parallel.num_microbatches)
    return [Work("quantize", 0.0, t, t / 2)]


def attention_shapes(att: AttentionSpec, d: int, tp: int) -> tuple[tuple[float, float], ...]:
    """(in, out) per rank of an attention block's projections: column-parallel q/k/v (and
    MLA's up-projections) split their output over tp, the row-parallel output projection its
    input; MLA's down-projections are whole on every rank."""
    if att.kind == "mla":
        qk_head = att.qk_nope_head_dim + att.qk_rope_head_dim
        h = att.num_heads
        q = (
            ((d, att.q_lora_rank), (att.q_lora_rank, h * qk_head / tp))
            if att.q_lora_rank
            else ((d, h * qk_head / tp),)
        )
        kv = (
            (d, att.kv_lora_rank + att.qk_rope_head_dim),
            (att.kv_lora_rank, h * (att.qk_nope_head_dim + att.v_head_dim) / tp),
        )
        return (*q, *kv, (h * att.v_head_dim / tp, d))
    q_out, kv_out = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    return ((d, (q_out + 2 * kv_out) / tp), (q_out / tp, d))


def mlp_shapes(d: int, width: float, mats: int) -> tuple[tuple[float, float], ...]:
    """(in, out) of an MLP's up (gate + up when gated) and down projections, `width` being the
    per-rank hidden width."""
    return ((d, (mats - 1) * width), (width, d))


def attention_work(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> list[Work]:
    """Projections (2 b s / cp rows x attention parameters / tp: sequence parallelism
    all-gathers the tp ranks' tokens before the column-parallel GEMMs and each rank holds
    1/tp of the weights) and the causal score/value products (2 b (H/tp) s ctx (d_qk + d_v))
    of one attention block."""
    att, d = layer.attention, model.hidden_size
    rows = parallel.micro_batch * training.seq_len / parallel.cp
    p_att = attention_params(att, d) / parallel.tp
    shapes = attention_shapes(att, d, parallel.tp)
    proj = _gemm_work(
        "attn_proj", cluster, training, rows, 2 * rows * p_att, p_att, rows * 2 * d, 4,
        shapes=shapes,
    )  # fmt: skip
    if att.kind == "mla":
        d_qk, d_v = att.qk_nope_head_dim + att.qk_rope_head_dim, att.v_head_dim
    else:
        d_qk = d_v = att.head_dim
    heads = att.num_heads / parallel.tp
    ctx = causal_context(training, att)
    # causal work is balanced over the cp ranks (2 cp chunks, rank r holds r and 2cp-1-r)
    fwd = 2 * parallel.micro_batch * heads * training.seq_len * ctx * (d_qk + d_v) / parallel.cp
    flops = TRAIN_FACTOR * fwd
    name = f"attention_{compute_dtype(training)}"
    measured = lookup(cluster, name, training.seq_len)
    kernel_flops = flops * kernel_context(training, att) / ctx
    if measured is not None:  # a profile's table: achieved TFLOPS of the causal kernel
        t, tables = flops / (measured * 1e12), (name,)
    else:
        peak = cluster.device.peak(compute_dtype(training)) * 1e12
        eff = cluster.attention_efficiency * attention_head_efficiency(att)
        t, tables = kernel_flops / (peak * eff) + 3 * KERNEL_LAUNCH_S, ()
    core = Work("attn_core", flops, t, t / TRAIN_FACTOR, tables)
    return [proj, core]


def mlp_work(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> list[Work]:
    """Dense MLP, router, routed experts and shared experts of one layer.

    Routed experts on the hottest rank: E/ep local experts, each split over etp, with
    M = etp ep T k / E * skew rows (the tokens of the whole etp x ep group spread over E
    experts, all-gathered over etp), run as one grouped GEMM per matrix of width f / etp;
    FLOPs 2 etp T k skew mats d f / etp = 2 T k skew mats d f. The grouped GEMM's efficiency
    is taken at M / etp rows, the per-expert work of the unsplit expert: splitting over etp
    multiplies the rows by etp and divides the width by etp, so each expert's output tiles
    (M x f / etp) and its forward reduction length d stay, and it earns no rows efficiency;
    the down projection's reduction shortens to f / etp (reduction_factor), which costs
    (Megatron-Core `megatron/core/transformer/moe/README.md`: "Use ETP=1 for MoE (better
    GEMM efficiency, less communication)"). With etp = 1 this is M.
    """
    d = model.hidden_size
    rows = parallel.micro_batch * training.seq_len / parallel.cp
    tokens = rank_tokens(training, parallel)
    out: list[Work] = []
    if layer.dense_ffn:
        mats = 3 if layer.dense_gated else 2
        w = mats * d * layer.dense_ffn / parallel.tp
        io = rows * (2 * d + mats * layer.dense_ffn / parallel.tp)
        shapes = mlp_shapes(d, layer.dense_ffn / parallel.tp, mats)
        out.append(
            _gemm_work("dense_mlp", cluster, training, rows, 2 * rows * w, w, io, mats,
                       shapes=shapes)
        )  # fmt: skip
    moe = layer.moe
    if moe is None:
        return out
    e, k = moe.num_experts, moe.top_k
    f = moe.expert_ffn / parallel.etp
    mats = 3 if moe.gated else 2
    router_w = d * e
    router = _gemm_work(
        "router", cluster, training, rows, 2 * tokens * router_w, router_w, 0.0, 1, linear=False
    )
    out.append(router)
    skew = training.routing_skew
    rows_per_expert = parallel.ep * tokens * k / e * skew  # M / etp: see the docstring
    local = e / parallel.ep
    copies = tokens * k * skew * parallel.etp
    w = local * mats * d * f
    io = copies * (2 * d + mats * f)
    out.append(
        _gemm_work(
            "experts", cluster, training, rows_per_expert, 2 * copies * mats * d * f, w, io, mats,
            shapes=mlp_shapes(d, f, mats),
        )  # fmt: skip
    )
    if moe.num_shared_experts:
        w = moe.num_shared_experts * mats * d * moe.shared_ffn / parallel.tp
        io = rows * (2 * d + moe.num_shared_experts * mats * moe.shared_ffn / parallel.tp)
        shapes = mlp_shapes(d, moe.num_shared_experts * moe.shared_ffn / parallel.tp, mats)
        out.append(
            _gemm_work("shared", cluster, training, rows, 2 * rows * w, w, io, mats, shapes=shapes)
        )
    return out


def memory_bound_bytes(
    model: ModelSpec, layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig
) -> dict[str, float]:
    """HBM bytes of one layer's memory-bound kernels on one rank per micro-batch, forward
    only, by kernel: each reads its inputs and writes its outputs once (a bytes per element).

    norms: 2 x (read d, write d) per token; residual adds: 2 x (read 2d, write d); rope (and
    qk-norm) on q and k: read + write; router: fp32 logits written, softmax / top-k read and
    written (3 x 4 E); permute: read d, write k d per token; the activation (SwiGLU): read
    2 f, write f per routed copy (non-gated: read f, write f); unpermute / combine: read k d,
    write d; shared experts and dense MLPs: their activation likewise. Tokens: T = b s /
    (tp cp) in the sequence-parallel regions, b s / cp with heads / tp inside attention,
    T k skew routed copies (x etp, each f / etp wide)."""
    a = act_bytes_per_element(training)
    d = model.hidden_size
    tokens = rank_tokens(training, parallel)
    full = tokens * parallel.tp  # attention's tokens, with heads / tp
    att = layer.attention
    if att.kind == "mla":
        qk_dim = att.qk_nope_head_dim + att.qk_rope_head_dim
        q = att.num_heads * qk_dim
        k = att.num_heads * qk_dim  # MLA's k is per head after the up-projection
    else:
        q, k = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    passes = 2 if att.qk_norm else 1
    out = {
        "norms": tokens * 2 * 2 * d * a,
        "residual": tokens * 2 * 3 * d * a,
        "rope": full * passes * 2 * (q + k) / parallel.tp * a,
    }
    if layer.dense_ffn:
        mats = 3 if layer.dense_gated else 2
        out["activation"] = full * mats * layer.dense_ffn / parallel.tp * a
    moe = layer.moe
    if moe is not None:
        kk, skew = moe.top_k, training.routing_skew
        out["router"] = tokens * 3 * 4 * moe.num_experts
        out["permute"] = tokens * (1 + kk * skew) * d * a
        copies = tokens * kk * skew * parallel.etp
        width = 3 if moe.gated else 2
        out["activation"] = out.get("activation", 0.0) + copies * width * moe.expert_ffn / (
            parallel.etp
        ) * a
        out["unpermute"] = tokens * (1 + kk * skew) * d * a
        if moe.num_shared_experts:
            out["activation"] += (
                tokens * width * moe.num_shared_experts * moe.shared_ffn * a
            )
    return out


# The backward of a memory-bound kernel reads the output gradient and the saved input and
# writes the input gradient: about twice the forward's bytes.
BACKWARD_BYTES = 2.0


def elementwise_work(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> Work:
    """Norms, residual adds, rope, router softmax / top-k, permute / unpermute and the
    activation functions: memory-bound, their bytes (memory_bound_bytes) forward and
    BACKWARD_BYTES x as many backward at the profile's HBM rate (score matrices excluded,
    their time is in attn_core)."""
    fwd = sum(memory_bound_bytes(model, layer, training, parallel).values())
    t_fwd = fwd / cluster.hbm_bytes_per_s
    t = t_fwd * (1 + BACKWARD_BYTES)
    return Work("elementwise", 0.0, t, t_fwd)


def layer_work(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> list[Work]:
    """All compute of one layer on one rank for one micro-batch, forward + backward."""
    gemms = attention_work(model, layer, cluster, training, parallel)
    gemms += mlp_work(model, layer, cluster, training, parallel)
    casts = quantize_work(cluster, training, parallel, gemms)
    out = gemms + [elementwise_work(model, layer, cluster, training, parallel)] + casts
    host = cluster.layer_overhead_s(training.cuda_graphs)
    if host > 0:
        out.append(Work("host", 0.0, host, host / TRAIN_FACTOR))
    return out


def head_work(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, parallel: ParallelConfig
) -> list[Work]:
    """Output projection (2 (b s / cp) d V / tp: the gathered tokens times the rank's vocabulary
    slice) and the fp32 cross-entropy pass,
    plus each MTP module (2d -> d projection, one layer like the last, its own head)."""
    d, v = model.hidden_size, model.vocab_size
    rows = parallel.micro_batch * training.seq_len / parallel.cp
    tokens = rank_tokens(training, parallel)
    w = d * v / parallel.tp
    heads = 1 + model.num_mtp_layers
    head_flops = heads * 2 * rows * w
    out = [
        _gemm_work("head", cluster, training, rows, head_flops, w, 0.0, heads, linear=False,
                   shapes=((d, v / parallel.tp),))
    ]  # fmt: skip
    ce_s = heads * ELEMENTWISE_PASSES * 4.0 * tokens * v / cluster.hbm_bytes_per_s
    out.append(Work("elementwise", 0.0, ce_s, ce_s / TRAIN_FACTOR))
    if model.num_mtp_layers:
        n = model.num_mtp_layers
        pw = 2 * d * d / parallel.tp
        proj = _gemm_work(
            "mtp_proj", cluster, training, rows, n * 2 * rows * pw, pw, 0.0, n,
            shapes=((2 * d, d / parallel.tp),),
        )  # fmt: skip
        out += [proj, *quantize_work(cluster, training, parallel, [proj])]
        for work in layer_work(model, model.layers[-1], cluster, training, parallel):
            out.append(
                Work(work.name, n * work.flops, n * work.time_s, n * work.forward_s, work.tables)
            )
    return out


def model_flops_per_sequence(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec
) -> float:
    """Training FLOPs (3 x forward) the time model executes for one sequence at balanced
    routing: every layer (router included, the causal square as s (s + 1) / 2 pairs), the
    head and MTP modules. Not the reported convention (MFU and TFLOPS/GPU use Megatron-Core's,
    planner.resources.flops). FLOPs do not depend on the cluster; it is only passed through
    the shared work functions."""
    one = ParallelConfig(pp=1, dp=1)
    balanced = TrainingSpec(
        seq_len=training.seq_len,
        global_batch=training.global_batch,
        dtype=training.dtype,
        flash_attention=training.flash_attention,
    )
    total = sum(w.flops for w in head_work(model, cluster, balanced, one))
    for layer in model.layers:
        total += sum(w.flops for w in attention_work(model, layer, cluster, balanced, one))
        total += sum(w.flops for w in mlp_work(model, layer, cluster, balanced, one))
    return total
