"""Hugging Face config.json families -> the layers of a ModelSpec.

Each family spells the same few facts differently (expert count, top-k, expert width, which
layers are MoE, shared experts, MLA ranks, biases). `build_model` reads them through one
table of aliases plus a small per-family trait record, so adding a family is one table row.
The expert and dense MLP widths come only from the family's own keys (a missing one is an
error, never the other width); every key is first checked for near misses of the keys read
here (planner/inputs/config_keys.py); a config read with the generic keys ('moe' / 'dense'
without saying so in its model_type) logs one WARNING listing what was taken and defaulted.

Which layers are MoE, from the keys the families use (layer index i, 0-based):
- DeepSeek / Kimi: i >= first_k_dense_replace and i % moe_layer_freq == 0
- Qwen2/3-MoE: (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
- Llama-4: i in moe_layers, else (i + 1) % interleave_moe_layer_step == 0
- Arctic: (i + 1) % moe_layer_frequency == 0
All rules combine (a layer is MoE when every rule present says so).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, replace
from typing import Any

from planner.inputs.config_keys import EXPERTS_KEYS, SHARED_KEYS, TOP_K_KEYS, check_key_typos
from planner.inputs.hf_config import ConfigReader
from planner.inputs.shown import shown
from planner.specs import AttentionSpec, LayerSpec, ModelSpec, MoESpec, SpecError

log = logging.getLogger(__name__)

MAX_LAYERS = 10_000  # each layer is one spec object; the deepest published models have ~200
MOE_FFN = ("moe_intermediate_size",)  # the expert width where the family has its own key
FFN = ("intermediate_size",)
EITHER_FFN = MOE_FFN + FFN


@dataclass(frozen=True)
class FamilyTraits:
    """What a family fixes that its config.json does not say (read from its modeling code)."""

    family: str
    qkv_bias: bool | None = None  # None: read 'attention_bias' (default False)
    o_bias_with_qkv: bool = False  # the output projection has a bias whenever q/k/v do
    sinks: bool = False  # GPT-OSS per-head attention sinks
    qk_norm: str = ""  # "" none, "head" per-head RMSNorm (Qwen3), "full" full width (OLMoE)
    norms_per_layer: int = 2  # norm weight vectors of width d per layer
    shared_gate: bool = False  # Qwen2-MoE sigmoid gate on the shared expert
    shared_default: int = 0  # shared experts when no key says (Llama-4 always has one)
    router_bias: bool = False
    expert_bias: bool = False
    tie_default: bool = False
    mla: bool = False
    residual_mlp: bool = False  # Arctic: dense MLP of width d beside the MoE
    # the keys of the expert and dense MLP widths: a family reads only its own, so a missing
    # one is an error naming it, never a fallback to the other width
    expert_ffn_keys: tuple[str, ...] = FFN
    dense_ffn_keys: tuple[str, ...] = FFN


_DEEPSEEK = dict(mla=True, expert_ffn_keys=MOE_FFN)
FAMILIES: dict[str, FamilyTraits] = {
    "mixtral": FamilyTraits("mixtral"),
    "qwen2_moe": FamilyTraits(
        "qwen2_moe", qkv_bias=True, shared_gate=True, expert_ffn_keys=MOE_FFN
    ),
    "qwen3_moe": FamilyTraits("qwen3_moe", qk_norm="head", expert_ffn_keys=MOE_FFN),
    "deepseek_v2": FamilyTraits("deepseek_v2", **_DEEPSEEK),
    "deepseek_v3": FamilyTraits("deepseek_v3", **_DEEPSEEK),
    "kimi_k2": FamilyTraits("kimi_k2", **_DEEPSEEK),
    "dbrx": FamilyTraits("dbrx"),
    "olmoe": FamilyTraits("olmoe", qk_norm="full"),
    "gpt_oss": FamilyTraits(
        "gpt_oss", o_bias_with_qkv=True, sinks=True, router_bias=True, expert_bias=True
    ),
    "phimoe": FamilyTraits("phimoe", o_bias_with_qkv=True, norms_per_layer=4),
    "arctic": FamilyTraits("arctic", residual_mlp=True),
    "llama4": FamilyTraits("llama4", shared_default=1, dense_ffn_keys=("intermediate_size_mlp",)),
    "grok-1": FamilyTraits("grok-1", norms_per_layer=4, tie_default=True),
    # dense families and Piper's generic keys (tiny-moe, X-MoE, weak scaling) have no expert
    # width of their own: either key gives it
    "llama": FamilyTraits("llama", expert_ffn_keys=EITHER_FFN),
    "mistral": FamilyTraits("mistral", expert_ffn_keys=EITHER_FFN),
    "qwen2": FamilyTraits("qwen2", qkv_bias=True, expert_ffn_keys=EITHER_FFN),
    "qwen3": FamilyTraits("qwen3", qk_norm="head", expert_ffn_keys=EITHER_FFN),
    "moe": FamilyTraits("moe", expert_ffn_keys=EITHER_FFN),
    "dense": FamilyTraits("dense", expert_ffn_keys=EITHER_FFN),
}
_OWN_EXPERTS_KEY = dict.fromkeys(
    ("qwen2_moe", "qwen3_moe", "olmoe", "grok-1", "moe"), "num_experts"
)
_OWN_EXPERTS_KEY.update(
    dict.fromkeys(("deepseek_v2", "deepseek_v3", "kimi_k2"), "n_routed_experts")
)
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "dense")
_ALIASES = {"llama4_text": "llama4", "grok": "grok-1", "grok1": "grok-1", "phi_moe": "phimoe"}


def check_model_type(cfg: dict[str, Any], where: str) -> None:
    """Raise one SpecError line when the config's `model_type` (or its text_config's) is
    present but not a string: the family cannot be told, and it is not guessed."""
    sections = [("", cfg)]
    if isinstance(cfg.get("text_config"), dict):
        sections.append(("text_config.", cfg["text_config"]))
    for prefix, section in sections:
        value = section.get("model_type")
        if value is not None and not isinstance(value, str):
            raise SpecError(
                f"{where}: key '{prefix}model_type' must be a string such as \"mixtral\", got "
                f"{shown(value)}; write the family name the model's config.json gives"
            )


def _model_type(cfg: dict[str, Any]) -> str:
    model_type = str(cfg.get("model_type") or "").lower()
    return _ALIASES.get(model_type, model_type)


def family_of(cfg: dict[str, Any]) -> str:
    """The family key for a config: its model_type, else generic 'moe' or 'dense'."""
    model_type = _model_type(cfg)
    if model_type in FAMILIES:
        return model_type
    if "ffn_config" in cfg:
        return "dbrx"
    return "moe" if any(cfg.get(k) for k in EXPERTS_KEYS) else "dense"


def _warn_generic(cfg: dict[str, Any], r: ConfigReader, family: str) -> None:
    """One WARNING line: the config fell back to Piper's generic keys; what it read from it."""
    model_type = str(cfg.get("model_type") or "")
    known = sorted(set(FAMILIES) - {"moe", "dense"})
    close = difflib.get_close_matches(model_type.lower(), known, n=1, cutoff=0.6)
    kind = f"model_type '{model_type}' is not a supported family"
    kind = kind if model_type else "no model_type"
    took = ", ".join(f"{k}={_show(v)}" for k, v in r.taken.items())
    defaults = ", ".join(f"{k}={_show(v)}" for k, v in r.defaulted.items())
    fix = f"'{close[0]}'" if close else f"one of {', '.join(known)}"
    log.warning(
        "%s: %s; read it as a generic %s model with Piper's generic keys: took %s; "
        "defaults %s; if the model is %s, set model_type to it",
        r.where, kind, "MoE" if family == "moe" else "dense", took, defaults or "none", fix,
    )  # fmt: skip


def _show(value: Any) -> str:
    """A value for the warning; long layer lists are shortened."""
    if isinstance(value, tuple) and len(value) > 6:
        return f"[{', '.join(map(str, value[:3]))}, ... {len(value)} entries]"
    return str(list(value)) if isinstance(value, tuple) else str(value)


def flatten_dbrx(r: ConfigReader) -> dict[str, Any]:
    """DBRX nests its MoE and attention settings; map them onto the common keys."""
    ffn, attn = r.sub("ffn_config"), r.sub("attn_config")
    return {
        "model_type": "dbrx",
        "hidden_size": r.int("d_model"),
        "num_attention_heads": r.int("n_heads"),
        "num_hidden_layers": r.int("n_layers", maximum=MAX_LAYERS),
        "vocab_size": r.int("vocab_size"),
        "max_position_embeddings": r.int("max_seq_len", 4096),
        "num_key_value_heads": attn.int("kv_n_heads"),
        "intermediate_size": ffn.int("ffn_hidden_size"),
        "num_local_experts": ffn.int("moe_num_experts"),
        "num_experts_per_tok": ffn.int("moe_top_k"),
        "tie_word_embeddings": r.bool("tie_word_embeddings", False),
        "mlp_gated": r.bool("mlp_gated", True),
    }


def _attention(r: ConfigReader, t: FamilyTraits, d: int) -> tuple[AttentionSpec, int]:
    """The attention block (window unset) and the extra norm weights it adds per layer."""
    heads = r.int("num_attention_heads")
    if t.mla:
        qk_nope, qk_rope = r.int("qk_nope_head_dim"), r.int("qk_rope_head_dim")
        spec = AttentionSpec(
            kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=qk_nope + qk_rope,
            o_bias=r.bool("attention_bias", False),
            q_lora_rank=r.int("q_lora_rank", 0, minimum=0), kv_lora_rank=r.int("kv_lora_rank"),
            qk_nope_head_dim=qk_nope, qk_rope_head_dim=qk_rope, v_head_dim=r.int("v_head_dim"),
        )  # fmt: skip
        return spec, 0
    kv = r.int("num_key_value_heads", heads)
    if heads % kv:
        raise r.error("num_key_value_heads", f"({kv}) must divide num_attention_heads ({heads})",
                      "use a divisor of the head count")  # fmt: skip
    if not r.has("head_dim") and d % heads:
        raise r.error("num_attention_heads", f"({heads}) must divide hidden_size ({d})",
                      "fix the head count or give 'head_dim'")  # fmt: skip
    head_dim = r.int("head_dim", d // heads)
    bias = t.qkv_bias if t.qkv_bias is not None else r.bool("attention_bias", False)
    spec = AttentionSpec(
        kind="gqa" if kv < heads else "mha", num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        bias=bias, o_bias=bias and t.o_bias_with_qkv, sinks=t.sinks, qk_norm=bool(t.qk_norm),
    )  # fmt: skip
    extra_norms = 0
    if t.qk_norm == "full":  # OLMoE: q_norm over heads*hd, k_norm over kv*hd (params.py: 2*hd)
        extra_norms = heads * head_dim + kv * head_dim - 2 * head_dim
    return spec, extra_norms


def _windows(r: ConfigReader, num_layers: int, max_pos: int) -> list[int | None]:
    """Sliding window per layer: GPT-OSS layer_types, else one window for every layer."""
    window = r.int("sliding_window", None)
    if window is None or not r.bool("use_sliding_window", True) or window >= max_pos:
        return [None] * num_layers
    types = r.str_list("layer_types")
    if not types:
        return [window] * num_layers
    if len(types) != num_layers:
        raise r.error("layer_types", f"has {len(types)} entries for {num_layers} layers",
                      "give one entry per layer")  # fmt: skip
    return [window if kind == "sliding_attention" else None for kind in types]


def _moe_pattern(r: ConfigReader, num_layers: int) -> list[bool]:
    """Which layers are MoE; see the module docstring for the rules."""
    first_dense = r.int("first_k_dense_replace", 0, minimum=0)
    freq = r.int("moe_layer_freq", 1)
    sparse_step = r.int("decoder_sparse_step", 1)
    interleave = r.int("interleave_moe_layer_step", 1)
    arctic_freq = r.int("moe_layer_frequency", 1)
    mlp_only = set(r.int_list("mlp_only_layers"))
    explicit = set(r.int_list("moe_layers")) if r.has("moe_layers") else None
    pattern = []
    for i in range(num_layers):
        moe = i >= first_dense and i % freq == 0 and (i + 1) % sparse_step == 0
        moe = moe and (i + 1) % arctic_freq == 0 and i not in mlp_only
        if explicit is not None:
            moe = moe and i in explicit
        else:
            moe = moe and (i + 1) % interleave == 0
        pattern.append(moe)
    return pattern


def _moe_spec(r: ConfigReader, t: FamilyTraits, gated: bool) -> MoESpec:
    own = _OWN_EXPERTS_KEY.get(t.family, "num_local_experts")  # first: named when missing
    experts = r.int((own, *(k for k in EXPERTS_KEYS if k != own)))
    top_k = r.int(TOP_K_KEYS)
    if top_k > experts:
        raise r.error(r.first_key(TOP_K_KEYS) or "top_k", f"({top_k}) exceeds the {experts} "
                      "experts", "use top_k <= number of experts")  # fmt: skip
    expert_ffn = r.int(t.expert_ffn_keys)
    num_shared = r.int(SHARED_KEYS, t.shared_default, minimum=0)
    shared_ffn = 0
    if r.has("shared_expert_intermediate_size"):
        shared_ffn = r.int("shared_expert_intermediate_size", minimum=0)
        num_shared = num_shared or (1 if shared_ffn else 0)
    elif num_shared:
        shared_ffn = expert_ffn
    router_bias = t.router_bias or r.cfg.get("topk_method") == "noaux_tc"
    return MoESpec(
        num_experts=experts, top_k=top_k, expert_ffn=expert_ffn, gated=gated,
        num_shared_experts=num_shared if shared_ffn else 0, shared_ffn=shared_ffn,
        shared_gate=t.shared_gate and bool(shared_ffn), expert_bias=t.expert_bias,
        router_bias=router_bias,
    )  # fmt: skip


def build_model(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    """Parse one HF-style config dict (any family above) into a ModelSpec without metadata."""
    check_model_type(cfg, source or name)
    family = family_of(cfg)
    r = _reader(cfg, family, source or name)
    t = FAMILIES[family]
    d, vocab = r.int("hidden_size"), r.int("vocab_size")
    num_layers = r.int("num_hidden_layers", maximum=MAX_LAYERS)
    max_pos = r.int(("max_position_embeddings", "max_seq_len"), 4096)
    gated = r.bool("mlp_gated", True)
    attention, extra_norms = _attention(r, t, d)
    windows = _windows(r, num_layers, max_pos)
    has_moe = family not in DENSE_FAMILIES or r.first_key(EXPERTS_KEYS) is not None
    moe = _moe_spec(r, t, gated) if has_moe else None
    pattern = _moe_pattern(r, num_layers) if moe else [False] * num_layers
    dense_ffn = 0
    if not all(pattern):
        dense_ffn = r.int(t.dense_ffn_keys)
    residual = t.residual_mlp and (
        r.bool("use_residual", False) or r.bool("parallel_attn_mlp_res", False)
    )
    residual_ffn = r.int("residual_intermediate_size", d) if residual else 0
    layers = tuple(
        LayerSpec(
            kind="moe" if is_moe else "dense",
            attention=_with_window(attention, window),
            dense_ffn=residual_ffn if is_moe else dense_ffn,
            dense_gated=gated,
            moe=moe if is_moe else None,
        )
        for is_moe, window in zip(pattern, windows, strict=True)
    )
    norms = (t.norms_per_layer + (1 if residual else 0)) * d + extra_norms
    model = ModelSpec(
        name=name, family=family, hidden_size=d, vocab_size=vocab, layers=layers,
        tie_word_embeddings=r.bool("tie_word_embeddings", t.tie_default),
        num_mtp_layers=r.int("num_nextn_predict_layers", 0, minimum=0),
        norm_params_per_layer=norms, max_position_embeddings=max_pos, source=source,
    )  # fmt: skip
    if _model_type(cfg) not in FAMILIES:  # read with the generic keys: say so, and what
        _warn_generic(cfg, r, family)
    return model


def _reader(cfg: dict[str, Any], family: str, where: str) -> ConfigReader:
    """The reader of a config's model keys, after the near-miss check of every key."""
    check_key_typos(cfg, where)
    if family == "llama4" and isinstance(cfg.get("text_config"), dict):
        check_key_typos(cfg["text_config"], where)
        cfg = {**cfg["text_config"], "model_type": "llama4"}
    r = ConfigReader(cfg, where)
    return ConfigReader(flatten_dbrx(r), where) if family == "dbrx" else r


def _with_window(att: AttentionSpec, window: int | None) -> AttentionSpec:
    return att if window is None else replace(att, sliding_window=window)


def check_model(model: ModelSpec, where: str) -> None:
    """Reject a parsed model that is internally impossible (rare: a bad piper-format file)."""
    if not model.layers:
        raise SpecError(f"{where}: the model has no layers; set num_hidden_layers >= 1")
    for i, layer in enumerate(model.layers):
        if layer.kind == "moe" and layer.moe is None:
            raise SpecError(f"{where}: layer {i} is 'moe' without experts; add its moe section")
        if layer.kind == "dense" and layer.dense_ffn <= 0:
            raise SpecError(f"{where}: dense layer {i} has no MLP width; set intermediate_size")
