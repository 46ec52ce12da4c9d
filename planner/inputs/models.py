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
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from planner.inputs.config_keys import reject_near_misses
from planner.inputs.families import MAX_LAYERS, build_model, check_model
from planner.inputs.hf_config import ConfigReader
from planner.inputs.json_errors import json_error_line
from planner.inputs.paths import MODELS_DIR, read_text_file
from planner.specs import AttentionSpec, LayerSpec, ModelSpec, MoESpec, SpecError

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
    """Parse a JSON or YAML config file into a dict; errors name the file and the fix."""
    text = read_text_file(path, "model config")
    try:
        cfg = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except json.JSONDecodeError as exc:
        fix = "repair it, or take the model's config.json again"
        raise SpecError(json_error_line(str(path), exc, fix)) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise SpecError(f"{path}: a model config must be a mapping of keys to values")
    return cfg


def resolve_model(name_or_path: str) -> tuple[dict[str, Any], str, str]:
    """(config dict, model name, source) for a preset name, a file or a directory."""
    preset = _preset_file(name_or_path) if "/" not in name_or_path else None
    if preset is not None:
        return read_config_file(preset), preset.stem, f"preset:{preset.stem}"
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise SpecError(f"{name_or_path}: directory has no config.json; pass the file itself")
    if path.is_file():
        name = path.parent.name if path.stem == "config" and path.parent.name else path.stem
        return read_config_file(path), name, str(path)
    close = difflib.get_close_matches(name_or_path.lower(), list_model_presets(), n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise SpecError(
        f"model '{name_or_path}' is neither a preset nor a file; {hint}"
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
    if cfg.get("model_type") == "piper":
        model = _from_piper_format(cfg, name, source)
    else:
        model = build_model(cfg, name, source)
    check_model(model, where)
    published = published_counts(cfg, where)
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
        raise r.error("count_unit", f"is '{unit}'", f"use one of {', '.join(COUNT_UNITS)}")
    scale = COUNT_UNITS[unit]
    values = {}
    for key in ("published_total_params", "published_active_params"):
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise r.error(key, f"must be a number, got {value!r}", "write e.g. 46.7")
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
            "tolerance_pct", f"must be a positive number, got {value!r}", "write e.g. 1.5"
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


def _build(cls: type, data: Any, where: str, what: str) -> Any:
    """A frozen spec from a dict, rejecting missing or unknown fields with one line."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: '{what}' must be a mapping; regenerate it with model_config")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SpecError(f"{where}: '{what}' has unknown keys {unknown}; remove them")
    r = ConfigReader(data, where, f"{what}.")
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        kind = str(f.type)
        if data[f.name] is None and "None" in kind:
            values[f.name] = None
        elif kind.startswith("int"):
            values[f.name] = r.int(f.name, minimum=0)
        elif kind == "bool":
            values[f.name] = r.bool(f.name, bool(f.default))
        else:  # a Literal kind: one of the names the spec allows, checked by check_model
            values[f.name] = str(data[f.name])
    try:
        return cls(**values)
    except TypeError as exc:
        raise SpecError(f"{where}: '{what}' is incomplete ({exc}); add the missing key") from None


def _from_piper_format(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    where = source or name
    r = ConfigReader(cfg, where)
    groups = cfg.get("layer_groups")
    if not isinstance(groups, list) or not groups:
        raise SpecError(f"{where}: key 'layer_groups' must be a non-empty list; regenerate it")
    layers: list[LayerSpec] = []
    for i, group in enumerate(groups):
        g = ConfigReader(group, where, f"layer_groups[{i}].")
        count = g.int("count", maximum=MAX_LAYERS)
        att = _build(AttentionSpec, group.get("attention"), where, f"layer_groups[{i}].attention")
        moe_data = group.get("moe")
        moe = None
        if moe_data is not None:
            moe = _build(MoESpec, moe_data, where, f"layer_groups[{i}].moe")
        if moe is not None and moe.top_k > moe.num_experts:
            raise g.error("moe.top_k", "exceeds num_experts", "use top_k <= num_experts")
        layer = LayerSpec(kind=group.get("kind", "dense"), attention=att,
                          dense_ffn=g.int("dense_ffn", 0, minimum=0),
                          dense_gated=g.bool("dense_gated", True), moe=moe)  # fmt: skip
        layers.extend([layer] * count)
    num_layers = r.int("num_hidden_layers", len(layers), maximum=MAX_LAYERS)
    if num_layers != len(layers):
        raise r.error("num_hidden_layers", f"is {num_layers} but layer_groups hold {len(layers)}",
                      "make them agree")  # fmt: skip
    return ModelSpec(
        name=name, family=str(cfg.get("piper_family", "piper")), hidden_size=r.int("hidden_size"),
        vocab_size=r.int("vocab_size"), layers=tuple(layers),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        num_mtp_layers=r.int("num_nextn_predict_layers", 0, minimum=0),
        norm_params_per_layer=r.int("norm_params_per_layer", 0, minimum=0),
        max_position_embeddings=r.int("max_position_embeddings", 4096), source=source,
    )  # fmt: skip
