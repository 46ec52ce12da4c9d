"""A torchtitan 0.3 config module for a model torchtitan has no config function of its own for.

torchtitan 0.3 ships no Mixtral or Llama-4 (`torchtitan/models/__init__.py`), and its HF
transformers backend cannot stand in: its `full_moe` flavor overrides the HF config with
Qwen3-30B-A3B's shapes (`experiments/transformers_modeling_backend/__init__.py`, flavors),
and it finds MoE blocks only under a layer's `mlp` (`model.py`, `_get_moe_attr_name`), so
Llama-4's `feed_forward` MoE would train without expert parallelism. torchtitan's ConfigManager
imports any module named by `--module` (`config/manager.py`, `_load_config`), so the export
writes one: a config function that composes torchtitan's own decoder modules, the ones its
Qwen3 MoE model is made of (`models/qwen3/__init__.py`: `Qwen3TransformerBlock`, grouped-query
attention, `MoE` with a token-choice router and grouped experts, an optional shared expert),
with the plan's shapes layer by layer, and takes the training recipe of `qwen3_30b_a3b`
(loss, data, optimizer, checkpointing); the args file overrides what the plan priced.

`composed_module(plan, model)` renders it: (module name, config function, source text, notes).
The notes name what torchtitan's modules compute differently from the model's own code
(Llama-4's NoPE layers, weightless QK norm, chunked attention and router probability on the
expert input). Which models take this route: planner/targets.py (`composed_families`).
"""

from __future__ import annotations

import re
from importlib.resources import files

from planner.outputs.export.model_settings import model_settings
from planner.plan.schema import Plan
from planner.specs import ModelSpec, SpecError

TORCHTITAN_VERSION = "0.3.0"
# Hugging Face ids of Piper's presets: where torchtitan's download script gets the tokenizer.
HF_IDS = {
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "llama4-scout": "meta-llama/Llama-4-Scout-17B-16E",
    "llama4-maverick": "meta-llama/Llama-4-Maverick-17B-128E",
}

# The module's text, with str.format fields; kept out of the planner's Python sources (the
# module it renders imports torch and torchtitan, the planner never does).
_TEMPLATE = (files("planner.outputs.export") / "torchtitan_config.py.tmpl").read_text()


def _plain(text: str) -> str:
    """`text` with only characters that are safe in a docstring and a comment."""
    return re.sub(r"[^0-9A-Za-z ._:/+-]", "_", text)


def module_name(model: ModelSpec) -> tuple[str, str]:
    """(module, config function) names for `model`: Python identifiers made from its name."""
    slug = re.sub(r"[^0-9a-z]+", "_", model.name.lower()).strip("_") or "model"
    return f"piper_titan_{slug}", f"piper_{slug}"


def _rope(plan: Plan, model: ModelSpec) -> tuple[str, dict[str, object]]:
    """(torchtitan RoPE class, its keyword arguments) for the model's rotary setting."""
    settings = model_settings(plan, model)
    scaling = settings.rope_scaling
    kwargs: dict[str, object] = {"max_seq_len": int(plan.training.get("seq_len", 4096)),
                                 "theta": float(settings.rope_theta)}  # fmt: skip
    if scaling is None or scaling.kind in ("", "default"):
        return "CosSinRoPE", kwargs
    if scaling.kind == "llama3":  # torchtitan's ComplexRoPE "llama" scaling (models/llama3)
        return "ComplexRoPE", kwargs | {
            "scaling": "llama", "scaling_factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor or 1.0,
            "high_freq_factor": scaling.high_freq_factor or 4.0,
            "original_max_position_embeddings": scaling.original_max_position_embeddings or 8192,
        }  # fmt: skip
    raise SpecError(
        f"--target torchtitan: {model.name}'s rope_scaling '{scaling.kind}' has no torchtitan "
        "equivalent in the composed model; plan with --target megatron or --target piper"
    )


def _differences(plan: Plan, model: ModelSpec) -> list[str]:
    """What torchtitan's modules compute differently from the model's own code."""
    s = model_settings(plan, model)
    notes = []
    if s.nope_layers:
        notes.append(f"torchtitan's attention applies RoPE on every layer; {model.name} skips "
                     f"it on {len(s.nope_layers)} of {model.num_layers} layers (NoPE)")  # fmt: skip
    if s.qk_norm == "l2":
        notes.append("torchtitan has no weightless L2 QK norm: the composed model has no QK norm")
    seq = int(plan.training.get("seq_len", 4096))
    if s.attention_chunk and seq > s.attention_chunk:
        notes.append(f"torchtitan's attention is full causal; {model.name} attends in chunks "
                     f"of {s.attention_chunk} tokens on RoPE layers (seq_len {seq})")  # fmt: skip
    if s.probs_on_input:
        notes.append("torchtitan 0.3 scales the expert output by the router probability; "
                     f"{model.name} scales the expert input")  # fmt: skip
    return notes


def composed_module(plan: Plan, model: ModelSpec) -> tuple[str, str, str, tuple[str, ...]]:
    """The config module for `plan`'s model: (module name, config function, source, notes).

    Raises SpecError (one line) for a rotary scaling torchtitan's RoPE modules lack.
    """
    module, function = module_name(model)
    settings = model_settings(plan, model)
    rope_class, rope = _rope(plan, model)
    attention = model.layers[0].attention
    moe = model.first_moe
    if moe is None:  # targets.check_model refuses these before the export
        raise SpecError(f"--target torchtitan: {model.name} has no MoE layer to compose")
    dense = next((layer.dense_ffn for layer in model.layers if layer.moe is None), 0)
    name = plan.model.name or model.name
    hf_id = _plain(HF_IDS.get(name, name))
    text = _TEMPLATE.format(
        version=TORCHTITAN_VERSION, title=_plain(name), module=module, function=function, name=name,
        origin=_plain(f"Model: {name} ({model.family}), from {plan.model.source or 'plan.json'}."),
        rope_class=rope_class, rope=rope, dim=model.hidden_size, vocab=model.vocab_size,
        heads=attention.num_heads, kv_heads=attention.num_kv_heads, head_dim=attention.head_dim,
        eps=float(settings.norm_eps), qk_norm=settings.qk_norm == "rms", dense_ffn=dense,
        moe_layers=tuple(model.moe_layers), experts=moe.num_experts, top_k=moe.top_k,
        expert_ffn=moe.expert_ffn, shared_ffn=moe.shared_ffn * moe.num_shared_experts,
        score=settings.router_score, route_norm=not settings.router_pre_softmax
        and settings.router_score == "softmax", tie=model.tie_word_embeddings,
        layers=model.num_layers, assets=f"./assets/hf/{hf_id.split('/')[-1]}", hf_id=hf_id,
    )  # fmt: skip
    return module, function, text, tuple(_differences(plan, model))
