"""Training FLOPs per token of a ModelSpec, as `piper model-info` reports them.

Formula (forward + backward = 3 x forward; one multiply-add = 2 FLOPs):
    flops_per_token = 6 * matmul_params + 6 * sum_layers H * (d_qk + d_v) * ctx
- matmul_params: the weights one token multiplies: attention projections, dense MLPs, shared
  experts, the router, top_k routed experts, and the output head (V x d, also when tied).
  The input embedding is a gather, not a matmul; norms, biases and sinks are negligible.
- the attention term is the score (QK^T) and context (AV) products against ctx = seq_len
  keys, or the sliding window when smaller, without halving for the causal mask (the
  PaLM / Megatron convention: 12 L H Q T for d_qk = d_v = Q and full attention).
- MTP modules (DeepSeek-V3) are reported apart: per module eh_proj (2d x d), one layer, the head.
This is the model-FLOPs numerator of MFU; the resource model prices time separately.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.resources.params import attention_matmul_params
from planner.specs import AttentionSpec, LayerSpec, ModelSpec

FLOPS_FORMULA = (
    "6 x active matmul params (attention, dense/shared/top-k expert MLPs, router, output head; "
    "no embedding gather) + 6 x sum over layers of heads x (d_qk + d_v) x min(seq_len, window) "
    "(attention scores and context, full causal square, fwd+bwd = 3 x fwd)"
)


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token at `seq_len`; `total` excludes MTP modules."""

    seq_len: int
    matmul_params: int  # weights one token multiplies in the main model (forward)
    matmul_flops: float  # 6 x matmul_params
    attention_flops: float  # scores + context, fwd + bwd
    mtp_flops: float  # MTP modules, same rules

    @property
    def total(self) -> float:
        return self.matmul_flops + self.attention_flops


def layer_matmul_params(layer: LayerSpec, d: int) -> int:
    """Weights one token multiplies in one layer (top_k routed experts, not all)."""
    n = attention_matmul_params(layer.attention, d)
    n += (3 if layer.dense_gated else 2) * d * layer.dense_ffn
    moe = layer.moe
    if moe is not None:
        mats = 3 if moe.gated else 2
        n += moe.top_k * mats * d * moe.expert_ffn
        n += moe.num_shared_experts * mats * d * moe.shared_ffn + (d if moe.shared_gate else 0)
        n += d * moe.num_experts
    return n


def layer_attention_flops(att: AttentionSpec, seq_len: int) -> float:
    """Forward score + context FLOPs per token of one layer."""
    if att.kind == "mla":
        d_qk, d_v = att.qk_nope_head_dim + att.qk_rope_head_dim, att.v_head_dim
    else:
        d_qk = d_v = att.head_dim
    ctx = min(seq_len, att.sliding_window) if att.sliding_window else seq_len
    return 2.0 * att.num_heads * (d_qk + d_v) * ctx


def flops_per_token(model: ModelSpec, seq_len: int = 4096) -> FlopsPerToken:
    """Training (fwd + bwd) FLOPs per token of `model` at `seq_len`; see the module formula."""
    d = model.hidden_size
    head = model.vocab_size * d
    matmul = head + sum(layer_matmul_params(layer, d) for layer in model.layers)
    attention = sum(layer_attention_flops(layer.attention, seq_len) for layer in model.layers)
    mtp = 0.0
    if model.num_mtp_layers:
        last = model.layers[-1]
        per = 2 * d * d + layer_matmul_params(last, d) + head
        attn = 3.0 * layer_attention_flops(last.attention, seq_len)
        mtp = model.num_mtp_layers * (6.0 * per + attn)
    return FlopsPerToken(
        seq_len=seq_len,
        matmul_params=matmul,
        matmul_flops=6.0 * matmul,
        attention_flops=3.0 * attention,
        mtp_flops=mtp,
    )
