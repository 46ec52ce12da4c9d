"""Model FLOPs per training token in Megatron-Core's convention: the numerator of every
TFLOPS/GPU and MFU figure Piper reports (`piper model-info`, `piper estimate`, `piper plan`).

The convention is `num_floating_point_operations` of Megatron-LM's
megatron/training/training.py (read at NVIDIA/Megatron-LM d98e8a64dd, core_v0.15.0rc7-2333),
the count behind its logged "throughput per GPU (TFLOP/s/GPU)"; Megatron-Bridge's
flop_utils.py computed the same for the published runs in profiles/runs/published_runs.csv.
Per token, one multiply-add = 2 FLOPs, training = 3 x forward (forward, dgrad, wgrad):
- MLPs: 6 d f x (3 matrices for SwiGLU, 2 otherwise), for dense layers, the shared experts
  and top_k routed experts. GPT-OSS runs under Megatron's --quick-geglu, not --swiglu, so its
  gated experts count 2 matrices, as Megatron logs them.
- attention projections: 6 x (d (q + k + v) + q d) with q = H x head_dim, k = v = kv heads x
  head_dim; MLA: the q and kv low-rank projections (with their norm terms), the rope key and
  the output projection, as Megatron writes them.
- core attention (QK^T and AV): 3 x H (d_qk + d_v) x s, the causal half of the square at
  s = seq_len. Megatron's formula takes every softmax layer as full causal: sliding windows
  are not discounted.
- logits: 6 d V_pad, V padded to a multiple of 128 (Megatron's --make-vocab-size-divisible-by
  at TP 1).
- MTP modules (each a copy of the last layer): that layer, the eh projection 2d -> d, three
  norms of d, and a second logits. They are part of the total when the model trains them.
Not counted: the router, the shared-expert gate, norms, biases, sinks, the embedding gather.
The per-rank time model (compute.py's Work.flops) keeps its own exact counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.specs import AttentionSpec, LayerSpec, ModelSpec

FLOPS_CONVENTION = "Megatron-Core"
FLOPS_FORMULA = (
    "Megatron-Core convention (megatron/training/training.py num_floating_point_operations): "
    "per token 6 x [MLP weights d f (3 matrices for SwiGLU, 2 otherwise: GPT-OSS's "
    "quick-GEGLU counts 2) of dense layers, shared and top_k routed experts + attention "
    "projections + d V_pad logits] + 3 x H (d_qk + d_v) x seq_len per layer (causal half, no "
    "sliding-window discount); MTP modules add their layer, 2d x d projection and logits; "
    "router, norms and embedding gather not counted; V_pad = vocab rounded up to 128"
)
VOCAB_MULTIPLE = 128  # Megatron's default --make-vocab-size-divisible-by (times TP, here 1)
QUICK_GEGLU_FAMILIES = ("gpt_oss",)  # run with --quick-geglu (planner/outputs/export)


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token at `seq_len` in Megatron-Core's convention.

    The parts add up to `total`; `mtp` holds everything the MTP modules add, the other parts
    are the main model's.
    """

    seq_len: int
    mlp: float  # dense MLPs, shared and top_k routed experts
    attention_linear: float  # q/k/v/o projections (MLA: its low-rank projections)
    attention_core: float  # QK^T and AV, causal half
    logits: float  # the output head
    mtp: float  # MTP modules: their layers, eh projections, norms and heads

    @property
    def main(self) -> float:
        """FLOPs per token without the MTP modules."""
        return self.mlp + self.attention_linear + self.attention_core + self.logits

    @property
    def total(self) -> float:
        return self.main + self.mtp


def padded_vocab(vocab_size: int) -> int:
    """Vocabulary rounded up to Megatron's default multiple (128)."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def mlp_flops(model: ModelSpec, layer: LayerSpec) -> float:
    """6 d f x matrices for the dense MLP, shared experts and top_k routed experts."""

    def mats(gated: bool) -> int:
        return 3 if gated and model.family not in QUICK_GEGLU_FAMILIES else 2

    d = model.hidden_size
    width = mats(layer.dense_gated) * layer.dense_ffn
    moe = layer.moe
    if moe is not None:
        width += mats(moe.gated) * (moe.top_k * moe.expert_ffn)
        width += mats(moe.gated) * (moe.num_shared_experts * moe.shared_ffn)
    return 6.0 * d * width


def attention_linear_flops(att: AttentionSpec, d: int) -> float:
    """6 x the projection terms of Megatron's self-attention count."""
    h = att.num_heads
    if att.kind == "mla":
        qk = att.qk_nope_head_dim + att.qk_rope_head_dim
        if att.q_lora_rank:
            q = att.q_lora_rank * (d + h * qk + 1)
        else:
            q = d * h * qk
        kv = att.kv_lora_rank * (d + h * (att.qk_nope_head_dim + att.v_head_dim) + 1)
        return 6.0 * (q + kv + d * att.qk_rope_head_dim + h * att.v_head_dim * d)
    q, kv = h * att.head_dim, att.num_kv_heads * att.head_dim
    return 6.0 * (d * (q + 2 * kv) + q * d)


def attention_core_flops(att: AttentionSpec, seq_len: int) -> float:
    """3 x H (d_qk + d_v) x seq_len: scores and context over the causal half, fwd + bwd."""
    if att.kind == "mla":
        d_qk, d_v = att.qk_nope_head_dim + att.qk_rope_head_dim, att.v_head_dim
    else:
        d_qk = d_v = att.head_dim
    return 3.0 * att.num_heads * (d_qk + d_v) * seq_len


def layer_flops(model: ModelSpec, layer: LayerSpec, seq_len: int) -> float:
    """FLOPs per token of one layer (MLP, projections, core attention)."""
    att = layer.attention
    return (
        mlp_flops(model, layer)
        + attention_linear_flops(att, model.hidden_size)
        + attention_core_flops(att, seq_len)
    )


def flops_per_token(model: ModelSpec, seq_len: int = 4096) -> FlopsPerToken:
    """Training FLOPs per token of `model` at `seq_len` (see the module docstring).

    Args:
        model: the model; `model.num_mtp_layers` MTP modules are counted in `mtp`.
        seq_len: tokens per sequence (the causal attention length).
    Returns:
        FlopsPerToken with the parts in FLOPs per token.
    """
    d = model.hidden_size
    logits = 6.0 * d * padded_vocab(model.vocab_size)
    mtp = 0.0
    if model.num_mtp_layers:
        per_module = layer_flops(model, model.layers[-1], seq_len)
        per_module += 6.0 * (3 * d + 2 * d * d) + logits
        mtp = model.num_mtp_layers * per_module
    return FlopsPerToken(
        seq_len=seq_len,
        mlp=sum(mlp_flops(model, layer) for layer in model.layers),
        attention_linear=sum(attention_linear_flops(ly.attention, d) for ly in model.layers),
        attention_core=sum(attention_core_flops(ly.attention, seq_len) for ly in model.layers),
        logits=logits,
        mtp=mtp,
    )
