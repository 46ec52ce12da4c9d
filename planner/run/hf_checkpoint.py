"""`piper run --hf-weights DIR`: check, before any process starts, that a Hugging Face
checkpoint directory holds the model the plan runs.

The runtime builds the plan's model with the checkpoint's numerics (runtime/model/arch.py) and
copies its safetensors into each rank's layers, experts and head slices
(runtime/model/hf_weights.py); that needs the same shapes, the full-size model and the files.
"""

from __future__ import annotations

import json
from pathlib import Path

from planner.inputs.models import model_from_config
from planner.inputs.safe_read import open_input, read_input_bytes
from planner.inputs.shown import shown
from planner.specs import ModelSpec, SpecError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
WEIGHT_FILES = (WEIGHTS, INDEX)
MAX_INDEX_BYTES = 64 * 2**20  # an index maps tensor names to shards: a few MB for 1T params
# the families whose checkpoints the runtime loads and computes as transformers does
# (tests/runtime/model/test_hf_equivalence.py); RoPE types it runs
LOADED_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
ROPE_TYPES = ("default", "yarn")


def check_hf_checkpoint(path: str, model: ModelSpec, scale: float) -> None:
    """Raise SpecError (one line naming --hf-weights and the fix) unless `path` is a
    save_pretrained directory of `model` (the run's model) and the run is at --scale 1."""
    flag = f"--hf-weights {path}"
    folder = Path(path)
    if not (folder / CONFIG).is_file():
        raise SpecError(f"{flag}: no {CONFIG}; point it at a save_pretrained directory")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise SpecError(f"{flag}: no {' or '.join(WEIGHT_FILES)} beside {CONFIG}")
    weight_files(folder, flag)
    if scale != 1.0:
        raise SpecError(f"{flag}: the checkpoint holds the full-size model; drop --scale {scale}")
    try:
        cfg = json.loads(read_input_bytes(folder / CONFIG, "config.json"))
    except json.JSONDecodeError as exc:
        raise SpecError(f"{flag}: {CONFIG} is not valid JSON ({exc.msg})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") not in LOADED_FAMILIES:
        family = cfg.get("model_type") if isinstance(cfg, dict) else None
        raise SpecError(
            f"{flag}: model_type {family!r} is not one the runtime loads "
            f"({', '.join(LOADED_FAMILIES)}); leave --hf-weights out"
        )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if kind not in ROPE_TYPES:
        raise SpecError(f"{flag}: rope_type {kind!r} is not run (only {', '.join(ROPE_TYPES)})")
    theirs = model_from_config(cfg, folder.name, str(folder / CONFIG))
    for what, ours_v, theirs_v in (
        ("hidden_size", model.hidden_size, theirs.hidden_size),
        ("vocab_size", model.vocab_size, theirs.vocab_size),
        ("layers", model.num_layers, theirs.num_layers),
        ("tie_word_embeddings", model.tie_word_embeddings, theirs.tie_word_embeddings),
    ):
        if ours_v != theirs_v:
            raise SpecError(
                f"{flag}: {what} is {theirs_v} in the checkpoint, {ours_v} in the plan; "
                f"plan with --model {folder / CONFIG}"
            )
    for i, (mine, other) in enumerate(zip(model.layers, theirs.layers, strict=True)):
        if mine != other:
            raise SpecError(
                f"{flag}: layer {i} differs from the plan's; plan with --model {folder / CONFIG}"
            )


def weight_files(folder: Path, where: str) -> tuple[str, ...]:
    """The safetensors files of checkpoint `folder`, in load order: `model.safetensors`, or the
    shards `model.safetensors.index.json` names (sorted, each once). A shard must be a file
    name inside `folder`: no absolute path, no '..', and a symlink only into `folder` or, for
    a Hugging Face cache snapshot (`.../snapshots/REV`), into that repository's `blobs`; each
    must be a regular file. Every fault is one SpecError line starting with `where`."""
    index = folder / INDEX
    if not index.is_file():
        if (folder / WEIGHTS).is_file():
            _inside(folder, WEIGHTS, where)
            return (WEIGHTS,)
        raise SpecError(f"{where}: no {WEIGHTS} or {INDEX}; save the model with save_pretrained")
    try:
        doc = json.loads(read_input_bytes(index, "safetensors index", MAX_INDEX_BYTES))
    except (ValueError, RecursionError):
        raise SpecError(f"{where}: {INDEX} is not valid JSON; save the model again") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SpecError(f"{where}: {INDEX} has no 'weight_map' of tensor names to shard files")
    names = set()
    for shard in weight_map.values():
        if not isinstance(shard, str):
            raise SpecError(f"{where}: {INDEX} names shard {shown(shard)}, not a file name")
        names.add(shard)
    for shard in sorted(names):
        _inside(folder, shard, where)
    return tuple(sorted(names))


def _inside(folder: Path, name: str, where: str) -> None:
    """Refuse shard `name` unless it is a regular file inside `folder` (weight_files' rule)."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or "\x00" in name:
        raise SpecError(
            f"{where}: {INDEX} names shard {shown(name)}, outside the checkpoint folder; an "
            "index names files in its own folder: fix the index"
        )
    home = folder.resolve()
    roots = [home]
    if home.parent.name == "snapshots":  # the Hugging Face cache: files link to ../../blobs
        roots.append(home.parent.parent / "blobs")
    real = (folder / name).resolve()
    if not any(real.is_relative_to(root) for root in roots):
        raise SpecError(
            f"{where}: shard {shown(name)} links to {real}, outside the checkpoint "
            "folder; copy the file into the folder"
        )
    with open_input(folder / name, "safetensors shard", max_bytes=None):
        pass
