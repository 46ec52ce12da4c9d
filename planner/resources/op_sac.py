"""torchtitan's per-op selective activation checkpointing: what a layer keeps, what it reruns.

torchtitan wraps every transformer block in a checkpoint whose policy (torchtitan 0.3.0
`torchtitan/distributed/activation_checkpoint.py`, the same file at b5bcd76:
`SelectiveAC._wrap_block`, `_get_default_save_ops`) keeps the outputs of
- aten.mm / aten.linear, but every second one: a counter per block and forward saves the 1st,
  3rd, 5th ... and recomputes the 2nd, 4th ...; a matmul whose weight has the shape of a
  `force_recompute_mm_shapes_by_fqns` module (default `moe.router.gate`: the router) is
  recomputed and not counted;
- torch's compute-intensive ops (`torch._functorch.partitioners.get_default_op_list`: bmm,
  addmm, flash / efficient / cuDNN SDPA, _scaled_mm), max, topk, flex attention;
- reduce_scatter_tensor and all_to_all_single (the expert-parallel dispatch and combine);
and recomputes every other op: norms, rope, activations, residual adds, permutes, the
router's gate and softmax / sigmoid, and the routed experts' `torch._grouped_mm` (in neither
list: `torchtitan/models/common/moe.py` GroupedExperts). The block input stays as the
checkpoint's input.

The matmuls of a block in forward order (`linears`): grouped-query attention's fused wqkv and
wo (`models/common/attention.py` FusedQKVLinear: `fuse_qkv=True` in torchtitan's llama3, qwen3
and gpt_oss models and in the export's config module), MLA's wq (or wq_a, wq_b), wkv_a,
wkv_b, wo (`models/deepseek_v3/model.py`), then the dense FFN's or the shared experts' w1, w3,
w2 (`models/common/feed_forward.py`: w2(silu(w1(x)) * w3(x))). Widths are per token of the
rank, on Piper's activation components (planner.resources.memory): a T x width bytes, T the
sequence-parallel tokens; a row-parallel output (wo, w2) is tp times wider before its
reduce-scatter, whose output torchtitan also keeps.

Approximation: with tp > 1 the sequence-parallel
all-gathers before the column-parallel GEMMs are rerun; that communication is not priced.
Where the kept row-parallel outputs would make a layer keep more than without recompute
(tp >= 8 on thin dense layers), the kept bytes are capped at no recompute's.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.parallel import ParallelConfig
from planner.specs import LayerSpec, TrainingSpec

OP = "op"  # the recompute module name of this policy (planner.parallel.RecomputeModule)
TOPK_BYTES_PER_CHOICE = 12  # torch.topk's fp32 value + int64 index per token and choice


@dataclass(frozen=True)
class Linear:
    """One matmul of a block. work: the compute.Work it belongs to; component: the activation
    component its output is part of ("" = none: a row-parallel output, not kept without
    recompute); width: output elements per rank token (x tp for a row-parallel output);
    params: weight elements (its share of the Work's FLOPs)."""

    name: str
    work: str
    component: str
    width: float
    params: float


def _attention(layer: LayerSpec, d: int, tp: int) -> list[Linear]:
    att = layer.attention
    if att.kind != "mla":
        q, kv = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
        return [
            Linear("wqkv", "attn_proj", "qkv", q + 2 * kv, d * (q + 2 * kv)),
            Linear("wo", "attn_proj", "", d * tp, q * d),
        ]
    h, qk = att.num_heads, att.qk_nope_head_dim + att.qk_rope_head_dim
    if att.q_lora_rank:
        q = [
            Linear("wq_a", "attn_proj", "qkv", att.q_lora_rank, d * att.q_lora_rank),
            Linear("wq_b", "attn_proj", "qkv", h * qk, att.q_lora_rank * h * qk),
        ]
    else:
        q = [Linear("wq", "attn_proj", "qkv", h * qk, d * h * qk)]
    down = att.kv_lora_rank + att.qk_rope_head_dim
    up = h * (att.qk_nope_head_dim + att.v_head_dim)
    return q + [
        Linear("wkv_a", "attn_proj", "qkv", down, d * down),
        Linear("wkv_b", "attn_proj", "qkv", up, att.kv_lora_rank * up),
        Linear("wo", "attn_proj", "", d * tp, h * att.v_head_dim * d),
    ]


def _ffn(work: str, width: int, gated: bool, d: int, tp: int) -> list[Linear]:
    ups = [Linear("w1", work, work, width, d * width)]
    if gated:
        ups.append(Linear("w3", work, work, width, d * width))
    return ups + [Linear("w2", work, "", d * tp, width * d)]


def linears(layer: LayerSpec, d: int, tp: int) -> list[tuple[Linear, bool]]:
    """The block's counted matmuls in forward order, each with True when SAC keeps its
    output (odd positions); the router's gate and the grouped expert GEMMs are not counted."""
    out = _attention(layer, d, tp)
    if layer.dense_ffn:
        out += _ffn("dense_mlp", layer.dense_ffn, layer.dense_gated, d, tp)
    moe = layer.moe
    if moe is not None and moe.num_shared_experts:
        out += _ffn("shared", moe.num_shared_experts * moe.shared_ffn, moe.gated, d, tp)
    return [(lin, i % 2 == 0) for i, lin in enumerate(out)]


def kept_components(
    layer: LayerSpec,
    parts: list[tuple[str, float]],
    training: TrainingSpec,
    parallel: ParallelConfig,
    bytes_per_token_elem: float,
    hidden: int,
) -> list[tuple[str, float]]:
    """`parts` (the layer's components without recompute) as per-op SAC keeps them, plus
    "saved_outputs": the kept row-parallel matmul outputs and, with tp > 1, their
    reduce-scatter outputs. `bytes_per_token_elem` = a T.

    Kept: the block input (attn_norm's input), the kept matmul outputs of qkv, dense_mlp and
    shared, the attention output and log-sum-exp (without flash attention, the first bmm's
    scores of the two score matrices), the top-k values and indices, and with ep > 1 the
    dispatch and combine all-to-all outputs. Dropped: norm outputs, rope, activations, the
    router's probabilities and the routed experts' intermediates."""
    full = dict(parts)
    out = {name: 0.0 for name in full}
    out["attn_norm"] = bytes_per_token_elem * hidden
    out["context"] = full.get("context", 0.0)
    scores = full.get("scores", 0.0)
    out["scores"] = scores if training.flash_attention else scores / 2
    saved = 0.0
    for lin, keep in linears(layer, hidden, parallel.tp):
        if not keep:
            continue
        if lin.component:
            out[lin.component] += bytes_per_token_elem * lin.width
        else:
            saved += bytes_per_token_elem * lin.width
    if parallel.tp > 1:  # the reduce-scatter after each row-parallel matmul is always kept
        rows = sum(1 for lin, _ in linears(layer, hidden, parallel.tp) if not lin.component)
        saved += rows * bytes_per_token_elem * hidden
    moe = layer.moe
    if moe is not None:
        tokens = bytes_per_token_elem / (4 if training.dtype == "fp32" else 2)
        out["router"] = TOPK_BYTES_PER_CHOICE * tokens * moe.top_k
        if parallel.ep > 1:
            out["dispatch"], out["combine"] = full["dispatch"], full["combine"]
    kept = [(name, min(out[name], full[name])) for name, _ in parts]
    # at a large tp on a thin layer the kept partial sums can outweigh what no recompute
    # keeps; the stage IP needs recompute to keep no more (planner/ip/stage_dp.py), so the
    # price is capped there: such a layer is priced as if it ran without AC
    excess = sum(v for _, v in kept) + saved - sum(full.values())
    return kept + [("saved_outputs", max(saved - max(excess, 0.0), 0.0))]


def work_share(layer: LayerSpec, hidden: int) -> dict[str, float]:
    """Share of each compute Work's forward that per-op SAC reruns: the recomputed matmuls'
    weights over the Work's (attention projections, dense FFN, shared experts), the whole
    router gate and the whole routed-expert grouped GEMMs; no core attention (SDPA kept)."""
    total: dict[str, float] = {}
    redo: dict[str, float] = {}
    for lin, keep in linears(layer, hidden, 1):
        total[lin.work] = total.get(lin.work, 0.0) + lin.params
        redo[lin.work] = redo.get(lin.work, 0.0) + (0.0 if keep else lin.params)
    share = {work: redo[work] / total[work] for work in total}
    if layer.moe is not None:
        share.update(router=1.0, experts=1.0)
    return share
