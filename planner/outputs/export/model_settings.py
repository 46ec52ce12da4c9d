"""The training settings of a model that its shapes leave out, for the exports to carry.

plan.json embeds the model's shapes (planner.inputs.models.model_config); rotary base and
scaling, norm epsilon, the router's score function, group-limited routing, the routed scaling
factor and the load-balancing loss are read here from the HF config the plan names (its
preset, or the config file it was made from). A key the config leaves out takes the default
of that family's HF config class (transformers' `configuration_<family>.py`), so the export
carries what the model was trained with rather than Megatron's or torchtitan's defaults.

`model_settings(plan, model)` is the entry point; a plan whose config cannot be found gets
the family defaults (`source` is then "").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from planner.inputs.models import resolve_model
from planner.plan.schema import Plan
from planner.specs import ModelSpec, SpecError

RouterScore = Literal["softmax", "sigmoid"]
BalanceLoss = Literal["aux_loss", "seq_aux_loss", "none"]


@dataclass(frozen=True)
class RopeScaling:
    """An HF `rope_scaling` entry: kind "yarn" | "llama3" | "linear" | another HF rope_type."""

    kind: str
    factor: float
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None  # YaRN
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None


@dataclass(frozen=True)
class ModelSettings:
    """Router, normalization and position settings of one model (HF semantics).

    router_pre_softmax: probabilities are a softmax over all experts, taken before top-k
        and not renormalized (HF `norm_topk_prob` false); otherwise the top-k are
        renormalized (a softmax over the selected logits).
    router_groups / router_group_topk: group-limited routing (DeepSeek `n_group`,
        `topk_group`); None when the experts are not grouped.
    expert_bias: aux-loss-free balancing by a per-expert bias (DeepSeek-V3 `noaux_tc`).
    balance_loss, aux_loss_coeff: the load-balancing loss and its weight.
    qk_norm: "" none, "rms" per-head RMSNorm with weights, "l2" weightless L2 (Llama-4).
    nope_layers: layer indices that apply no rotary embedding (Llama-4's NoPE layers).
    attention_chunk: Llama-4's chunked local attention window in tokens (None = off).
    probs_on_input: the router's probability scales the expert's input (Llama-4).
    activation_clamp: GPT-OSS's clamp of the gated activation (`swiglu_limit`), else None.
    source: the config file read ("" when none was found: the family's defaults).
    """

    rope_theta: float
    rope_scaling: RopeScaling | None
    norm_eps: float
    router_score: RouterScore
    router_pre_softmax: bool
    router_groups: int | None
    router_group_topk: int | None
    routed_scaling_factor: float | None
    expert_bias: bool
    balance_loss: BalanceLoss
    aux_loss_coeff: float
    qk_norm: str
    nope_layers: tuple[int, ...]
    attention_chunk: int | None
    probs_on_input: bool
    activation_clamp: float | None
    source: str


# Defaults of each family's HF config class where its config.json may leave a key out.
# Aux-loss weights: transformers' MixtralConfig / Qwen2MoeConfig / Qwen3MoeConfig /
# Llama4TextConfig / PhimoeConfig (router_aux_loss_coef 0.001), OlmoeConfig (0.01),
# GptOssConfig (0.9), DbrxFFNConfig (moe_loss_weight 0.01), DeepseekV2Config
# (aux_loss_alpha 0.001, seq_aux); DeepSeek-V3 and Kimi-K2 balance by expert bias with a
# sequence-wise loss of weight 0.0001 (DeepSeek-V3 technical report, section 4.2).
_AUX_DEFAULT = {
    "olmoe": 0.01, "gpt_oss": 0.9, "dbrx": 0.01, "deepseek_v3": 1e-4, "kimi_k2": 1e-4,
}  # fmt: skip
AUX_FALLBACK = 0.001  # every other family's class default (and Piper's generic models)
_ROPE_DEFAULT = {"mixtral": 1e6, "dbrx": 5e5, "llama4": 5e5, "gpt_oss": 150000.0}
_SEQ_AUX = ("deepseek_v2", "deepseek_v3", "kimi_k2")
_SIGMOID = ("deepseek_v3", "kimi_k2", "llama4")  # score functions from the modeling code
_NORM_TOPK_DEFAULT = {"mixtral": True, "dbrx": True, "gpt_oss": True, "deepseek_v3": True,
                      "kimi_k2": True, "phimoe": True, "arctic": True, "grok-1": True,
                      "moe": True}  # fmt: skip
LLAMA4_NOPE_INTERVAL = 4  # Llama4TextConfig: every 4th layer has no RoPE unless listed
GPT_OSS_CLAMP = 7.0  # GptOssConfig.swiglu_limit


class _Reader:
    """Typed optional reads of one config mapping; a wrong type is one SpecError line."""

    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        self.cfg, self.where = cfg, where

    def number(self, key: str, default: float | None) -> float | None:
        value = self.cfg.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(f"{self.where}: key '{key}' must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0 or value > 1e12:
            raise SpecError(f"{self.where}: key '{key}' must be a finite number in [0, 1e12]")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpecError(f"{self.where}: key '{key}' must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> tuple[int, ...] | None:
        value = self.cfg.get(key)
        if value is None or value == []:
            return None
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise SpecError(f"{self.where}: key '{key}' must be a list of integers")
        return tuple(value)


def _raw_config(plan: Plan) -> tuple[dict[str, Any] | None, str]:
    """The HF config the plan names (preset or file), or None with the reason."""
    entry = plan.model
    for ref in (entry.source.removeprefix("preset:"), entry.name):
        if not ref:
            continue
        try:
            cfg, _, source = resolve_model(ref)
        except SpecError:
            continue
        text = cfg.get("text_config")
        return (text if isinstance(text, dict) else cfg), source
    return None, ""


def _rope_scaling(r: _Reader) -> RopeScaling | None:
    value = r.cfg.get("rope_scaling")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SpecError(f"{r.where}: key 'rope_scaling' must be a mapping or null")
    s = _Reader(value, f"{r.where} rope_scaling")
    kind = str(value.get("rope_type") or value.get("type") or "")
    original = s.number("original_max_position_embeddings", None)
    return RopeScaling(
        kind=kind,
        factor=s.number("factor", 1.0) or 1.0,
        original_max_position_embeddings=None if original is None else int(original),
        beta_fast=s.number("beta_fast", None),
        beta_slow=s.number("beta_slow", None),
        mscale=s.number("mscale", None),
        mscale_all_dim=s.number("mscale_all_dim", None),
        low_freq_factor=s.number("low_freq_factor", None),
        high_freq_factor=s.number("high_freq_factor", None),
    )


def _routing(r: _Reader, family: str) -> dict[str, Any]:
    """Score function, normalization, groups, scaling and balancing of the router."""
    method = str(r.cfg.get("topk_method") or "")
    score = str(r.cfg.get("scoring_func") or ("sigmoid" if family in _SIGMOID else "softmax"))
    if score not in ("softmax", "sigmoid"):
        raise SpecError(f"{r.where}: scoring_func '{score}' is neither softmax nor sigmoid")
    groups = r.number("n_group", None)
    group_topk = r.number("topk_group", None)
    grouped = method in ("group_limited_greedy", "noaux_tc") and (groups or 1) > 1
    norm = r.flag("norm_topk_prob", _NORM_TOPK_DEFAULT.get(family, False))
    expert_bias = method == "noaux_tc"
    aux_key = next((k for k in ("aux_loss_alpha", "router_aux_loss_coef", "moe_loss_weight")
                    if r.cfg.get(k) is not None), None)  # fmt: skip
    aux = r.number(aux_key, None) if aux_key else _AUX_DEFAULT.get(family, AUX_FALLBACK)
    seq_aux = r.flag("seq_aux", family in _SEQ_AUX)
    return {
        "router_score": score,
        "router_pre_softmax": score == "softmax" and not norm,
        "router_groups": int(groups) if grouped and groups else None,
        "router_group_topk": int(group_topk) if grouped and group_topk else None,
        "routed_scaling_factor": r.number("routed_scaling_factor", None),
        "expert_bias": expert_bias,
        "balance_loss": ("seq_aux_loss" if seq_aux else "aux_loss") if aux else "none",
        "aux_loss_coeff": aux or 0.0,
    }


def _nope_layers(r: _Reader, family: str, num_layers: int) -> tuple[int, ...]:
    """Layers without RoPE: Llama-4's `no_rope_layers` (1 = RoPE) or its default interval."""
    if family != "llama4":
        return ()
    flags = r.int_list("no_rope_layers")
    if flags is not None:
        return tuple(i for i, use in enumerate(flags) if not use)
    interval = int(r.number("no_rope_layer_interval", LLAMA4_NOPE_INTERVAL) or 0)
    return tuple(i for i in range(num_layers) if interval and (i + 1) % interval == 0)


def model_settings(plan: Plan, model: ModelSpec) -> ModelSettings:
    """The settings of `plan`'s model: read from its HF config, else its family's defaults.

    Raises SpecError (one line naming the config and the key) for a key of the wrong type.
    """
    cfg, source = _raw_config(plan)
    family = model.family
    r = _Reader(cfg or {}, source or "plan.json model")
    if family == "dbrx" and isinstance(r.cfg.get("attn_config"), dict):
        attn = _Reader(r.cfg["attn_config"], f"{r.where} attn_config")
        rope = attn.number("rope_theta", None)
    else:
        rope = r.number("rope_theta", None)
    eps = r.number("rms_norm_eps", None) or r.number("layer_norm_eps", None)
    qk = model.layers[0].attention.qk_norm
    l2 = family == "llama4" and r.flag("use_qk_norm", True)
    chunk = r.number("attention_chunk_size", None) if family == "llama4" else None
    return ModelSettings(
        rope_theta=rope or _ROPE_DEFAULT.get(family, 10000.0),
        rope_scaling=_rope_scaling(r),
        norm_eps=eps or 1e-5,
        **_routing(r, family),
        qk_norm="l2" if l2 else ("rms" if qk else ""),
        nope_layers=_nope_layers(r, family, model.num_layers),
        attention_chunk=int(chunk) if chunk else None,
        probs_on_input=family == "llama4",
        activation_clamp=r.number("swiglu_limit", GPT_OSS_CLAMP) if family == "gpt_oss" else None,
        source=source,
    )
