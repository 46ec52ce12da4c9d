"""Megatron-LM architecture flags of a model: shapes from its ModelSpec, training settings
(rotary, norm, router, balancing) from plan.json's model.settings (planner.plan.settings).

Flag names and their meaning follow Megatron-LM's `megatron/training/arguments.py` and the
TransformerConfig fields they set (`core_transformer_config_from_args`); the per-model
choices match Megatron-LM's own reference configurations under
`examples/post_training/modelopt/conf/` (DeepSeek-R1, Llama-4-Scout, gpt-oss-20b,
Qwen3-30B-A3B) where those exist. What Megatron has no flag for becomes a note.
"""

from __future__ import annotations

from planner.plan.settings import ModelSettings, RopeScaling
from planner.specs import ModelSpec, MoESpec

# Megatron's llama3 rope scaling hard-codes these (rotary_pos_embedding.py::_apply_scaling).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}  # fmt: skip
# MLATransformerConfig's YaRN defaults that have no command-line flag.
_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def _number(value: float) -> str:
    """A flag value without a trailing '.0' (Megatron parses ints and floats alike)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _rope_args(
    s: ModelSettings, scaling: RopeScaling | None, mla: bool
) -> tuple[list[str], list[str]]:
    args = ["--position-embedding-type", "rope"]
    notes = []
    if s.rope_theta.is_integer():
        args += ["--rotary-base", str(int(s.rope_theta))]
    else:
        notes.append(f"rope_theta {s.rope_theta} is not an integer; --rotary-base takes one")
    if mla:  # Megatron's fused RoPE kernel for MLA supports YaRN only
        yarn = scaling is not None and scaling.kind == "yarn"
        args += ["--rope-type", "yarn"] if yarn else ["--rope-type", "rope", "--no-rope-fusion"]
    if scaling is None:
        return args, notes
    if scaling.kind == "yarn" and mla:
        args += ["--rotary-scaling-factor", _number(scaling.factor)]
        args += ["--mscale", _number(scaling.mscale or 1.0)]
        args += ["--mscale-all-dim", _number(scaling.mscale_all_dim or 0.0)]
        fixed = _YARN_FIXED
    elif scaling.kind == "llama3":
        args += ["--use-rope-scaling", "--rope-scaling-factor", _number(scaling.factor)]
        fixed = _LLAMA3_FIXED
    elif scaling.kind == "linear" and scaling.factor.is_integer():
        return args + ["--rotary-seq-len-interpolation-factor", str(int(scaling.factor))], notes
    else:
        where = "with MLA only" if scaling.kind == "yarn" else "not at all"
        notes.append(f"rope_scaling '{scaling.kind}' (factor {scaling.factor}) is not exported: "
                     f"Megatron's GPT model supports it {where}")  # fmt: skip
        return args, notes
    differ = [f"{k}={getattr(scaling, k)}" for k, v in fixed.items()
              if getattr(scaling, k) is not None and getattr(scaling, k) != v]  # fmt: skip
    if differ:
        notes.append(f"rope_scaling {', '.join(differ)} differs from Megatron's fixed "
                     f"{', '.join(f'{k}={v}' for k, v in fixed.items())}")  # fmt: skip
    return args, notes


def _attention_args(model: ModelSpec, s: ModelSettings) -> tuple[list[str], list[str]]:
    att = model.layers[0].attention
    args = ["--num-attention-heads", str(att.num_heads)]
    notes = []
    if att.kind == "mla":  # --qk-layernorm: MLA's norms of the q and kv latents
        args += ["--multi-latent-attention", "--kv-lora-rank", str(att.kv_lora_rank),
                 "--qk-head-dim", str(att.qk_nope_head_dim),
                 "--qk-pos-emb-head-dim", str(att.qk_rope_head_dim),
                 "--v-head-dim", str(att.v_head_dim),
                 "--qk-layernorm"]  # fmt: skip
        if att.q_lora_rank:
            args += ["--q-lora-rank", str(att.q_lora_rank)]
        return args, notes
    if att.num_kv_heads < att.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(att.num_kv_heads)]
    if att.head_dim * att.num_heads != model.hidden_size:
        args += ["--kv-channels", str(att.head_dim)]
    if s.qk_norm == "l2":
        args.append("--qk-l2-norm")
        notes.append("Llama-4 applies its qk L2 norm on RoPE layers only; Megatron on every layer")
    elif s.qk_norm == "rms":
        args.append("--qk-layernorm")
        if model.family == "olmoe":
            notes.append("OLMoE normalizes q and k over the full width; Megatron per head")
    if att.sinks:
        args += ["--softmax-type", "learnable"]
    args += _window_args(model)
    if s.attention_chunk:
        notes.append(f"chunked attention ({s.attention_chunk} tokens) has no Megatron flag; "
                     "Megatron attends over the whole sequence on those layers")  # fmt: skip
    return args, notes


def _window_args(model: ModelSpec) -> list[str]:
    """Sliding windows: `--window-size W,0` and the per-layer pattern (1 = windowed)."""
    windows = [layer.attention.sliding_window for layer in model.layers]
    sizes = {w for w in windows if w}
    if not sizes:
        return []
    (size,) = sizes if len(sizes) == 1 else (max(sizes),)
    pattern = "[" + ",".join("1" if w else "0" for w in windows) + "]"
    return ["--window-size", f"{size},0", "--window-attn-skip-freq", pattern]


def _bias_args(model: ModelSpec) -> tuple[list[str], list[str]]:
    """Megatron's add_bias_linear biases every linear layer; --add-qkv-bias only q, k, v."""
    att, moe = model.layers[0].attention, model.first_moe
    full = att.bias and att.o_bias and (moe is None or moe.expert_bias)
    if full:
        return [], []
    args = ["--disable-bias-linear"] + (["--add-qkv-bias"] if att.bias else [])
    notes = []
    if att.o_bias or (moe is not None and moe.expert_bias):
        notes.append("the model biases only some of its linear layers; Megatron biases all or "
                     "only q/k/v: exported without the output / expert biases")  # fmt: skip
    return args, notes


def _router_args(moe: MoESpec, s: ModelSettings) -> tuple[list[str], list[str]]:
    args = ["--moe-router-score-function", s.router_score, "--moe-router-dtype", "fp32"]
    notes = []
    if s.router_pre_softmax or (moe.top_k == 1 and s.router_score == "softmax"):
        args.append("--moe-router-pre-softmax")
    if s.expert_bias:
        args.append("--moe-router-enable-expert-bias")
    if s.router_groups:
        args += ["--moe-router-num-groups", str(s.router_groups)]
        args += ["--moe-router-group-topk", str(s.router_group_topk or s.router_groups)]
    if s.routed_scaling_factor not in (None, 1.0):
        args += ["--moe-router-topk-scaling-factor", _number(s.routed_scaling_factor or 1.0)]
    args += ["--moe-router-load-balancing-type", s.balance_loss]
    args += ["--moe-aux-loss-coeff", _number(s.aux_loss_coeff)]
    if s.probs_on_input:
        args.append("--moe-apply-probs-on-input")
    if moe.router_bias and not s.expert_bias:
        notes.append("the router's linear bias has no Megatron flag (not exported)")
    return args, notes


def _moe_args(model: ModelSpec, s: ModelSettings) -> tuple[list[str], list[str]]:
    moe = model.first_moe
    if moe is None:
        return [], []
    args = ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.top_k),
            "--moe-ffn-hidden-size", str(moe.expert_ffn), "--moe-grouped-gemm"]  # fmt: skip
    notes = []
    pattern = [1 if layer.kind == "moe" else 0 for layer in model.layers]
    args += ["--moe-layer-freq", "1" if all(pattern) else "[" + ",".join(map(str, pattern)) + "]"]
    if moe.num_shared_experts:
        shared = moe.num_shared_experts * moe.shared_ffn
        args += ["--moe-shared-expert-intermediate-size", str(shared)]
        if moe.shared_gate:
            args.append("--moe-shared-expert-gate")
    router, router_notes = _router_args(moe, s)
    if any(layer.kind == "moe" and layer.dense_ffn for layer in model.layers):
        notes.append("Arctic's dense residual MLP beside the MoE has no Megatron flag")
    return args + router, notes + router_notes


def _mlp_args(model: ModelSpec, clamp: float | None) -> list[str]:
    layer = model.layers[0]
    gated = layer.moe.gated if layer.moe else layer.dense_gated
    if model.family == "gpt_oss":  # (up + 1) * gate * sigmoid(1.702 gate), both clamped
        args = ["--quick-geglu", "--glu-linear-offset", "1.0"]
        return args + (["--activation-func-clamp-value", _number(clamp)] if clamp else [])
    return ["--swiglu"] if gated else []


def model_args(
    model: ModelSpec, settings: ModelSettings, seq_len: int, mtp_layers: int
) -> tuple[list[str], list[str]]:
    """Architecture flags of `model` for Megatron-Core's GPT model, and notes.

    Args:
        model: the plan's model.
        settings: its rotary, norm and router settings.
        seq_len: training sequence length (tokens).
        mtp_layers: multi-token-prediction layers to train (0 = none).
    """
    dense = next((layer.dense_ffn for layer in model.layers if layer.kind == "dense"), 0)
    ffn = dense or (model.first_moe.expert_ffn if model.first_moe else 0)
    norm = "LayerNorm" if model.family == "dbrx" else "RMSNorm"
    args = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--ffn-hidden-size", str(ffn), "--seq-length", str(seq_len),
            "--max-position-embeddings", str(max(seq_len, model.max_position_embeddings)),
            "--normalization", norm, "--norm-epsilon", _number(settings.norm_eps)]  # fmt: skip
    att_args, notes = _attention_args(model, settings)
    mla = model.layers[0].attention.kind == "mla"
    rope, rope_notes = _rope_args(settings, settings.rope_scaling, mla)
    args += att_args + rope + _nope_args(model, settings)
    args += _mlp_args(model, settings.activation_clamp)
    if model.family == "llama4":  # HF Llama-4 rotates (even, odd) pairs
        args.append("--rotary-interleaved")
    if not model.tie_word_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    bias, bias_notes = _bias_args(model)
    moe, moe_notes = _moe_args(model, settings)
    args += bias + moe
    if mtp_layers:
        args += ["--mtp-num-layers", str(mtp_layers)]
    notes += rope_notes + bias_notes + moe_notes
    if model.family == "dbrx":
        notes.append("DBRX's LayerNorm has no bias; Megatron's LayerNorm has one")
    return args, notes


def _nope_args(model: ModelSpec, s: ModelSettings) -> list[str]:
    """Layers without RoPE as Megatron's `--no-rope-freq` (N: every N-th layer, or a list)."""
    if not s.nope_layers:
        return []
    flags = [1 if i in s.nope_layers else 0 for i in range(model.num_layers)]
    period = s.nope_layers[0] + 1
    if flags == [1 if (i + 1) % period == 0 else 0 for i in range(model.num_layers)]:
        return ["--no-rope-freq", str(period)]
    return ["--no-rope-freq", "[" + ",".join(map(str, flags)) + "]"]
