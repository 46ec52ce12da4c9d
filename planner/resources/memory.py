"""Memory per rank: training state of each layer and activations per in-flight micro-batch.

Every formula is derived in planner/RESOURCE_MODEL.md (section "Memory"); the comments
here give the one-line reason. All results are bytes held by ONE rank.

Notation: b micro-batch (sequences per rank), s sequence length, d hidden size, T = b*s/tp
tokens per rank (sequence parallel splits tokens over tp), k top-k, E routed experts,
f expert ffn width, a = bytes per activation element (2 for bf16/fp16/fp8, 4 for fp32).

Two accountings:
- "piper" (default): every tensor that the backward pass needs, from the layer's shapes.
- "paper": the Piper paper's own equations, literally (attention 4 d^2 parameters,
  activations 12 b s d + 4 b H s^2 for attention and 2 b s k (3 f + d) / EP for experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from planner.parallel import ParallelConfig
from planner.resources.params import layer_params, mlp_params
from planner.specs import LayerSpec, ModelSpec, Recompute, TrainingSpec

Accounting = Literal["piper", "paper"]
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master + Adam m + Adam v (4 + 4 + 4)
WEIGHT_BYTES_PER_PARAM = 2  # bf16 / fp16 weights


@dataclass(frozen=True)
class StateBytes:
    """Training state one rank holds for some parameters (bytes)."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(
            self.weights + other.weights,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
        )


@dataclass(frozen=True)
class ActBytes:
    """Activation bytes one rank keeps for one micro-batch of one layer, by component."""

    components: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return sum(v for _, v in self.components)


def act_bytes_per_element(training: TrainingSpec) -> int:
    """Activations are stored in the compute dtype; fp8 recipes keep bf16 activations."""
    return 4 if training.dtype == "fp32" else 2


def state_bytes(
    params_dense: float,
    params_expert: float,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> StateBytes:
    """State of `params_dense` non-expert parameters (already divided by tp) and
    `params_expert` expert parameters (already divided by ep) on one rank.

    Weights 2 B, gradients bytes_per_param - 14 B (2 bf16 in the paper's 16, 4 fp32 in
    Megatron's 18), optimizer 12 B (fp32 master + m + v); with ZeRO / the distributed
    optimizer the 12 B are sharded over dp for dense and over edp for expert parameters.
    """
    params = params_dense + params_expert
    grad_b = training.bytes_per_param - WEIGHT_BYTES_PER_PARAM - OPTIMIZER_BYTES_PER_PARAM
    if training.zero:
        opt_params = params_dense / parallel.dp + params_expert / parallel.edp
    else:
        opt_params = params
    return StateBytes(
        weights=WEIGHT_BYTES_PER_PARAM * params,
        grads=grad_b * params,
        optimizer=OPTIMIZER_BYTES_PER_PARAM * opt_params,
    )


def layer_param_split(
    model: ModelSpec,
    layer: LayerSpec,
    parallel: ParallelConfig,
    accounting: Accounting = "piper",
) -> tuple[float, float]:
    """(non-expert, expert) parameters of one layer held by one rank: non-expert split over
    tp, routed experts over ep (the layer lives on one pipeline stage). The paper's
    accounting counts attention as 4 d^2 and ignores norms and the router."""
    p = layer_params(model, layer)
    dense = p.non_expert
    if accounting == "paper":
        dense = 4 * model.hidden_size**2 + p.dense_mlp
    return dense / parallel.tp, p.experts_total / parallel.ep


def layer_state(
    model: ModelSpec,
    layer: LayerSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    accounting: Accounting = "piper",
) -> StateBytes:
    """Training state of one transformer layer on one rank (see layer_param_split)."""
    dense, expert = layer_param_split(model, layer, parallel, accounting)
    return state_bytes(dense, expert, training, parallel)


def attention_activations(
    model: ModelSpec, layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig
) -> list[tuple[str, float]]:
    """Attention block: norm input + output, q/k/v, context (o-proj input), and the score
    matrices (2 x b H s^2 elements: scores and probabilities) or, with flash attention, the
    fp32 log-sum-exp per head and query. For MHA this is 12 b s d + 4 b H s^2 bytes."""
    att, d, s = layer.attention, model.hidden_size, training.seq_len
    a, tp = act_bytes_per_element(training), parallel.tp
    tokens = parallel.micro_batch * s / tp
    if att.kind == "mla":
        qk = att.qk_nope_head_dim + att.qk_rope_head_dim
        q_out, k_out, v_out = att.num_heads * qk, att.num_heads * qk, att.num_heads * att.v_head_dim
        latent = att.q_lora_rank + att.kv_lora_rank + att.qk_rope_head_dim
    else:
        q_out = att.num_heads * att.head_dim
        k_out = v_out = att.num_kv_heads * att.head_dim
        latent = 0
    heads_per_rank = att.num_heads / tp
    if training.flash_attention:
        scores = 4.0 * parallel.micro_batch * heads_per_rank * s
    else:
        scores = 2.0 * a * parallel.micro_batch * heads_per_rank * s * s
    return [
        ("attn_norm", 2 * a * tokens * d),
        ("qkv", a * tokens * (q_out + k_out + v_out + latent)),
        ("context", a * tokens * v_out if att.kind == "mla" else a * tokens * q_out),
        ("scores", scores),
    ]


def mlp_activations(
    model: ModelSpec, layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig
) -> list[tuple[str, float]]:
    """MLP half of a layer. MoE: norm, router probabilities (fp32) and top-k weights/indices,
    the k routed copies each rank receives (dispatch, x skew on the hot rank), the expert
    intermediates (gate, up, act*up for gated experts; up, act otherwise; x skew), the
    combine input (k expert outputs per token), shared experts; dense: the MLP intermediates."""
    d, a = model.hidden_size, act_bytes_per_element(training)
    tokens = parallel.micro_batch * training.seq_len / parallel.tp
    out = [("mlp_norm", 2 * a * tokens * d)]
    if layer.dense_ffn:
        mats = 3 if layer.dense_gated else 2
        out.append(("dense_mlp", a * tokens * mats * layer.dense_ffn))
    moe = layer.moe
    if moe is None:
        return out
    skew, k = training.routing_skew, moe.top_k
    mats = 3 if moe.gated else 2
    out += [
        ("router", tokens * (4 * moe.num_experts + 12 * k)),
        ("dispatch", skew * a * tokens * k * d),
        ("experts", skew * a * tokens * k * mats * moe.expert_ffn),
        ("combine", a * tokens * k * d),
    ]
    if moe.num_shared_experts:
        out.append(("shared", a * tokens * moe.num_shared_experts * mats * moe.shared_ffn))
    return out


def paper_activations(
    model: ModelSpec, layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig
) -> list[tuple[str, float]]:
    """The paper's per-micro-batch terms with b = this rank's micro-batch: attention
    12 b s d + 4 b H s^2 (s^2 term dropped with flash attention), experts
    2 b s k (3 f + d) / EP (3 f for gated experts, 2 f otherwise), divided by tp."""
    b, s, d, tp = parallel.micro_batch, training.seq_len, model.hidden_size, parallel.tp
    heads = layer.attention.num_heads
    scores = 0.0 if training.flash_attention else 4.0 * b * heads * s * s
    out = [("attn", (12.0 * b * s * d + scores) / tp)]
    if layer.moe is not None:
        mats = 3 if layer.moe.gated else 2
        k, f = layer.moe.top_k, layer.moe.expert_ffn
        out.append(("experts", 2.0 * b * s * k * (mats * f + d) / parallel.ep / tp))
    if layer.dense_ffn:
        mats = 3 if layer.dense_gated else 2
        out.append(("dense_mlp", 2.0 * b * s * (mats * layer.dense_ffn + d) / tp))
    return out


def layer_activations(
    model: ModelSpec,
    layer: LayerSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    recompute: Recompute = "none",
    accounting: Accounting = "piper",
) -> ActBytes:
    """Activation bytes one rank keeps per in-flight micro-batch for one layer.

    recompute "selective" drops the attention score terms (recomputed in backward, as
    Megatron's selective recompute does); "full" keeps only the layer input (a T d).
    """
    if recompute == "full":
        a = act_bytes_per_element(training)
        tokens = parallel.micro_batch * training.seq_len / parallel.tp
        return ActBytes((("layer_input", a * tokens * model.hidden_size),))
    if accounting == "paper":
        parts = paper_activations(model, layer, training, parallel)
    else:
        parts = attention_activations(model, layer, training, parallel)
        parts += mlp_activations(model, layer, training, parallel)
    if recompute == "selective":
        parts = [(n, 0.0 if n == "scores" else v) for n, v in parts]
    return ActBytes(tuple(parts))


@dataclass(frozen=True)
class Held:
    """Parameters (per rank) and activation bytes (per in-flight micro-batch) of a stage role."""

    params_dense: float
    params_expert: float
    act_bytes: float


def embedding_held(model: ModelSpec, training: TrainingSpec, parallel: ParallelConfig) -> Held:
    """First stage: the vocab-parallel embedding (V d / tp parameters); activations: the int64
    token ids (the embedding output is the first layer's input, counted there)."""
    params = model.vocab_size * model.hidden_size / parallel.tp
    ids = 8.0 * parallel.micro_batch * training.seq_len / parallel.tp
    return Held(params, 0.0, ids)


def head_held(model: ModelSpec, training: TrainingSpec, parallel: ParallelConfig) -> Held:
    """Last stage: final norm + output head (a tied head is a separate copy when pp > 1, as in
    Megatron), fp32 logits b s V / tp, final norm in/out; plus each MTP module (norms,
    2d -> d projection, one layer like the last, its own fp32 logits)."""
    d, v, tp = model.hidden_size, model.vocab_size, parallel.tp
    a = act_bytes_per_element(training)
    tokens = parallel.micro_batch * training.seq_len / tp
    untied_or_split = not model.tie_word_embeddings or parallel.pp > 1
    dense = (v * d if untied_or_split else 0) / tp + d
    expert = 0.0
    act = 2 * a * tokens * d + 4.0 * tokens * v
    if model.num_mtp_layers:
        last = model.layers[-1]
        p = layer_params(model, last)
        per_dense = (3 * d + 2 * d * d + p.non_expert) / tp
        dense += model.num_mtp_layers * per_dense
        expert += model.num_mtp_layers * p.experts_total / parallel.ep
        layer_act = layer_activations(model, last, training, parallel).total
        per_act = layer_act + a * tokens * 2 * d + 4.0 * tokens * v
        act += model.num_mtp_layers * per_act
    return Held(dense, expert, act)


def expert_bytes(model: ModelSpec, training: TrainingSpec) -> float:
    """Training state of ONE routed expert (weights + grads + optimizer), for migration costs."""
    moe = model.first_moe
    if moe is None:
        return 0.0
    params = mlp_params(model.hidden_size, moe.expert_ffn, moe.gated, moe.expert_bias)
    return float(training.bytes_per_param * params)
