"""Memory per rank: training state of each layer and activations per in-flight micro-batch.

Every formula is derived in planner/RESOURCE_MODEL.md (section "Memory"); the comments
here give the one-line reason. All results are bytes held by ONE rank.

Notation: b micro-batch (sequences per rank), s sequence length, d hidden size,
T = b*s/(tp*cp) tokens per rank (sequence parallelism splits tokens over tp, context
parallelism the sequence over cp), k top-k, E routed experts, f expert ffn width,
a = bytes per activation element (2 for bf16/fp16 and the FP8 / FP4 recipes, 4 for fp32).

Two accountings:
- "piper" (default): every tensor that the backward pass needs, from the layer's shapes.
- "paper": the Piper paper's own equations, literally (attention 4 d^2 parameters,
  activations 12 b s d + 4 b H s^2 for attention and 2 b s k (3 f + d) / EP for experts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from planner.parallel import ParallelConfig
from planner.resources import act_offload, op_sac
from planner.resources.params import layer_params, mlp_params, tp_replicated_params
from planner.resources.precision import QUANTIZED_WEIGHT_BYTES
from planner.resources.recompute import budget_kept, kept_components
from planner.specs import LayerSpec, ModelSpec, Recompute, TrainingSpec

Accounting = Literal["piper", "paper"]
MASTER_BYTES_PER_PARAM = 4  # fp32 master weights
# Megatron's precision-aware optimizer hands the master weights of bf16 parameters to
# Transformer Engine's FusedAdam, which stores only the 16 low bits of each fp32 master weight
# (its high 16 bits are the bf16 parameter): Megatron-Core `optimizer_config.py`
# store_param_remainders = True, passed to FusedAdam in `optimizer/__init__.py`.
MASTER_REMAINDER_BYTES_PER_PARAM = 2
WEIGHT_BYTES_PER_PARAM = 2  # bf16 / fp16 weights
REMAINDER_DTYPES = ("bf16", "nvfp4", "mxfp4")  # master remainders with bf16 parameters
FP32_BYTES = 4  # fp32 training's weights and gradients
GRAD_BYTES_PER_PARAM = {"fp32": 4, "bf16": 2}  # the gradient buffer (TrainingSpec.grad_dtype)
# Adam m + v: fp32 (4 + 4) or bf16 (2 + 2, Megatron's --exp-avg-dtype/--exp-avg-sq-dtype bf16
# with --use-precision-aware-optimizer)
MOMENT_BYTES_PER_PARAM = {"fp32": 8, "bf16": 4}
# With --optimizer-cpu-offload, Megatron's HybridDeviceOptimizer (`optimizer/cpu_offloading/
# hybrid_optimizer.py`, param_update_in_fp32=True) keeps, for the parameters it leaves on the
# device, an fp32 copy and torch-Adam moments in that copy's dtype: 4 + 4 + 4 B, whatever the
# moment dtype; the offloaded share lives in pinned host memory.
OFFLOAD_DEVICE_BYTES_PER_PARAM = 12
FSDP_GATHERED_UNITS = 2  # Megatron-FSDP: >= 2 units of un-sharded weights and gradients


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


def rank_tokens(training: TrainingSpec, parallel: ParallelConfig) -> float:
    """T = b s / (tp cp): the tokens one rank holds in a sequence-parallel region."""
    return parallel.micro_batch * training.seq_len / (parallel.tp * parallel.cp)


def weight_bytes_per_param(training: TrainingSpec) -> int:
    """The weights the GEMMs read, per parameter: 2 B (bf16 / fp16; the bf16 copies FP8
    recipes keep), 4 B when the training runs in fp32."""
    return FP32_BYTES if training.dtype == "fp32" else WEIGHT_BYTES_PER_PARAM


def master_bytes_per_param(training: TrainingSpec) -> int:
    """Master weights on the device: fp32 (4 B), or the 2 B remainders of bf16 parameters
    under the precision-aware optimizer. Under an FP8 or MXFP8 recipe Megatron-Core keeps fp32
    main params itself (`optimizer_config.py`: use_precision_aware_optimizer_no_fp8_or_ds_fp8
    is false for current-scaling, blockwise and MX recipes), so remainders need bf16 or an FP4
    recipe (`--fp4-format` leaves `fp8_recipe` at its 'delayed' default, which
    `get_megatron_optimizer_config` copies into the optimizer config, so TE's FusedAdam keeps
    the remainders of the bf16 parameters). None without master weights (pure bf16 training)
    and in fp32 training, whose fp32 weights are the ones Adam updates."""
    if not training.master_weights or training.dtype == "fp32":
        return 0
    if training.precision_aware_optimizer and training.dtype in REMAINDER_DTYPES:
        return MASTER_REMAINDER_BYTES_PER_PARAM
    return MASTER_BYTES_PER_PARAM


def optimizer_bytes_per_param(training: TrainingSpec) -> int:
    """Master weights + Adam moments per optimizer parameter kept on the device: 12 B (fp32
    master, fp32 m + v), 8 B with bf16 moments, 2 B less with master remainders."""
    return master_bytes_per_param(training) + MOMENT_BYTES_PER_PARAM[training.optimizer_dtype]


def device_optimizer_bytes(params: float, training: TrainingSpec) -> float:
    """Optimizer bytes on the device for `params` optimizer parameters of one rank: all at
    optimizer_bytes_per_param, or with a host offload fraction f > 0 the device's 1 - f share
    at HybridDeviceOptimizer's 12 B (its offload is by parameter count: the first f of the
    rank's optimizer parameters go to the host, `_get_sub_optimizer_param_groups`)."""
    f = training.optimizer_offload_fraction
    if f > 0.0:
        return OFFLOAD_DEVICE_BYTES_PER_PARAM * (1.0 - f) * params
    return optimizer_bytes_per_param(training) * params


def grad_bytes_per_param(training: TrainingSpec) -> int:
    """The gradient buffer: training.grad_dtype's bytes when set, fp32 in fp32 training, else
    the accounting's: 2 (the paper's 16 B/param: bf16 gradients) or 4 (Megatron's 18: fp32
    main grads)."""
    if training.grad_dtype is not None:
        return GRAD_BYTES_PER_PARAM[training.grad_dtype]
    if training.dtype == "fp32":
        return FP32_BYTES
    return training.bytes_per_param - WEIGHT_BYTES_PER_PARAM - 12


def fsdp_reduce_bytes_per_param(training: TrainingSpec) -> int:
    """Bytes per parameter FSDP's gradient reduce-scatter moves: training.fsdp_reduce_dtype's,
    else Megatron-FSDP's default, the model's gradient dtype (the weights' bytes)."""
    if training.fsdp_reduce_dtype is not None:
        return GRAD_BYTES_PER_PARAM[training.fsdp_reduce_dtype]
    return weight_bytes_per_param(training)


def state_bytes(
    params_dense: float,
    params_expert: float,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> StateBytes:
    """State of `params_dense` non-expert parameters (already divided by tp) and
    `params_expert` expert parameters (already divided by etp * ep) on one rank.

    Weights 2 B, gradients bytes_per_param - 14 B (2 bf16 in the paper's 16, 4 fp32 in
    Megatron's 18; grad_dtype overrides), optimizer 12 B (fp32 master + m + v; 8 B with bf16
    moments; device_optimizer_bytes for master remainders and host offload). fp32 training:
    weights 4, gradients 4, optimizer 8 (no master). The dense
    parameters' data-parallel group is dp x cp (Megatron-Core reduces and shards them over
    its dp-cp group, `distributed_data_parallel.py`), the experts' is edp. The distributed
    optimizer (`zero`) shards the optimizer bytes over it: 6 + 12/d B per parameter with
    Megatron's 18 (`docs/user-guide/features/dist_optimizer.md`). FSDP (Megatron-FSDP
    optim_grads_params, `docs/user-guide/features/megatron_fsdp.md`) shards all three: 18/d.
    FSDP held unsharded through the micro-batches (fsdp_holds_unsharded) adds the whole bf16
    weights (2 B) and the fp32 unsharded gradients (4 B) per parameter it shards (the experts
    only with edp > 1). fp8_blockwise and the FP4 recipes add their cached quantized weight
    copies (quantized_weight_bytes).
    """
    params = params_dense + params_expert
    dense_dp = parallel.dp * parallel.cp
    sharded = params_dense / dense_dp + params_expert / parallel.edp
    kept = sharded if training.fsdp else params
    # FSDP leaves experts whole when edp = 1 (nothing to shard): already in `kept`
    unsharded = params_dense + (params_expert if parallel.edp > 1 else 0.0)
    held = unsharded if fsdp_holds_unsharded(training, parallel) else 0.0
    return StateBytes(
        weights=weight_bytes_per_param(training) * (kept + held)
        + quantized_weight_bytes(training, params, held),
        grads=grad_bytes_per_param(training) * kept + FSDP_HELD_GRAD_BYTES * held,
        optimizer=device_optimizer_bytes(
            sharded if training.zero or training.fsdp else params, training
        ),
    )


FSDP_HELD_GRAD_BYTES = 4  # unsharded gradients accumulate in FSDP2's fp32 reduce dtype


def quantized_weight_bytes(training: TrainingSpec, params: float, held: float) -> float:
    """The quantized weight copies a block-scaled recipe caches through the micro-batches of a
    step (precision.QUANTIZED_WEIGHT_BYTES per parameter): of every parameter on the rank,
    under FSDP of the units it holds unsharded (the others are quantized when gathered)."""
    per_param = QUANTIZED_WEIGHT_BYTES.get(training.dtype, 0.0)
    return per_param * (held if training.fsdp else params)


def fsdp_holds_unsharded(training: TrainingSpec, parallel: ParallelConfig) -> bool:
    """FSDP units gathered once per step and held unsharded with their gradients through the
    micro-batches (TrainingSpec.fsdp_hold_unsharded, with pp > 1)."""
    return training.fsdp and training.fsdp_hold_unsharded and parallel.pp > 1


def fsdp_gathered_bytes(params_unit: float, training: TrainingSpec) -> float:
    """FSDP's working set: FSDP_GATHERED_UNITS un-sharded units (a layer, or the embedding
    or head) of bf16 weights and of gradients while the next unit is prefetched
    (`megatron_fsdp.md`: "at least two FSDP units worth of un-sharded weight memory ... and
    gradient memory"). `params_unit`: the unit's parameters on this rank before sharding."""
    if not training.fsdp:
        return 0.0
    per_param = weight_bytes_per_param(training) + grad_bytes_per_param(training)
    return FSDP_GATHERED_UNITS * per_param * params_unit


def layer_param_split(
    model: ModelSpec,
    layer: LayerSpec,
    parallel: ParallelConfig,
    accounting: Accounting = "piper",
) -> tuple[float, float]:
    """(non-expert, expert) parameters of one layer held by one rank: non-expert split over
    tp but the ones every TP rank holds whole (params.tp_replicated_params: norms, router,
    row-parallel biases), routed experts over ep and each expert over etp (the layer lives on
    one pipeline stage). The paper's accounting counts attention as 4 d^2 and ignores norms
    and the router."""
    p = layer_params(model, layer)
    expert = p.experts_total / (parallel.ep * parallel.etp)
    if accounting == "paper":
        return (4 * model.hidden_size**2 + p.dense_mlp) / parallel.tp, expert
    whole = tp_replicated_params(model, layer)
    return (p.non_expert - whole) / parallel.tp + whole, expert


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
    fp32 log-sum-exp per head and query. For MHA this is 12 b s d + 4 b H s^2 bytes. With
    context parallelism a rank holds s / cp queries (and their keys and values)."""
    att, d = layer.attention, model.hidden_size
    a, tp = act_bytes_per_element(training), parallel.tp
    tokens = rank_tokens(training, parallel)
    queries = training.seq_len / parallel.cp
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
        scores = 4.0 * parallel.micro_batch * heads_per_rank * queries
    else:
        scores = 2.0 * a * parallel.micro_batch * heads_per_rank * queries * training.seq_len
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
    the routed copies each rank receives (dispatch: its T k copies, all-gathered over etp, x
    skew on the hot rank), the expert intermediates (gate, up, act*up for gated experts; up,
    act otherwise; etp T k rows of width f / etp, x skew), the combine input (k expert outputs
    per token, for the gate gradient; none when the gate is applied in the activation,
    TrainingSpec.gate_in_activation), shared experts; dense: the MLP intermediates."""
    d, a = model.hidden_size, act_bytes_per_element(training)
    tokens = rank_tokens(training, parallel)
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
        ("dispatch", skew * a * tokens * k * d * parallel.etp),
        ("experts", skew * a * tokens * k * mats * moe.expert_ffn),
        ("combine", 0.0 if training.gate_in_activation else a * tokens * k * d),
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

    recompute "selective" drops what the layout's recompute modules rerun in backward
    (core attention unless `parallel.recompute_modules` names others; see
    planner.resources.recompute; "op": torchtitan's per-op SAC, planner.resources.op_sac);
    "full" keeps only the layer input (a T d).
    """
    if recompute == "full":
        a = act_bytes_per_element(training)
        tokens = rank_tokens(training, parallel)
        return ActBytes((("layer_input", a * tokens * model.hidden_size),))
    if accounting == "paper":
        parts = paper_activations(model, layer, training, parallel)
    else:
        parts = attention_activations(model, layer, training, parallel)
        parts += mlp_activations(model, layer, training, parallel)
    full = dict(parts)
    per_elem = act_bytes_per_element(training) * rank_tokens(training, parallel)
    d = model.hidden_size
    modules = parallel.recompute_modules or ("core_attn",)
    budget = budget_kept(layer, parts, training, parallel, d) if accounting != "paper" else None
    if recompute == "selective" and budget is not None:
        parts = budget
    elif recompute == "selective" and modules != (op_sac.OP,):
        parts = kept_components(layer, parts, modules, per_elem, d)
    elif recompute == "selective" and accounting != "paper":  # the paper has no per-op terms
        parts = op_sac.kept_components(layer, parts, training, parallel, per_elem, d)
    if accounting != "paper" and training.dtype in SAVED_LOW_PRECISION_BYTES:
        parts = low_precision_saved(model, layer, training, parallel, parts, full)
    if accounting != "paper" and training.activation_offload_modules:
        moved = act_offload.offloaded(layer, training, parts, full, per_elem, d)
        parts = [(n, v - moved.get(n, 0.0)) for n, v in parts]
    return ActBytes(tuple(parts))


def offloaded_layer_bytes(
    model: ModelSpec,
    layer: LayerSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    recompute: Recompute,
) -> float:
    """One layer's offloaded bytes per micro-batch: the `activation_offload` workspace."""
    if not training.activation_offload_modules:
        return 0.0
    plain = replace(training, activation_offload_modules="")
    kept = layer_activations(model, layer, plain, parallel, recompute).total
    return kept - layer_activations(model, layer, training, parallel, recompute).total


# Under an FP8 recipe Transformer Engine saves a low-precision GEMM's input for its weight
# gradient quantized, not in bf16: the transposed FP8 copy on Hopper (per-tensor scaling),
# the column-wise MXFP8 copy with one E8M0 scale per 32 on Blackwell (TE
# `docs/features/low_precision_training`; LayerNormLinear keeps its quantized norm output).
# Block-scaled recipes save the column-wise copy with its scales: fp8_blockwise one fp32 scale
# per 1 x 128, nvfp4 E2M1 (0.5 B) with an E4M3 scale per 16 (after the Hadamard transform),
# mxfp4 E2M1 with an E8M0 scale per 32 (planner.resources.precision).
SAVED_LOW_PRECISION_BYTES = {
    "fp8": 1.0,
    "mxfp8": 1.0 + 1.0 / 32,
    "fp8_blockwise": 1.0 + 4.0 / 128,
    "nvfp4": 0.5 + 1.0 / 16,
    "mxfp4": 0.5 + 1.0 / 32,
}


def low_precision_saved(
    model: ModelSpec,
    layer: LayerSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    parts: list[tuple[str, float]],
    full: dict[str, float],
) -> list[tuple[str, float]]:
    """`parts` (what recompute keeps of `full`, the layer's components without it) with the
    kept inputs of the low-precision GEMMs at SAVED_LOW_PRECISION_BYTES per element: the
    norm outputs (QKV / fc1 inputs; a norm's input stays bf16), MLA's latents (up-projection
    inputs), the attention context (o-proj input), the routed copies (fc1 input) and the
    activation outputs (fc2 inputs, 1 of `mats` expert intermediates); q / k / v for the
    attention kernel, the fc1 outputs, router and combine stay bf16."""
    a = act_bytes_per_element(training)
    ratio = SAVED_LOW_PRECISION_BYTES[training.dtype] / a
    tokens = rank_tokens(training, parallel)
    d = model.hidden_size
    att, moe = layer.attention, layer.moe
    latent = att.q_lora_rank + att.kv_lora_rank + att.qk_rope_head_dim if att.kind == "mla" else 0

    def gemm_input(name: str, kept: float) -> float:
        if name in ("attn_norm", "mlp_norm"):
            return max(kept - a * tokens * d, 0.0)  # the output, when kept
        if name == "qkv":
            return min(kept, a * tokens * latent)
        if name in ("context", "dispatch"):
            return kept
        if name in ("experts", "shared", "dense_mlp"):
            gated = moe.gated if name != "dense_mlp" and moe else layer.dense_gated
            mats = 3 if gated else 2
            return max(kept - full[name] * (mats - 1) / mats, 0.0)  # act output, when kept
        return 0.0

    return [(n, v - gemm_input(n, v) * (1.0 - ratio)) for n, v in parts]


@dataclass(frozen=True)
class Held:
    """Parameters (per rank) and activation bytes (per in-flight micro-batch) of a stage role."""

    params_dense: float
    params_expert: float
    act_bytes: float


def embedding_held(model: ModelSpec, training: TrainingSpec, parallel: ParallelConfig) -> Held:
    """First stage: the vocab-parallel embedding (ceil(V / tp) d parameters: the vocabulary
    padded to a multiple of tp); activations: the int64 token ids (the embedding output is
    the first layer's input, counted there)."""
    params = -(-model.vocab_size // parallel.tp) * model.hidden_size
    ids = 8.0 * rank_tokens(training, parallel)
    return Held(params, 0.0, ids)


def head_held(model: ModelSpec, training: TrainingSpec, parallel: ParallelConfig) -> Held:
    """Last stage: final norm + output head (a tied head is a separate copy when pp > 1, as in
    Megatron), fp32 logits b s V / tp, final norm in/out; plus each MTP module (norms,
    2d -> d projection, one layer like the last, its own fp32 logits) and, when pp > 1 and
    the head is untied, the embedding copy the MTP modules read (Megatron-LM's MTP stage
    builds one, megatron/core/models/gpt/gpt_model.py:173 at d98e8a6; a tied head is it)."""
    d, v, tp = model.hidden_size, model.vocab_size, parallel.tp
    a = act_bytes_per_element(training)
    tokens = rank_tokens(training, parallel)
    untied_or_split = not model.tie_word_embeddings or parallel.pp > 1
    dense = (-(-v // tp) * d if untied_or_split else 0) + d  # vocab rows padded as embedding
    expert = 0.0
    act = 2 * a * tokens * d + 4.0 * tokens * v
    if model.num_mtp_layers:
        last = model.layers[-1]
        p = layer_params(model, last)
        whole = tp_replicated_params(model, last)  # its 3 norms are whole too
        per_dense = (2 * d * d + p.non_expert - whole) / tp + 3 * d + whole
        dense += model.num_mtp_layers * per_dense
        if parallel.pp > 1 and not model.tie_word_embeddings:
            dense += -(-v // tp) * d
        expert += model.num_mtp_layers * p.experts_total / (parallel.ep * parallel.etp)
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
