"""plan.json's `model.settings`: the training settings of a model that its shapes leave out.

The model's shapes (attention kind, windows and sinks, experts, MTP layers, tied embeddings,
vocabulary) are `model.config` (planner.inputs.models.model_config). Rotary base and scaling,
norm epsilon, the router's score function and normalization, group-limited routing, the
routed scaling factor, the expert bias and the load-balancing loss, QK norm, NoPE layers,
chunked attention and the activation clamp are `model.settings`: read from the HF config at
plan time, so an export reads plan.json alone. A key the config leaves out takes the default
of that family's HF config class (transformers' `configuration_<family>.py`), so the export
carries what the model was trained with rather than Megatron's or torchtitan's defaults.

Entry points:
- `settings_of_model(model) -> ModelSettings`: at plan time, from the config `model.source`
  names (the family's defaults, `from_config` false, when it names none).
- `settings_of_config(cfg, model, where) -> ModelSettings`: from one parsed HF config.
- `settings_to_dict(s)` / `settings_from_dict(d, where)`: the plan.json object and back; the
  reader refuses unknown keys, missing keys and wrong types in one line naming the field.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args, get_origin, get_type_hints

from planner.inputs.models import resolve_model
from planner.inputs.shown import shown
from planner.specs import ModelSpec, SpecError

RouterScore = Literal["softmax", "sigmoid"]
BalanceLoss = Literal["aux_loss", "seq_aux_loss", "none"]
QkNorm = Literal["", "rms", "l2"]
MAX_NUMBER = 1e12  # no theta, epsilon, factor or weight comes near it


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
    from_config: read from the model's HF config; false: the family's defaults (no config).
    source: where this copy was read from ("" for the family's defaults); not in plan.json.
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
    qk_norm: QkNorm
    nope_layers: tuple[int, ...]
    attention_chunk: int | None
    probs_on_input: bool
    activation_clamp: float | None
    from_config: bool
    source: str = field(default="", metadata={"plan_json": False})


PLAN_SETTINGS = "plan.json model.settings"  # ModelSettings.source of a copy read from a plan

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
            raise SpecError(f"{self.where}: key '{key}' must be a number, got {shown(value)}")
        if not 0 <= value <= MAX_NUMBER:  # NaN and infinities fail too
            raise SpecError(f"{self.where}: key '{key}' must be a finite number in [0, 1e12]")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpecError(f"{self.where}: key '{key}' must be true or false, got {shown(value)}")
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
        raise SpecError(f"{r.where}: scoring_func {shown(score)} is neither softmax nor sigmoid")
    groups = r.number("n_group", None)
    group_topk = r.number("topk_group", None)
    grouped = method in ("group_limited_greedy", "noaux_tc") and (groups or 1) > 1
    norm = r.flag("norm_topk_prob", _NORM_TOPK_DEFAULT.get(family, False))
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
        "expert_bias": method == "noaux_tc",
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


def settings_of_config(cfg: dict[str, Any], model: ModelSpec, where: str) -> ModelSettings:
    """The settings HF config `cfg` ({} for none: the family's defaults) gives `model`.

    Args:
        cfg: a parsed config.json (its `text_config` is read when it wraps one).
        model: the model it describes (family, layers, QK norm).
        where: the file, named in errors and kept as `source` ("" for no file).
    Raises:
        SpecError: one line naming the config and a key of the wrong type.
    """
    text = cfg.get("text_config")
    r = _Reader(text if isinstance(text, dict) else cfg, where or "plan.json model")
    family = model.family
    if family == "dbrx" and isinstance(r.cfg.get("attn_config"), dict):
        rope = _Reader(r.cfg["attn_config"], f"{r.where} attn_config").number("rope_theta", None)
    else:
        rope = r.number("rope_theta", None)
    eps = r.number("rms_norm_eps", None) or r.number("layer_norm_eps", None)
    qk = model.layers[0].attention.qk_norm
    l2 = family == "llama4" and r.flag("use_qk_norm", True)
    chunk = r.number("attention_chunk_size", None) if family == "llama4" else None
    settings = ModelSettings(
        rope_theta=rope or _ROPE_DEFAULT.get(family, 10000.0),
        rope_scaling=_rope_scaling(r),
        norm_eps=eps or 1e-5,
        **_routing(r, family),
        qk_norm="l2" if l2 else ("rms" if qk else ""),
        nope_layers=_nope_layers(r, family, model.num_layers),
        attention_chunk=int(chunk) if chunk else None,
        probs_on_input=family == "llama4",
        activation_clamp=r.number("swiglu_limit", GPT_OSS_CLAMP) if family == "gpt_oss" else None,
        from_config=bool(where),
        source=where,
    )
    # what plan.json reads back: a value it would refuse is the config's error, named now
    _build(ModelSettings, settings_to_dict(settings), r.where, fix="fix that key in the config")
    return settings


def settings_of_model(model: ModelSpec) -> ModelSettings:
    """The settings `piper plan` embeds: from the config `model.source` names (a preset or a
    file); the family's defaults for a spec that names none or one in Piper's normalized
    format (which holds shapes only)."""
    ref = model.source.removeprefix("preset:")
    try:
        cfg, _, source = resolve_model(ref) if ref else ({}, "", "")
    except SpecError:  # a spec built in code whose source names no file
        cfg, source = {}, ""
    if cfg.get("model_type") == "piper":
        cfg, source = {}, ""
    return settings_of_config(cfg, model, source)


# ---- plan.json: writing and reading back ---------------------------------------------------


def _json_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.metadata.get("plan_json", True))


def settings_to_dict(s: ModelSettings) -> dict[str, Any]:
    """plan.json's `model.settings` object (every field; null for None)."""
    d: dict[str, Any] = {name: getattr(s, name) for name in _json_fields(ModelSettings)}
    d["nope_layers"] = list(s.nope_layers)
    if s.rope_scaling is not None:
        scaling = s.rope_scaling
        d["rope_scaling"] = {name: getattr(scaling, name) for name in _json_fields(RopeScaling)}
    return d


_FIX = "regenerate the plan with 'piper plan'"


def _field_error(where: str, name: str, problem: str, fix: str = _FIX) -> SpecError:
    dotted = f"model.settings.{name}" if name else "model.settings"
    return SpecError(f"{where}: field '{dotted}' {problem}; {fix}")


_WANTED = {
    float: "a number in [0, 1e12]",
    int: "an integer >= 1",
    bool: "true or false",
    str: "printable text of at most 40 characters",
    RopeScaling: "an object",
    tuple[int, ...]: "a list of layer indices",
}


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31


def _value(hint: Any, value: Any, where: str, name: str, fix: str) -> Any:
    """`value` as the field annotated `hint` holds it, or one SpecError line naming it."""
    args = get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if hint is float and number and 0 <= value <= MAX_NUMBER:  # NaN and infinities fail
        return float(value)
    if hint is int and number and isinstance(value, int) and 1 <= value <= 1 << 31:
        return value
    if hint is bool and isinstance(value, bool):
        return value
    if hint is str and isinstance(value, str) and value.isprintable() and len(value) <= 40:
        return value
    if get_origin(hint) is Literal and value in get_args(hint):
        return value
    if hint == tuple[int, ...] and isinstance(value, list) and all(map(_is_index, value)):
        return tuple(value)
    if hint is RopeScaling and isinstance(value, dict):
        return _build(RopeScaling, value, where, f"{name}.", fix)
    wanted = _WANTED.get(hint) or f"one of {get_args(hint)}"
    raise _field_error(where, name, f"must be {wanted}, got {shown(value)}", fix)


def _build(cls: type, d: dict[str, Any], where: str, prefix: str = "", fix: str = _FIX) -> Any:
    """An instance of `cls` from its plan.json object: every field, no other key."""
    names = _json_fields(cls)
    for key in d:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            section = "model.settings" + (f".{prefix[:-1]}" if prefix else "")
            raise SpecError(
                f"{where}: field '{section}' has an unknown key {shown(key)}{hint}; {fix}"
            )
    hints = get_type_hints(cls)
    values = {}
    for name in names:
        if name not in d:
            raise _field_error(where, f"{prefix}{name}", "is missing", fix)
        values[name] = _value(hints[name], d[name], where, f"{prefix}{name}", fix)
    return cls(**values)


def settings_from_dict(d: Any, where: str = "plan.json") -> ModelSettings:
    """The ModelSettings of plan.json's `model.settings` object.

    Raises:
        SpecError: one line naming `where` and the field: not an object, an unknown or a
            missing key, a value of the wrong type or out of range.
    """
    if not isinstance(d, dict):
        raise _field_error(where, "", f"must be an object, got {type(d).__name__}")
    settings = _build(ModelSettings, d, where)
    return replace(settings, source=PLAN_SETTINGS if settings.from_config else "")
