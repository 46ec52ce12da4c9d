"""The checkpoint directory of `piper run --checkpoint-dir D`, without torch: names, the
atomic finish, the manifest check that refuses a corrupt or partial checkpoint, and the
choice of the newest valid one.

D holds one folder per checkpoint, `step-000010` (the run had finished 10 steps), written by
torch.distributed.checkpoint (runtime/checkpoint.py) into `.tmp-step-000010` and renamed
only once complete: `state.json` (the run's own state: step, placements, migration history,
metrics so far, and the run's record: run id, model config, data, seed) is added, then
`manifest.json` with the SHA-256 of every file, last. A folder without a manifest, or with a
file missing or different from its hash, is refused; `.tmp-*` folders are never read. Only
folders named exactly `step-NNNNNN` (not symbolic links) are checkpoints. The newest KEEP
checkpoints of the run are kept; another run's are never deleted. `piper run --resume` renames
a refused checkpoint newer than the one it resumes from to `refused-<name>`, so the pruning
keeps intact ones.

D also holds `run-identity.json` (the run record of the run whose checkpoints it holds) and
`.lock`, which the run writing D holds (flock) for its whole life. Nothing outside D is
written or deleted: a symbolic link in D is refused, never followed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from planner.inputs.safe_read import MAX_TEXT_BYTES, open_input, read_input_bytes
from planner.run.spec import RunSpec
from planner.specs import SpecError

MANIFEST = "manifest.json"
STATE = "state.json"
IDENTITY = "run-identity.json"
LOCK = ".lock"
KEEP = 2  # checkpoints kept: the newest, and the one used if it turns out corrupt
_PREFIX = "step-"
_NAME = re.compile(r"step-[0-9]{6}")  # a checkpoint's folder name, exactly


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
    if final.exists() or final.is_symlink():
        old = final.with_name(f".old-{final.name}")
        final.rename(old)
        remove_inside(final.parent, old)
    tmp.rename(final)
    _fsync(final.parent)
    mine = [p for p in checkpoints(final.parent) if _run_id(p) == state["run"]["run_id"]]
    for stale in mine[KEEP:]:
        remove_inside(final.parent, stale)
    return final


def _json_of(path: Path, max_bytes: int | None) -> Any:
    """The JSON document of a checkpoint file, read only from a regular file outside /proc,
    /sys and /dev (planner/inputs/safe_read.py; a FIFO or a device is a SpecError, a
    ValueError) of at most `max_bytes`. state.json has no bound: it carries the run's
    metrics lines (~0.95 MB a step at 1,024 ranks), as large as the run's metrics.jsonl."""
    if max_bytes is not None:
        return json.loads(read_input_bytes(path, path.name, max_bytes).decode("utf-8"))
    with open_input(path, path.name, None) as fh:
        return json.loads(fh.read().decode("utf-8"))


def _run_id(path: Path) -> str | None:
    """The run id in a checkpoint's state.json (None: unreadable or none recorded)."""
    try:
        return _json_of(path / STATE, None)["run"]["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_inside(root: str | Path, path: Path) -> None:
    """Delete `path`, an entry of the folder `root`: a symbolic link is unlinked, never
    followed; ValueError for anything not directly inside root."""
    if Path(path).parent.resolve() != Path(root).resolve():
        raise ValueError(f"{path} is not inside {root}")
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def checkpoints(root: str | Path) -> list[Path]:
    """The finished-looking checkpoint folders under root, newest first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.fullmatch(p.name) and _is_real_dir(p)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _is_real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used (None: it is complete and intact)."""
    try:
        manifest = _json_of(path / MANIFEST, MAX_TEXT_BYTES)
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
    return _json_of(path / STATE, None)


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


def resume_point(
    directory: str, spec: RunSpec, data: str | None = None
) -> tuple[Path, int, list[str]]:
    """(checkpoint, its finished steps, lines refusing newer ones, each set aside) that
    --resume continues from; SpecError when there is none, it is of another model, model
    config, --data or --seed (`check_record`), or no step is left (then nothing is renamed)."""
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
    check_record(path, state, run_record(spec, data, ""))
    if state["step"] >= spec.steps:
        raise SpecError(
            f"--resume: checkpoint {path} has {state['step']} steps done and --steps is "
            f"{spec.steps}; raise --steps"
        )
    newer = [p for p in checkpoints(directory) if p.name > path.name]  # the refused ones
    lines = [f"{line}; set aside as {set_aside(p)}" for line, p in zip(refused, newer, strict=True)]
    return path, state["step"], lines


def set_aside(path: Path, why: str = "refused") -> Path:
    """Rename a checkpoint to `<why>-<name>` (then `.1`, `.2`, ...): no longer a checkpoint,
    so neither resume nor pruning, which keeps the newest KEEP by name, sees it."""
    target, n = path.with_name(f"{why}-{path.name}"), 0
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{why}-{path.name}.{n}")
    path.rename(target)
    return target


def data_record(data: str | None) -> dict | None:
    """--data as a checkpoint records it: the resolved path and the bytes of its files (a
    Megatron PREFIX: PREFIX.bin and PREFIX.idx); None: the standard library's sources."""
    if data is None:
        return None
    path = Path(data).resolve()
    files = [path] if path.is_file() else [Path(f"{path}{ext}") for ext in (".bin", ".idx")]
    return {"path": str(path), "bytes": sum(f.stat().st_size for f in files if f.is_file())}


def run_record(spec: RunSpec, data: str | None, run_id: str) -> dict:
    """What identifies a run in its checkpoints: its id, the whole model config (the model
    as run and its numerics, with their SHA-256), --data and --seed. The layout is not part
    of it: another layout of the same model resumes from the checkpoint."""
    model = json.loads(
        json.dumps({"model": asdict(spec.model), "arch": asdict(spec.arch)}, default=str)
    )
    digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()
    return {
        "run_id": run_id,
        "model": model,
        "model_sha256": digest,
        "data": data_record(data),
        "seed": spec.seed,
    }


def _flat(value, prefix: str = "") -> dict:
    """{"layers[1].moe.top_k": 2, ...} of nested dicts and lists."""
    if isinstance(value, dict):
        return {k: v for key in value for k, v in _flat(value[key], f"{prefix}.{key}").items()}
    if isinstance(value, list):
        return {k: v for i, x in enumerate(value) for k, v in _flat(x, f"{prefix}[{i}]").items()}
    return {prefix.lstrip("."): value}


def record_differences(saved: dict | None, current: dict) -> list[str]:
    """What differs between a checkpoint's run record and this run's, one phrase each."""
    if not isinstance(saved, dict):
        return ["no run record (model config, data, seed)"]
    out = []
    for name in ("seed", "data"):
        if saved.get(name) != current[name]:
            out.append(f"{name} {saved.get(name)} (this run: {current[name]})")
    was, now = _flat(saved.get("model")), _flat(current["model"])
    for key in sorted(was.keys() | now.keys()):
        if was.get(key) != now.get(key):
            name = key.removeprefix("model.")  # the model's own fields; arch.* its numerics
            out.append(f"model config {name} {was.get(key)} (this run: {now.get(key)})")
    return out


def check_record(path: Path, state: dict, current: dict) -> None:
    """SpecError naming what differs when the checkpoint at `path` was written by a run of
    another model config, --data or --seed."""
    diff = record_differences(state.get("run"), current)
    if diff:
        more = f" and {len(diff) - 1} more" if len(diff) > 1 else ""
        raise SpecError(
            f"--resume: checkpoint {path} was written with {diff[0]}{more}; resume with the "
            "model, --scale, --data and --seed it was written with, or use another "
            "--checkpoint-dir"
        )


def check_folder(root: str | Path, resume: bool, force: bool) -> list[str]:
    """Refuse (SpecError) a checkpoint folder that holds a symbolic link, or, for a fresh
    run (no --resume), checkpoints of another run unless `force`: then they are set aside
    as `replaced-<name>`, one returned line each."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise SpecError(f"--checkpoint-dir {root} is not a folder; name a folder")
    entries = sorted(root.iterdir()) if root.is_dir() else []
    for entry in entries:
        if entry.is_symlink():
            raise SpecError(
                f"--checkpoint-dir {root} holds a symbolic link {entry.name}; remove it "
                "(nothing outside the folder is written)"
            )
    found = checkpoints(root)
    if resume or not found:
        return []
    if not force:
        raise SpecError(
            f"--checkpoint-dir {root} holds checkpoints of another run ({found[0].name}, "
            f"{len(found)} in all); continue it with --resume, start afresh beside them "
            "with --force (they are set aside), or use another folder"
        )
    return [f"checkpoint {p} of another run set aside as {set_aside(p, 'replaced')}" for p in found]


def write_identity(root: str | Path, record: dict) -> None:
    """run-identity.json in `root`: the record of the run whose checkpoints it holds."""
    tmp = Path(root) / f".tmp-{IDENTITY}"
    tmp.write_text(json.dumps({k: v for k, v in record.items() if k != "model"}, sort_keys=True))
    tmp.rename(Path(root) / IDENTITY)


def lock_folder(root: str | Path) -> int:
    """Take the folder's lock (flock on `root/.lock`, created with its folder); the file
    descriptor, held until closed or the process ends. SpecError when another run holds it."""
    Path(root).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(root) / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise SpecError(
            f"--checkpoint-dir {root} is in use by another run (it holds {Path(root) / LOCK}); "
            "wait for it to end or use another folder"
        ) from None
    return fd


def prepare_folder(root: str | Path, resume: bool, force: bool) -> list[str]:
    """`piper run`'s check before launch: SpecError when a run holds the folder's lock (its
    checkpoints are then left as they are), else `check_folder`'s. The lock is let go: the
    run's rank 0 takes it (runtime/checkpoint.py)."""
    if (Path(root) / LOCK).is_file():
        os.close(lock_folder(root))
    return check_folder(root, resume, force)
