"""Which config.json keys Piper knows, and the near-miss check that keeps a typo from
silently building a different model.

A key Piper reads for some family (READ_KEYS) changes the model; a misspelt one would be
ignored and its setting replaced by a fallback (`moe_intermediate_sise` makes Qwen3's experts
as wide as its dense MLP). So an unknown key that is a near miss of a READ_KEY is an error with
the suggestion, as the cluster reader does for its fields (planner/inputs/clusters.py,
`no_typos`: difflib with cutoff 0.8). Every other key is ignored: Hugging Face configs carry
many that do not change the shapes Piper counts. IGNORED_KEYS lists those of the supported
families' configs (the dataclass fields and `__init__` arguments of transformers'
configuration_<family>.py, e.g. src/transformers/models/qwen3_moe/configuration_qwen3_moe.py,
deepseek_v3/configuration_deepseek_v3.py, and PretrainedConfig's common attributes), so that
one which happens to resemble a read key is never mistaken for a typo.
"""

from __future__ import annotations

import difflib
from typing import Any

from planner.specs import SpecError

EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_top_k", "top_k")
SHARED_KEYS = ("n_shared_experts", "num_shared_experts")

# every key planner/inputs/families.py reads, for any family (a test keeps this complete)
READ_KEYS = frozenset({
    *EXPERTS_KEYS, *TOP_K_KEYS, *SHARED_KEYS,
    "model_type", "hidden_size", "vocab_size", "num_hidden_layers", "max_position_embeddings",
    "max_seq_len", "mlp_gated", "num_attention_heads", "num_key_value_heads", "head_dim",
    "attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "sliding_window", "use_sliding_window", "layer_types", "first_k_dense_replace",
    "moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_frequency",
    "mlp_only_layers", "moe_layers", "moe_intermediate_size", "intermediate_size",
    "intermediate_size_mlp", "shared_expert_intermediate_size", "topk_method", "use_residual",
    "parallel_attn_mlp_res", "residual_intermediate_size", "tie_word_embeddings",
    "num_nextn_predict_layers", "text_config", "d_model", "n_heads", "n_layers", "attn_config",
    "ffn_config", "_piper",
})  # fmt: skip
# DBRX's nested sections: what Piper reads there, and what else its HF config holds
NESTED_READ_KEYS = {
    "attn_config": frozenset({"kv_n_heads"}),
    "ffn_config": frozenset({"ffn_hidden_size", "moe_num_experts", "moe_top_k"}),
}
NESTED_IGNORED_KEYS = frozenset({
    "attn_pdrop", "clip_qkv", "rope_theta", "ffn_act_fn", "moe_jitter_eps", "moe_loss_weight",
    "moe_normalize_expert_weights", "uniform_expert_assignment",
})  # fmt: skip
IGNORED_KEYS = frozenset({
    # PretrainedConfig and generation defaults that configs carry
    "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "initializer_factor", "hidden_act", "activation_function",
    "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "rope_scaling",
    "rope_parameters", "rope_interleave", "partial_rotary_factor", "attention_dropout",
    "hidden_dropout", "embd_pdrop", "resid_pdrop", "emb_pdrop", "output_attentions",
    "output_hidden_states", "return_dict", "is_encoder_decoder", "is_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "quantization_config", "quantization",
    "_name_or_path", "name_or_path", "_attn_implementation", "attn_implementation",
    "pretraining_tp", "use_bfloat16", "torchscript", "top_p", "temperature", "max_length",
    "min_length", "do_sample", "num_beams", "repetition_penalty", "length_penalty",
    "max_window_layers", "mlp_bias", "qkv_bias", "clip_qkv", "lm_head_bias",
    "original_max_position_embeddings", "sliding_window_pattern", "use_qk_norm", "qk_layernorm",
    # MoE routers and their losses
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "input_jitter_noise",
    "router_z_loss_coef", "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group",
    "scoring_func", "aux_loss_alpha", "seq_aux", "ep_size", "moe_layer_start_index",
    # GPT-OSS, Llama-4, Arctic, Grok-1 and multimodal wrappers
    "swiglu_limit", "initial_context_length", "attention_chunk_size", "attn_scale",
    "attn_temperature_tuning", "floor_scale", "no_rope_layers", "no_rope_layer_interval",
    "vision_config", "boi_token_index", "eoi_token_index", "image_token_index",
    "moe_train_capacity_factor", "moe_eval_capacity_factor", "moe_min_capacity",
    "moe_token_dropping", "enable_expert_tensor_parallelism", "attn_output_multiplier",
    "embedding_multiplier_scale", "output_multiplier_scale", "max_attn_value", "swiglu_alpha",
    # real keys of other families' configs that resemble a read key; such a config is read with
    # the generic keys (and says so), its own keys are not typos
    "n_layer", "num_layers", "n_head", "num_heads", "ffn_hidden_size", "mlp_intermediate_size",
    "dense_intermediate_size", "tie_embedding", "qk_head_dim", "q_head_dim", "o_lora_rank",
    "sliding_window_size", "sliding_window_period", "swa_num_attention_heads",
    "swa_num_key_value_heads", "swa_head_dim", "num_global_key_value_heads",
    "num_experts_per_token", "moe_topk", "moe_shared_expert_intermediate_size",
    "shared_intermediate_size", "expert_intermediate_size", "num_dense_layers",
    "moe_layers_enum", "moe_layer_offset", "mlp_layer_types", "mtp_num_hidden_layers",
})  # fmt: skip


def check_key_typos(cfg: dict[str, Any], where: str) -> None:
    """Raise a SpecError for the first key of `cfg` (or of DBRX's nested sections) that is
    unknown and a near miss of a key Piper reads; other unknown keys are left alone."""
    reject_near_misses(cfg, READ_KEYS, IGNORED_KEYS, where)
    for section, read in NESTED_READ_KEYS.items():
        if isinstance(cfg.get(section), dict):
            reject_near_misses(cfg[section], read, NESTED_IGNORED_KEYS, where, f"{section}.")


def reject_near_misses(
    cfg: dict[str, Any],
    read: frozenset[str],
    ignored: frozenset[str] = frozenset(),
    where: str = "config",
    prefix: str = "",
) -> None:
    """Raise a SpecError for the first key of `cfg` outside `read` and `ignored` that is a near
    miss of one in `read`; `prefix` names the section in the message."""
    targets = sorted(read)
    for key in cfg:
        if not isinstance(key, str) or key in read or key in ignored:
            continue
        close = difflib.get_close_matches(key, targets, n=1, cutoff=0.8)
        if close:
            raise SpecError(
                f"{where}: unknown key '{prefix}{key}'; did you mean '{prefix}{close[0]}'? "
                "rename it (an unknown key is ignored)"
            )
