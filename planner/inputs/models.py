"""Model specs from presets and config files: `load_model("mixtral-8x7b")` or a config path.

Entry points:
- `load_model(name_or_path) -> ModelSpec`: a preset under profiles/models/ (`<name>.json` or
  `.yaml`), a path to an HF config.json / YAML file, or a directory holding config.json.
- `model_from_config(cfg, name, source) -> ModelSpec`: any supported family
  (planner/inputs/families.py) or Piper's own normalized format (`model_type: "piper"`).
- `model_config(model) -> dict`: that normalized format; `model_from_config` reads it back to an
  equal ModelSpec, so plan.json can carry the exact model the runtime must build.
- `published_counts(cfg)`: the published parameter counts a preset stores under `_piper`.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, get_args, get_type_hints

import yaml

from planner.inputs.config_keys import reject_near_misses
from planner.inputs.families import MAX_LAYERS, build_model, check_model, check_model_type
from planner.inputs.hf_config import ConfigReader
from planner.inputs.json_errors import DuplicateKey, json_error_line, unique_object
from planner.inputs.numerics import numerics_of_config
from planner.inputs.paths import MODELS_DIR, read_text_file
from planner.inputs.shown import shown
from planner.inputs.yaml_text import load_yaml, yaml_fault
from planner.specs import AttentionSpec, LayerSpec, ModelSpec, MoESpec, SpecError

FAMILY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a model family: a plain name

PIPER_KEY = "_piper"  # Piper's metadata inside a preset: published counts and their source
COUNT_UNITS = {"1": 1.0, "1e9": 1e9, "1e12": 1e12, "2**30": float(2**30)}
TOTAL_BASES = ("total", "no_embeddings", "total_with_mtp")
ACTIVE_BASES = ("active", "active_no_input_embedding", "active_no_embeddings")
PIPER_META_KEYS = frozenset({
    "published_total_params", "published_active_params", "count_unit", "count_basis",
    "active_basis", "source", "tolerance_pct", "note",
})  # fmt: skip


@dataclass(frozen=True)
class PublishedCounts:
    """Published parameter counts of a preset, in parameters, and what they count.

    total_basis: "total" (Piper's basis), "no_embeddings" (no input embedding, no output
    projection), "total_with_mtp". active_basis: "active" (Piper's), "active_no_input_embedding"
    (head counted, embedding not), "active_no_embeddings". tolerance_pct: the agreement a test
    demands (1 unless the preset explains why the published figure is rounded or broader).
    """

    total_params: float | None
    active_params: float | None
    total_basis: str
    active_basis: str
    source: str
    count_unit: str
    tolerance_pct: float = 1.0
    note: str = ""


def list_model_presets() -> list[str]:
    """Names of the presets under profiles/models/, sorted."""
    return sorted({p.stem for ext in ("json", "yaml", "yml") for p in MODELS_DIR.glob(f"*.{ext}")})


def _preset_file(name: str) -> Path | None:
    """The preset file for `name`, matched case-insensitively (Mixtral-8x7B = mixtral-8x7b)."""
    for candidate in (name, name.lower()):
        for ext in (".json", ".yaml", ".yml"):
            p = MODELS_DIR / f"{candidate}{ext}"
            if p.is_file():
                return p
    return None


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a JSON or YAML config file into a dict; errors name the file and the fix: invalid
    syntax, a key given twice, an integer of more than 4300 digits, nesting past the stack."""
    text = read_text_file(path, "model config")
    fix = "repair it, or take the model's config.json again"
    try:
        if path.suffix in (".yaml", ".yml"):
            cfg = load_yaml(text)
        else:
            cfg = json.loads(text, object_pairs_hook=unique_object)
    except json.JSONDecodeError as exc:
        raise SpecError(json_error_line(str(path), exc, fix)) from None
    except DuplicateKey as exc:
        key = exc.key if len(exc.key) <= 60 else exc.key[:57] + "..."
        raise SpecError(
            f"{path}: key '{key}' is given twice in one object; keep one (JSON would take the "
            "last silently)"
        ) from None
    except RecursionError:
        raise SpecError(
            f"{path}: invalid JSON: nesting deeper than Python's stack; {fix}"
        ) from None
    except ValueError:  # int() of more digits than sys.get_int_max_str_digits() allows
        digits = sys.get_int_max_str_digits()
        raise SpecError(
            f"{path}: invalid JSON: an integer of more than {digits} digits; {fix}"
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML{yaml_fault(exc)}; {fix}") from None
    if not isinstance(cfg, dict):
        raise SpecError(f"{path}: a model config must be a mapping of keys to values")
    return cfg


def _named(name_or_path: str) -> str:
    """A model name or path as an error quotes it: whole up to a long path's length, cut past
    it (a name too long for any file system)."""
    return repr(name_or_path) if len(name_or_path) <= 512 else shown(name_or_path)


def resolve_model(name_or_path: str) -> tuple[dict[str, Any], str, str]:
    """(config dict, model name, source) for a preset name, a file or a directory."""
    path = Path(name_or_path)
    try:
        preset = _preset_file(name_or_path) if "/" not in name_or_path else None
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError as exc:  # a name too long for the file system, a loop of links
        raise SpecError(f"model {_named(name_or_path)}: {exc.strerror}; pass a preset name or "
                        "a path to config.json") from None  # fmt: skip
    if preset is not None:
        return read_config_file(preset), preset.stem, f"preset:{preset.stem}"
    if is_dir:
        path = path / "config.json"
        if not path.is_file():
            raise SpecError(f"{name_or_path}: directory has no config.json; pass the file itself")
    if is_dir or is_file:
        name = path.parent.name if path.stem == "config" and path.parent.name else path.stem
        return read_config_file(path), name, str(path)
    close = difflib.get_close_matches(name_or_path.lower(), list_model_presets(), n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise SpecError(
        f"model {_named(name_or_path)} is neither a preset nor a file; {hint}"
        "see 'piper model-info --list' or pass a path to config.json"
    )


def load_model(name_or_path: str) -> ModelSpec:
    """The ModelSpec of a preset name, an HF config.json / YAML path, or a checkout directory."""
    cfg, name, source = resolve_model(name_or_path)
    return model_from_config(cfg, name, source)


def model_from_config(cfg: dict[str, Any], name: str, source: str = "") -> ModelSpec:
    """Normalize one config dict (any supported family, or Piper's format) into a ModelSpec."""
    where = source or name
    if not isinstance(cfg, dict):
        raise SpecError(f"{where}: a model config must be a mapping of keys to values")
    check_model_type(cfg, where)
    published = published_counts(cfg, where)  # before build_model logs its generic-keys line
    if cfg.get("model_type") == "piper":
        model = _from_piper_format(cfg, name, source)
    else:
        numerics_of_config(cfg, where)  # the numerics keys (rope_theta, ...) finite and typed
        model = build_model(cfg, name, source)
    check_model(model, where)
    if published is None:
        return model
    return replace(
        model,
        published_total_params=published.total_params,
        published_active_params=published.active_params,
    )


def published_counts(cfg: dict[str, Any], where: str = "config") -> PublishedCounts | None:
    """The `_piper` metadata of a config: published counts scaled to parameters, or None."""
    if PIPER_KEY not in cfg:
        return None
    r = ConfigReader(cfg[PIPER_KEY], where, f"{PIPER_KEY}.")
    meta = r.cfg
    reject_near_misses(meta, PIPER_META_KEYS, where=where, prefix=f"{PIPER_KEY}.")
    unit = str(meta.get("count_unit", "1"))
    if unit not in COUNT_UNITS:
        raise r.error("count_unit", f"is {shown(unit)}", f"use one of {', '.join(COUNT_UNITS)}")
    scale = COUNT_UNITS[unit]
    values = {}
    for key in ("published_total_params", "published_active_params"):
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise r.error(key, f"must be a number, got {shown(value)}", "write e.g. 46.7")
        if value is not None and value <= 0:
            raise r.error(key, f"must be positive, got {value}", "write the published count")
        values[key] = None if value is None else float(value) * scale
    total_basis = str(meta.get("count_basis", "total"))
    active_basis = str(meta.get("active_basis", "active"))
    if total_basis not in TOTAL_BASES:
        raise r.error("count_basis", f"is '{total_basis}'", f"use one of {', '.join(TOTAL_BASES)}")
    if active_basis not in ACTIVE_BASES:
        raise r.error("active_basis", f"is '{active_basis}'", f"use {', '.join(ACTIVE_BASES)}")
    return PublishedCounts(
        total_params=values["published_total_params"],
        active_params=values["published_active_params"],
        total_basis=total_basis,
        active_basis=active_basis,
        source=str(meta.get("source", "")),
        count_unit=unit,
        tolerance_pct=_tolerance(r),
        note=str(meta.get("note", "")),
    )


def _tolerance(r: ConfigReader) -> float:
    value = r.cfg.get("tolerance_pct", 1.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise r.error(
            "tolerance_pct", f"must be a positive number, got {shown(value)}", "write e.g. 1.5"
        )
    return float(value)


# ---- Piper's normalized format: model_config() and its reader ---------------------------


def _layer_dict(layer: LayerSpec) -> dict[str, Any]:
    return {
        "kind": layer.kind,
        "attention": asdict(layer.attention),
        "dense_ffn": layer.dense_ffn,
        "dense_gated": layer.dense_gated,
        "moe": asdict(layer.moe) if layer.moe is not None else None,
    }


def model_config(model: ModelSpec) -> dict[str, Any]:
    """Piper's normalized HF-style config of `model`; model_from_config reads it back equal.

    `layer_groups` (runs of identical layers, in order) is authoritative; the flat HF keys
    beside it (heads, experts, top-k of the first layers) are for people and tools reading it.
    """
    groups: list[dict[str, Any]] = []
    for layer in model.layers:
        d = _layer_dict(layer)
        if groups and {k: v for k, v in groups[-1].items() if k != "count"} == d:
            groups[-1]["count"] += 1
        else:
            groups.append({"count": 1, **d})
    att = model.layers[0].attention
    cfg: dict[str, Any] = {
        "model_type": "piper",
        "piper_family": model.family,
        "hidden_size": model.hidden_size,
        "vocab_size": model.vocab_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": att.num_heads,
        "num_key_value_heads": att.num_kv_heads,
        "head_dim": att.head_dim,
        "tie_word_embeddings": model.tie_word_embeddings,
        "max_position_embeddings": model.max_position_embeddings,
        "num_nextn_predict_layers": model.num_mtp_layers,
        "norm_params_per_layer": model.norm_params_per_layer,
        "layer_groups": groups,
    }
    moe = model.first_moe
    if moe is not None:
        cfg.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.expert_ffn)  # fmt: skip
    if model.published_total_params or model.published_active_params:
        cfg[PIPER_KEY] = {
            "published_total_params": model.published_total_params,
            "published_active_params": model.published_active_params,
            "count_unit": "1",
        }
    return cfg


# Sizes of the normalized format that may be 0: 0 means "none" (no low-rank q projection, no
# MLA ranks outside MLA, no dense MLP beside the experts, no shared experts). Every other size
# must be >= 1. sliding_window is null for full causal attention; 0 (attend to no key) is
# refused, as the HF families read it (planner/inputs/families.py, `_windows`).
_MAY_BE_ZERO = frozenset({
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "num_shared_experts", "shared_ffn",
})  # fmt: skip
_MLA_SIZES = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_GROUP_KEYS = frozenset({"count", "kind", "attention", "dense_ffn", "dense_gated", "moe"})


def _choice(r: ConfigReader, key: str, allowed: tuple[str, ...], default: Any = None) -> str:
    """One of the names `allowed`, or `default` when the key is absent or null."""
    value = r.cfg.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, str) or value not in allowed:
        raise r.error(key, f"must be one of {', '.join(allowed)}, got {shown(value)}",
                      "write one of those names")  # fmt: skip
    return value


def _build(cls: type, data: Any, where: str, what: str) -> Any:
    """A frozen spec from a dict, rejecting missing or unknown fields, sizes below 1 (0 where
    _MAY_BE_ZERO allows it) or above MAX_SIZE, and names outside a Literal's choices."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: '{what}' must be a mapping; regenerate it with model_config")
    names = {f.name for f in fields(cls)}
    unknown = sorted(map(str, set(data) - names))
    if unknown:
        raise SpecError(f"{where}: '{what}' has unknown keys {unknown[:5]}; remove them")
    r = ConfigReader(data, where, f"{what}.")
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        kind = str(f.type)
        if data[f.name] is None and "None" in kind:
            values[f.name] = None
        elif f.name == "sliding_window" and data[f.name] == 0 and data[f.name] is not False:
            fix = "write null for full causal attention, or the window in tokens"
            raise r.error(f.name, "is 0, a window of no keys", fix)
        elif kind.startswith("int"):
            values[f.name] = r.int(f.name, minimum=0 if f.name in _MAY_BE_ZERO else 1)
        elif kind == "bool":
            values[f.name] = r.bool(f.name, bool(f.default))
        else:  # a Literal kind: one of the names the spec allows
            values[f.name] = _choice(r, f.name, get_args(hints[f.name]))
    try:
        spec = cls(**values)
    except TypeError as exc:
        raise SpecError(f"{where}: '{what}' is incomplete ({exc}); add the missing key") from None
    if isinstance(spec, AttentionSpec):
        _check_attention(spec, r)
    return spec


def _check_attention(att: AttentionSpec, r: ConfigReader) -> None:
    """Heads that group evenly, and MLA's ranks present when the kind is mla."""
    if att.num_heads % att.num_kv_heads:
        raise r.error("num_kv_heads", f"({att.num_kv_heads}) must divide num_heads "
                      f"({att.num_heads})", "use a divisor of the head count")  # fmt: skip
    if att.kind == "mla":
        for key in _MLA_SIZES:
            if getattr(att, key) < 1:
                raise r.error(key, "must be >= 1 for kind 'mla'", "give the MLA size")


def _from_piper_format(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    where = source or name
    r = ConfigReader(cfg, where)
    groups = cfg.get("layer_groups")
    if not isinstance(groups, list) or not groups:
        raise SpecError(f"{where}: key 'layer_groups' must be a non-empty list; regenerate it")
    layers: list[LayerSpec] = []
    for i, group in enumerate(groups):
        g = ConfigReader(group, where, f"layer_groups[{i}].")
        reject_near_misses(group, _GROUP_KEYS, where=where, prefix=f"layer_groups[{i}].")
        count = g.int("count", maximum=MAX_LAYERS)
        if len(layers) + count > MAX_LAYERS:
            raise g.error("count", f"brings the layers past {MAX_LAYERS}",
                          "no model has that many; regenerate the plan")  # fmt: skip
        kind = _choice(g, "kind", get_args(get_type_hints(LayerSpec)["kind"]), "dense")
        att = _build(AttentionSpec, group.get("attention"), where, f"layer_groups[{i}].attention")
        moe_data = group.get("moe")
        moe = None
        if moe_data is not None:
            moe = _build(MoESpec, moe_data, where, f"layer_groups[{i}].moe")
        if moe is not None and moe.top_k > moe.num_experts:
            raise g.error("moe.top_k", "exceeds num_experts", "use top_k <= num_experts")
        if moe is not None and kind != "moe":
            raise g.error("kind", f"is '{kind}' but the group has a moe section",
                          "set kind to 'moe' or remove moe")  # fmt: skip
        layer = LayerSpec(kind=kind, attention=att,  # type: ignore[arg-type]
                          dense_ffn=g.int("dense_ffn", 0, minimum=0),
                          dense_gated=g.bool("dense_gated", True), moe=moe)  # fmt: skip
        layers.extend([layer] * count)
    num_layers = r.int("num_hidden_layers", len(layers), maximum=MAX_LAYERS)
    if num_layers != len(layers):
        raise r.error("num_hidden_layers", f"is {num_layers} but layer_groups hold {len(layers)}",
                      "make them agree")  # fmt: skip
    family = cfg.get("piper_family", "piper")
    if not isinstance(family, str):
        raise r.error("piper_family", f"must be a string, got {type(family).__name__}",
                      "write the family name, e.g. \"mixtral\"")  # fmt: skip
    if not FAMILY_NAME.fullmatch(family):
        raise r.error("piper_family", f"is {shown(family)}",
                      "write a plain name (letters, digits, _ - .), e.g. \"mixtral\"")  # fmt: skip
    return ModelSpec(
        name=name, family=family, hidden_size=r.int("hidden_size"),
        vocab_size=r.int("vocab_size"), layers=tuple(layers),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        num_mtp_layers=r.int("num_nextn_predict_layers", 0, minimum=0),
        norm_params_per_layer=r.int("norm_params_per_layer", 0, minimum=0),
        max_position_embeddings=r.int("max_position_embeddings", 4096), source=source,
    )  # fmt: skip


def numerics_of_model(model: ModelSpec) -> dict[str, Any]:
    """The numerics of the config `model` was read from (its preset or file, `model.source`);
    {} for a spec that names no config file or one in Piper's normalized format."""
    ref = model.source.removeprefix("preset:")
    if not ref:
        return {}
    try:
        cfg, _, source = resolve_model(ref)
    except SpecError:  # a spec built in code whose source names no file
        return {}
    if cfg.get("model_type") == "piper":
        return {}
    return numerics_of_config(cfg, source)
