"""The numerics of a model family that ModelSpec leaves out: RoPE, norm epsilon, router, activation.

ModelSpec (planner/specs.py) holds the shapes the planner prices and the runtime builds (MLA
ranks, sinks, sliding windows, qk-norm, biases, shared experts, dense layers, tied
embeddings). `ModelArch` holds what changes the numbers but not the shapes. `ModelArch()` is
the runtime's own convention, used when a run has neither numerics in its plan nor a Hugging
Face config; `arch_from_hf_config` reads one, so that the runtime computes what
`transformers` computes for that family (tests/runtime/model/test_hf_equivalence.py).

Entry points:
- `numerics_of_config(cfg, where) -> dict`: the keys of an HF config.json the numerics depend on
  (NUMERICS_KEYS; ROPE_KEYS inside its RoPE mapping), their types checked. plan.json's
  `model.numerics` holds this dict, so a run of the plan computes what the config asks for.
- `check_numerics(section, where)`: validate such a section as read back from plan.json.
- `arch_from_hf_config(cfg, where) -> ModelArch`: the one parser, for a config.json and for a
  plan's `model.numerics` alike.

The conventions, from transformers 5.24:
- Mixtral: softmax over all experts, top-k, renormalised (modeling_mixtral.py:104-111).
- Qwen3-MoE: softmax, top-k, renormalised only with `norm_topk_prob`
  (modeling_qwen3_moe.py:259-268).
- GPT-OSS: top-k of the biased logits, softmax over the k chosen (modeling_gpt_oss.py:126-130);
  experts apply a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) (:82-88).
- DeepSeek-V3: sigmoid scores; the choice adds `e_score_correction_bias`, keeps the `topk_group`
  groups with the largest sum of their two best scores, takes the top-k there; weights are
  the sigmoid scores, renormalised with `norm_topk_prob`, times `routed_scaling_factor`
  (modeling_deepseek_v3.py:133-158); RoPE on interleaved pairs (:310-346).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from planner.inputs.shown import shown
from planner.specs import SpecError

RouterKind = Literal["softmax", "topk_softmax", "sigmoid"]
RopeKind = Literal["default", "yarn"]
ValueKind = Literal["number", "int", "bool", "text", "rope"]

# Every top-level key arch_from_hf_config reads, with its JSON kind (null is allowed for each:
# a config's null means what the parser makes of an absent or null key).
# tests/runtime/model/test_arch_from_plan.py records the parser's reads to keep this complete.
NUMERICS_KEYS: dict[str, ValueKind] = {
    "model_type": "text",  # the family: router kind, the always-normalised and GPT-OSS defaults
    "rope_theta": "number",
    "rope_parameters": "rope",  # transformers 5
    "rope_scaling": "rope",  # older configs: the scaling beside a top-level rope_theta
    "rope_interleave": "bool",
    "max_position_embeddings": "int",  # YaRN's factor and original context when not given
    "rms_norm_eps": "number",
    "norm_topk_prob": "bool",
    "routed_scaling_factor": "number",
    "n_group": "int",
    "topk_group": "int",
    "swiglu_limit": "number",
    "swiglu_alpha": "number",
}
# the keys read inside `rope_parameters` / `rope_scaling`
ROPE_KEYS: dict[str, ValueKind] = {
    "rope_type": "text",
    "type": "text",
    "rope_theta": "number",
    "factor": "number",
    "original_max_position_embeddings": "int",
    "beta_fast": "number",
    "beta_slow": "number",
    "mscale": "number",
    "mscale_all_dim": "number",
    "attention_factor": "number",
    "truncate": "bool",
}
MAX_NUMBER = 1e30  # no theta, epsilon or factor comes near it; keeps every product finite
MAX_INT = 1 << 31
MAX_TEXT = 100


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: base theta and optional YaRN scaling (arXiv:2309.00071).

    YaRN fields follow transformers' `rope_parameters` (modeling_rope_utils.py:346-484):
    factor, original_max_positions, beta_fast, beta_slow, mscale, mscale_all_dim,
    attention_factor (0: derived from factor and the mscales), truncate.
    interleave: rotate pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of halves.
    """

    theta: float = 10000.0
    kind: RopeKind = "default"
    factor: float = 1.0
    original_max_positions: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0
    truncate: bool = True
    interleave: bool = False

    def score_scale(self) -> float:
        """Extra factor on the softmax scale: DeepSeek's YaRN multiplies 1/sqrt(d) by
        mscale(factor, mscale_all_dim)^2 (modeling_deepseek_v3.py:262-274, 405)."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelArch:
    """What a family computes beyond its shapes.

    norm_topk_prob: renormalise the k chosen weights to sum to 1; None: when k > 1 (the
    runtime's own convention). num_groups / topk_groups: DeepSeek's group-limited choice.
    swiglu_limit: 0 = plain SwiGLU, else GPT-OSS's clamped form with swiglu_alpha.
    mla_norm_eps: epsilon of MLA's q and kv latent norms (DeepSeek builds them with 1e-6
    whatever rms_norm_eps says, modeling_deepseek_v3.py:380, 392).
    """

    rope: RopeSpec = field(default_factory=RopeSpec)
    norm_eps: float = 1e-6
    mla_norm_eps: float = 1e-6
    router: RouterKind = "softmax"
    norm_topk_prob: bool | None = None
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0


_ROUTER_OF_FAMILY: dict[str, RouterKind] = {
    "gpt_oss": "topk_softmax",
    "deepseek_v3": "sigmoid",
    "kimi_k2": "sigmoid",
}
# families whose top-k weights are always renormalised (no norm_topk_prob key)
_ALWAYS_NORMALISED = {"mixtral"}


# ---- the plan.json section: selecting and validating the keys ------------------------------


def _kind_error(where: str, key: str, kind: ValueKind, value: Any) -> SpecError:
    wanted = {
        "number": f"a number in [0, {MAX_NUMBER:g}]",
        "int": f"an integer in [0, {MAX_INT}]",
        "bool": "true or false",
        "text": f"text of at most {MAX_TEXT} characters",
        "rope": "a mapping of RoPE keys",
    }[kind]
    return SpecError(f"{where}: key '{key}' must be {wanted} or null, got {shown(value)}")


def _check_value(where: str, key: str, kind: ValueKind, value: Any) -> None:
    """Raise a SpecError naming `key` unless `value` is null or a JSON value of `kind`."""
    if value is None:
        return
    if kind == "number":
        good = isinstance(value, int | float) and not isinstance(value, bool)
        good = good and math.isfinite(value) and 0 <= value <= MAX_NUMBER
    elif kind == "int":
        good = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT
    elif kind == "bool":
        good = isinstance(value, bool)
    elif kind == "text":
        good = isinstance(value, str) and len(value) <= MAX_TEXT
    else:
        good = isinstance(value, dict)
    if not good:
        raise _kind_error(where, key, kind, value)


def _select(
    section: dict[str, Any], kinds: dict[str, ValueKind], where: str, prefix: str = ""
) -> dict[str, Any]:
    """The keys of `kinds` present in `section`, types checked; a RoPE mapping keeps ROPE_KEYS."""
    out: dict[str, Any] = {}
    for key, kind in kinds.items():
        if key not in section:
            continue
        value = section[key]
        _check_value(where, f"{prefix}{key}", kind, value)
        if kind == "rope" and value is not None:
            value = _select(value, ROPE_KEYS, where, f"{prefix}{key}.")
        out[key] = value
    return out


def numerics_of_config(cfg: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The numerics keys of HF config `cfg` (of its `text_config` when it wraps one).

    Args:
        cfg: a parsed config.json.
        where: the file, named in errors.
    Returns:
        {key: value} for the NUMERICS_KEYS present, a RoPE mapping cut to ROPE_KEYS: what
        arch_from_hf_config reads, so arch_from_hf_config(result) == arch_from_hf_config(cfg).
    Raises:
        SpecError: one line naming a key whose value has the wrong type.
    """
    if not isinstance(cfg, dict):
        raise SpecError(f"{where}: a model config must be a mapping of keys to values")
    text = cfg.get("text_config")
    return _select(text if isinstance(text, dict) else cfg, NUMERICS_KEYS, where)


def check_numerics(section: Any, where: str) -> None:
    """Validate plan.json's `model.numerics` (as read back): a mapping of NUMERICS_KEYS, its RoPE
    mappings of ROPE_KEYS, every value of its kind or null. Raises one SpecError line naming the
    key and the fix."""
    fix = "fix it, or regenerate the plan with 'piper plan'"
    if not isinstance(section, dict):
        raise SpecError(f"{where} must be a mapping of config keys; {fix}")
    _refuse_unknown(section, NUMERICS_KEYS, where, fix)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(section.get(key), dict):
            _refuse_unknown(section[key], ROPE_KEYS, f"{where}.{key}", fix)
    try:
        _select(section, NUMERICS_KEYS, where)
    except SpecError as exc:
        raise SpecError(f"{exc}; {fix}") from None


def _refuse_unknown(section: dict[str, Any], kinds: dict[str, ValueKind], where: str, fix: str):
    for key in section:
        if key in kinds:
            continue
        close = difflib.get_close_matches(str(key), list(kinds), n=1, cutoff=0.6)
        known = f"did you mean '{close[0]}'?" if close else f"the keys are {', '.join(kinds)};"
        raise SpecError(f"{where}: unknown key {shown(key)}; {known} {fix}")


# ---- the parser -----------------------------------------------------------------------------


def _number(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key)
    return default if value is None else float(value)


def rope_from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> RopeSpec:
    """RopeSpec of an HF config: `rope_parameters` (transformers 5) or the older top-level
    `rope_theta` with `rope_scaling` (DeepSeek-V3's interleaved pairs: arch_from_hf_config)."""
    cfg = numerics_of_config(cfg, where)
    return _rope(cfg, bool(cfg.get("rope_interleave", False)), where)


def _rope(cfg: dict[str, Any], interleave: bool, where: str) -> RopeSpec:
    """RopeSpec of a config's selected numerics keys (numerics_of_config)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise SpecError(
            f"{where}: rope_type '{kind}' is not supported by the runtime; use 'default' or 'yarn'"
        )
    theta = _number(params, "rope_theta", _number(cfg, "rope_theta", 10000.0))
    if theta <= 0:
        raise SpecError(f"{where}: rope_theta must be > 0, got {theta:g}; write the model's base")
    if kind == "default":
        return RopeSpec(theta=theta, interleave=interleave)
    original = params.get("original_max_position_embeddings") or cfg.get(
        "max_position_embeddings"
    ) or 4096  # fmt: skip
    factor = params.get("factor") or (cfg.get("max_position_embeddings") or original) / original
    return RopeSpec(
        theta=theta,
        kind="yarn",
        factor=float(factor),
        original_max_positions=int(original),
        beta_fast=_number(params, "beta_fast", 0.0) or 32.0,
        beta_slow=_number(params, "beta_slow", 0.0) or 1.0,
        mscale=_number(params, "mscale", 0.0),
        mscale_all_dim=_number(params, "mscale_all_dim", 0.0),
        attention_factor=_number(params, "attention_factor", 0.0),
        truncate=bool(params.get("truncate", True)),
        interleave=interleave,
    )


def arch_from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> ModelArch:
    """The ModelArch an HF config.json (as a dict), or a plan's `model.numerics`, asks for.

    Raises:
        SpecError: one line naming a key of the wrong type or a RoPE type the runtime lacks.
    """
    cfg = numerics_of_config(cfg, where)
    family = str(cfg.get("model_type") or "")
    router = _ROUTER_OF_FAMILY.get(family, "softmax")
    if family in _ALWAYS_NORMALISED:
        norm: bool | None = True
    elif "norm_topk_prob" in cfg:
        norm = bool(cfg["norm_topk_prob"])
    else:
        norm = True if router == "sigmoid" else None
    interleave = family == "deepseek_v3"  # DeepseekV3Config's default
    if "rope_interleave" in cfg:
        interleave = bool(cfg["rope_interleave"])
    gpt_oss = family == "gpt_oss"
    return ModelArch(
        rope=_rope(cfg, interleave, where),
        norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
        router=router,
        norm_topk_prob=norm,
        routed_scaling_factor=_number(cfg, "routed_scaling_factor", 1.0),
        # group-limited choice as DeepSeek-V3 scores groups; V2's greedy variant is not run
        num_groups=int(cfg.get("n_group") or 1) if router == "sigmoid" else 1,
        topk_groups=int(cfg.get("topk_group") or 1) if router == "sigmoid" else 1,
        swiglu_limit=_number(cfg, "swiglu_limit", 7.0) if gpt_oss else 0.0,
        swiglu_alpha=_number(cfg, "swiglu_alpha", 1.702) if gpt_oss else 1.0,
    )


# the config key behind each ModelArch field, for naming a disagreement
_KEY_OF_FIELD = {
    "rope.theta": "rope_theta", "rope.kind": "rope_type", "rope.factor": "factor",
    "rope.original_max_positions": "original_max_position_embeddings",
    "rope.interleave": "rope_interleave", "norm_eps": "rms_norm_eps", "router": "model_type",
    "num_groups": "n_group", "topk_groups": "topk_group",
}  # fmt: skip


def first_difference(a: ModelArch, b: ModelArch) -> tuple[str, Any, Any] | None:
    """(config key, value in a, value in b) of the first field where `a` and `b` differ, the
    key as a config.json names it (rope fields by their rope_parameters key); None if equal."""
    flat_a, flat_b = _flat(asdict(a)), _flat(asdict(b))
    for name, value in flat_a.items():
        if flat_b[name] != value:
            key = _KEY_OF_FIELD.get(name, name.removeprefix("rope."))
            return key, value, flat_b[name]
    return None


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
