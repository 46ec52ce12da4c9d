"""The plan's stamp on every exported file, and the exports in a folder made from another plan.

Every file `piper export` writes (the Megatron and torchtitan args files, torchtitan's config
module, the Slurm job) carries one comment line near its top:

    # piper-plan: sha256=<sha256 of plan.json's bytes> inputs_sha256=<plan.json inputs_sha256>

`sha256` names one version of one plan file: a re-plan (other GPUs, another memory margin,
another piper) or an edit gives another. `inputs_sha256` is the plan's own digest of its inputs,
there so a reader can tell which planning run a file came from. The Slurm job compares the
stamps of the files it sources with its own and hashes plan.json before it starts anything
(planner.outputs.export.slurm); `stale_exports` finds the stamped files of a folder that belong
to another plan, for `piper plan` to warn about when it writes a new plan beside them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from planner.plan.schema import Plan

PREFIX = "# piper-plan: "
# the stamp is among the first lines of a file (after a shebang); reading no further keeps
# the scan of a folder cheap and a stamp-like line deep in a user's file out of it
HEAD_LINES = 5
HEAD_BYTES = 4096
_STAMP = re.compile(r"# piper-plan: sha256=([0-9a-f]{64}) inputs_sha256=(\S*)\Z")


@dataclass(frozen=True)
class PlanStamp:
    """Which plan file an export was made from: its bytes' sha256 and its inputs digest."""

    sha256: str
    inputs_sha256: str

    @property
    def line(self) -> str:
        return f"{PREFIX}sha256={self.sha256} inputs_sha256={self.inputs_sha256 or '-'}"


def plan_stamp(plan: Plan, plan_bytes: bytes | None = None) -> PlanStamp:
    """The stamp of `plan` as the file `plan_bytes` (default: the bytes `piper plan` writes
    for it, `plan.to_json()`)."""
    data = plan.to_json().encode() if plan_bytes is None else plan_bytes
    return PlanStamp(hashlib.sha256(data).hexdigest(), plan.inputs_sha256)


def stamped(text: str, stamp: PlanStamp) -> str:
    """`text` with the stamp line first (second after a `#!` line)."""
    head, sep, rest = text.partition("\n")
    if head.startswith("#!"):
        return f"{head}{sep}{stamp.line}\n{rest}"
    return f"{stamp.line}\n{text}"


def stamp_of(text: str) -> PlanStamp | None:
    """The stamp among the first HEAD_LINES lines of `text`, if any."""
    for line in text.splitlines()[:HEAD_LINES]:
        match = _STAMP.match(line)
        if match:
            sha, inputs = match.groups()
            return PlanStamp(sha, "" if inputs == "-" else inputs)
    return None


def file_stamp(path: Path) -> PlanStamp | None:
    """The stamp of the file at `path`; None when it has none, is no plain file (a symlink
    neither) or cannot be read."""
    try:
        if not path.is_file() or path.is_symlink():
            return None
        with path.open("rb") as f:
            return stamp_of(f.read(HEAD_BYTES).decode("utf-8", errors="replace"))
    except OSError:
        return None


def stale_exports(folder: str | Path, stamp: PlanStamp) -> tuple[str, ...]:
    """Names of the files directly in `folder` stamped for a plan other than `stamp`'s
    (sorted; unreadable files and folders are skipped)."""
    root = Path(folder)
    if not root.is_dir():
        return ()
    stale = []
    for path in sorted(root.iterdir()):
        found = file_stamp(path)
        if found is not None and found.sha256 != stamp.sha256:
            stale.append(path.name)
    return tuple(stale)


def stale_warning(folder: str | Path, plan: Plan) -> str | None:
    """One line for `piper plan` to print when `folder` (where it wrote `plan`) holds exports
    of another plan, else None."""
    stale = stale_exports(folder, plan_stamp(plan))
    if not stale:
        return None
    plan_json = Path(folder) / "plan.json"
    return (
        f"piper plan: WARNING: {', '.join(stale)} in {folder} were exported from another plan "
        f"and no longer match {plan_json}; re-export them (piper export {plan_json} --to ...) "
        "or delete them: the Slurm job refuses them at start"
    )
