"""Parameter counts per component of a ModelSpec, the basis for memory, FLOPs and model-info.

Counting basis (stated everywhere it is reported):
- total_params: every weight of the main model, including the input embedding and an untied
  output head, all routed and shared experts, routers, norms and biases; excluding MTP modules.
- mtp_params: DeepSeek-V3-style multi-token-prediction modules (each: two RMSNorms, the
  2d -> d projection, one full transformer layer, its final norm); their embedding and head
  are shared with the main model, so they are not counted again.
- active_params: the weights one token uses: embedding row-gather counted as the full
  embedding matrix (the convention of published "active" figures), head, attention, dense
  MLPs, shared experts, routers and top_k routed experts per MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.specs import AttentionSpec, LayerSpec, ModelSpec, MoESpec


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer by component."""

    attention: int
    dense_mlp: int  # dense MLP (dense layers, or Arctic's residual MLP)
    expert: int  # ONE routed expert
    num_experts: int
    top_k: int
    shared: int  # all shared experts together (plus Qwen2-MoE's shared gate)
    router: int
    norms: int

    @property
    def experts_total(self) -> int:
        return self.expert * self.num_experts

    @property
    def non_expert(self) -> int:
        """Parameters replicated over the expert-parallel group (not sharded by ep)."""
        return self.attention + self.dense_mlp + self.shared + self.router + self.norms

    @property
    def total(self) -> int:
        return self.non_expert + self.experts_total

    @property
    def active(self) -> int:
        return self.non_expert + self.expert * self.top_k


def attention_matmul_params(att: AttentionSpec, d: int) -> int:
    """Projection weights of one attention block (no biases, norms or sinks)."""
    if att.kind == "mla":
        qk_head = att.qk_nope_head_dim + att.qk_rope_head_dim
        if att.q_lora_rank:
            q = d * att.q_lora_rank + att.q_lora_rank * att.num_heads * qk_head
        else:
            q = d * att.num_heads * qk_head
        kv_down = d * (att.kv_lora_rank + att.qk_rope_head_dim)
        kv_up = att.kv_lora_rank * att.num_heads * (att.qk_nope_head_dim + att.v_head_dim)
        return q + kv_down + kv_up + att.num_heads * att.v_head_dim * d
    q_out, kv_out = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    return 2 * d * q_out + 2 * d * kv_out


def attention_params(att: AttentionSpec, d: int) -> int:
    """Weights of one attention block (projections, biases, MLA norms, sinks, qk-norms)."""
    n = attention_matmul_params(att, d) + (d if att.o_bias else 0)
    if att.kind == "mla":  # RMSNorms on the q and kv low-rank latents
        return n + att.q_lora_rank + att.kv_lora_rank
    q_out, kv_out = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    if att.bias:
        n += q_out + 2 * kv_out
    if att.sinks:
        n += att.num_heads
    if att.qk_norm:
        n += 2 * att.head_dim
    return n


def tp_replicated_params(model: ModelSpec, layer: LayerSpec) -> int:
    """Non-expert parameters of one layer that every tensor-parallel rank holds whole, as
    Megatron-Core does: the norms (layer norms, qk-norms; attention.py:1734-1745), the
    row-parallel o bias (tensor_parallel/layers.py:1482-1499), the router (moe/router.py:64-69),
    the shared expert's gate (moe/shared_experts.py:139) and MLA's down-projections with
    their latent norms (duplicated under Transformer Engine, multi_latent_attention.py:526-599).
    The rest is split over tp."""
    d, att = model.hidden_size, layer.attention
    n = model.norm_params_per_layer + (d if att.o_bias else 0)
    if att.kind == "mla":
        n += d * att.q_lora_rank + att.q_lora_rank if att.q_lora_rank else 0
        n += d * (att.kv_lora_rank + att.qk_rope_head_dim) + att.kv_lora_rank
    elif att.qk_norm:
        n += 2 * att.head_dim
    if layer.moe is not None:
        n += _moe_params(layer.moe, d)[2] + (d if layer.moe.shared_gate else 0)
    return n


def mlp_params(d: int, ffn: int, gated: bool, bias: bool = False) -> int:
    """One MLP / expert: gated = up, gate, down (3 d f); plain = up, down (2 d f)."""
    if ffn == 0:
        return 0
    mats = 3 if gated else 2
    n = mats * d * ffn
    if bias:
        n += (2 * ffn if gated else ffn) + d
    return n


def _moe_params(moe: MoESpec, d: int) -> tuple[int, int, int]:
    expert = mlp_params(d, moe.expert_ffn, moe.gated, moe.expert_bias)
    shared = moe.num_shared_experts * mlp_params(d, moe.shared_ffn, moe.gated)
    if moe.shared_gate:
        shared += d
    router = d * moe.num_experts + (moe.num_experts if moe.router_bias else 0)
    return expert, shared, router


def layer_params(model: ModelSpec, layer: LayerSpec) -> LayerParams:
    """Parameters of one layer of `model` by component."""
    d = model.hidden_size
    expert = shared = router = num_experts = top_k = 0
    if layer.moe is not None:
        expert, shared, router = _moe_params(layer.moe, d)
        num_experts, top_k = layer.moe.num_experts, layer.moe.top_k
    return LayerParams(
        attention=attention_params(layer.attention, d),
        dense_mlp=mlp_params(d, layer.dense_ffn, layer.dense_gated),
        expert=expert,
        num_experts=num_experts,
        top_k=top_k,
        shared=shared,
        router=router,
        norms=model.norm_params_per_layer,
    )


def embedding_params(model: ModelSpec) -> int:
    return model.vocab_size * model.hidden_size


def head_params(model: ModelSpec) -> int:
    """Output projection plus the final norm; the projection is free when tied."""
    proj = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    return proj + model.hidden_size


def mtp_params(model: ModelSpec) -> int:
    """MTP modules: each 2 norms + eh_proj (2d x d) + one layer (like the last) + a final norm."""
    if model.num_mtp_layers == 0:
        return 0
    d = model.hidden_size
    per = 2 * d + 2 * d * d + layer_params(model, model.layers[-1]).total + d
    return model.num_mtp_layers * per


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    mtp: int
    embedding: int
    head: int
    per_layer: tuple[LayerParams, ...]


def count_params(model: ModelSpec) -> ParamCounts:
    """Total, active and MTP parameter counts with the basis in this module's docstring."""
    per_layer = tuple(layer_params(model, layer) for layer in model.layers)
    emb, head = embedding_params(model), head_params(model)
    total = emb + head + sum(p.total for p in per_layer)
    active = emb + head + sum(p.active for p in per_layer)
    return ParamCounts(total, active, mtp_params(model), emb, head, per_layer)
