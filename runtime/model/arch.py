"""The numerics of a model family that ModelSpec leaves out: RoPE, norm epsilon, router, activation.

ModelSpec (planner/specs.py) holds the shapes the planner prices and the runtime builds (MLA
ranks, sinks, sliding windows, qk-norm, biases, shared experts, dense layers, tied
embeddings). `ModelArch` holds what changes the numbers but not the shapes. `ModelArch()` is
the runtime's own convention, used when a run has no Hugging Face config; `arch_from_hf_config`
reads one, so that the runtime computes what `transformers` computes for that family
(tests/runtime/model/test_hf_equivalence.py). The conventions, from transformers 5.24:

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

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from planner.specs import SpecError

RouterKind = Literal["softmax", "topk_softmax", "sigmoid"]
RopeKind = Literal["default", "yarn"]


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


def _number(cfg: dict[str, Any], key: str, default: float, where: str) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise SpecError(f"{where}: key '{key}' must be a number >= 0, got {value!r}")
    return float(value)


def rope_from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> RopeSpec:
    """RopeSpec of an HF config: `rope_parameters` (transformers 5) or the older top-level
    `rope_theta` with `rope_scaling`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise SpecError(f"{where}: key 'rope_parameters' must be a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise SpecError(
            f"{where}: rope_type '{kind}' is not supported by the runtime; use 'default' or 'yarn'"
        )
    theta = _number(params, "rope_theta", _number(cfg, "rope_theta", 10000.0, where), where)
    if kind == "default":
        return RopeSpec(theta=theta, interleave=bool(cfg.get("rope_interleave", False)))
    original = params.get("original_max_position_embeddings") or cfg.get(
        "max_position_embeddings", 4096
    )
    factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original
    return RopeSpec(
        theta=theta,
        kind="yarn",
        factor=float(factor),
        original_max_positions=int(original),
        beta_fast=_number(params, "beta_fast", 0.0, where) or 32.0,
        beta_slow=_number(params, "beta_slow", 0.0, where) or 1.0,
        mscale=_number(params, "mscale", 0.0, where),
        mscale_all_dim=_number(params, "mscale_all_dim", 0.0, where),
        attention_factor=_number(params, "attention_factor", 0.0, where),
        truncate=bool(params.get("truncate", True)),
        interleave=bool(cfg.get("rope_interleave", False)),
    )


def arch_from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> ModelArch:
    """The ModelArch an HF config.json (as a dict) asks for; SpecError names a bad key."""
    family = str(cfg.get("model_type", ""))
    router = _ROUTER_OF_FAMILY.get(family, "softmax")
    if family in _ALWAYS_NORMALISED:
        norm: bool | None = True
    elif "norm_topk_prob" in cfg:
        norm = bool(cfg["norm_topk_prob"])
    else:
        norm = True if router == "sigmoid" else None
    if family == "deepseek_v3" and "rope_interleave" not in cfg:
        cfg = {**cfg, "rope_interleave": True}  # DeepseekV3Config's default
    gpt_oss = family == "gpt_oss"
    return ModelArch(
        rope=rope_from_hf_config(cfg, where),
        norm_eps=_number(cfg, "rms_norm_eps", 1e-6, where),
        router=router,
        norm_topk_prob=norm,
        routed_scaling_factor=_number(cfg, "routed_scaling_factor", 1.0, where),
        # group-limited choice as DeepSeek-V3 scores groups; V2's greedy variant is not run
        num_groups=int(cfg.get("n_group") or 1) if router == "sigmoid" else 1,
        topk_groups=int(cfg.get("topk_group") or 1) if router == "sigmoid" else 1,
        swiglu_limit=_number(cfg, "swiglu_limit", 7.0, where) if gpt_oss else 0.0,
        swiglu_alpha=_number(cfg, "swiglu_alpha", 1.702, where) if gpt_oss else 1.0,
    )
