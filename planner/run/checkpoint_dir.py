"""The checkpoint directory of `piper run --checkpoint-dir D`, without torch: names, the
atomic finish, the manifest check that refuses a corrupt or partial checkpoint, and the
choice of the newest valid one.

D holds one folder per checkpoint, `step-000010` (the run had finished 10 steps), written by
torch.distributed.checkpoint (runtime/checkpoint.py) into `.tmp-step-000010` and renamed
only once complete: `state.json` (the run's own state: step, placements, migration history,
metrics so far) is added, then `manifest.json` with the SHA-256 of every file, last. A
folder without a manifest, or with a file missing or different from its hash, is refused;
`.tmp-*` folders are never read. The newest KEEP checkpoints are kept. `piper run --resume`
renames a refused checkpoint newer than the one it resumes from to `refused-<name>`, so the
pruning keeps intact ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from planner.run.spec import RunSpec
from planner.specs import SpecError

MANIFEST = "manifest.json"
STATE = "state.json"
KEEP = 2  # checkpoints kept: the newest, and the one used if it turns out corrupt
_PREFIX = "step-"


def step_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint taken after `step` finished steps lives."""
    return Path(root) / f"{_PREFIX}{step:06d}"


def tmp_dir(root: str | Path, step: int) -> Path:
    """Where it is written before the rename."""
    return Path(root) / f".tmp-{_PREFIX}{step:06d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finish(tmp: Path, final: Path, state: dict) -> Path:
    """Add state.json and the manifest to the complete folder `tmp`, flush it and rename it
    to `final` (an older folder of that name is replaced); prune to the newest KEEP."""
    (tmp / STATE).write_text(json.dumps(state, sort_keys=True))
    files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {"step": state["step"], "files": {p.name: _sha256(p) for p in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True))
    for p in [*files, tmp / MANIFEST, tmp]:
        _fsync(p)
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        final.rename(old)
        shutil.rmtree(old)
    tmp.rename(final)
    _fsync(final.parent)
    for stale in checkpoints(final.parent)[KEEP:]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def checkpoints(root: str | Path) -> list[Path]:
    """The finished-looking checkpoint folders under root, newest first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used (None: it is complete and intact)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} missing or unreadable (a partial checkpoint)"
    for name in sorted(files):
        if not (path / name).is_file():
            return f"file {name} missing"
        if _sha256(path / name) != files[name]:
            return f"file {name} does not match its SHA-256 in {MANIFEST}"
    if STATE not in files or ".metadata" not in files:
        return f"{STATE} or .metadata not in {MANIFEST}"
    return None


def newest_valid(root: str | Path) -> tuple[Path | None, list[str]]:
    """(the newest intact checkpoint under root or None, one line per newer one refused)."""
    refused = []
    for path in checkpoints(root):
        why = problem(path)
        if why is None:
            return path, refused
        refused.append(f"checkpoint {path} refused: {why}; trying the one before")
    return None, refused


def read_state(path: Path) -> dict:
    """state.json of a checkpoint `problem` passed."""
    return json.loads((path / STATE).read_text())


def layout_of(spec: RunSpec) -> dict:
    """The layout a checkpoint's migration history and RNG states belong to (resuming on
    another layout starts those afresh)."""
    return {
        "world": spec.world,
        "pp": spec.pp,
        "dp": spec.dp,
        "ep": spec.ep,
        "tp": spec.tp,
        "etp": spec.etp,
        "fsdp": spec.fsdp,
        "stage_layers": [list(s) for s in spec.stage_layers],
        "migrate_every": spec.migrate_every,
    }


def model_of(spec: RunSpec) -> dict:
    """The model a checkpoint holds: any plan of it may resume from it."""
    return {
        "name": spec.model.name,
        "hidden_size": spec.model.hidden_size,
        "vocab_size": spec.model.vocab_size,
        "source_layers": list(spec.source_layers),
    }


def check_checkpointable(spec: RunSpec) -> None:
    """Every layout the runtime executes saves and loads whole-weight slices
    (runtime/weight_shards.py), but one: FSDP chunks each TP rank's vocabulary slice padding
    rows included, so with a vocabulary that tp does not divide a chunk is no slice of the
    whole embedding or head."""
    vocab = spec.model.vocab_size
    if spec.fsdp and spec.tp > 1 and vocab % spec.tp:
        raise SpecError(
            f"--checkpoint-dir with FSDP and tp={spec.tp} needs the vocabulary ({vocab}) "
            f"divisible by tp; re-plan with a tp that divides {vocab}, or without FSDP, or "
            "drop --checkpoint-dir"
        )


def resume_point(directory: str, spec: RunSpec) -> tuple[Path, int, list[str]]:
    """(checkpoint, its finished steps, lines refusing newer ones, each set aside) that
    --resume continues from; SpecError when there is none, it is of another model, or no
    step is left (then nothing is renamed)."""
    path, refused = newest_valid(directory)
    if path is None:
        raise SpecError(f"--resume: no intact checkpoint in {directory}; run without --resume")
    state = read_state(path)
    if state.get("model") != model_of(spec):
        raise SpecError(
            f"--resume: checkpoint {path} holds another model ({state.get('model')}); "
            "resume with the plan, --scale and --data it was written with, or use another "
            "--checkpoint-dir"
        )
    if state["step"] >= spec.steps:
        raise SpecError(
            f"--resume: checkpoint {path} has {state['step']} steps done and --steps is "
            f"{spec.steps}; raise --steps"
        )
    newer = [p for p in checkpoints(directory) if p.name > path.name]  # the refused ones
    lines = [f"{line}; set aside as {set_aside(p)}" for line, p in zip(refused, newer, strict=True)]
    return path, state["step"], lines


def set_aside(path: Path) -> Path:
    """Rename a refused checkpoint to `refused-<name>` (then `.1`, `.2`, ...): no longer a
    checkpoint, so pruning, which keeps the newest KEEP by name, keeps intact ones."""
    target, n = path.with_name(f"refused-{path.name}"), 0
    while target.exists():
        n += 1
        target = path.with_name(f"refused-{path.name}.{n}")
    path.rename(target)
    return target
