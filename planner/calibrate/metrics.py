"""metrics.jsonl, the runtime's per-step record, read back and validated.

`piper run` writes one JSON object per step (runtime/metrics.py, rank 0): step (0, 1, 2, ...
in order), loss (finite), step_time_s (slowest rank), tokens_per_s, peak_memory_bytes
(largest rank), dispatch_s and combine_s (slowest rank), bytes_intra_node and
bytes_inter_node (summed over ranks), all finite numbers >= 0; and bytes_by_kind,
migrated_experts and per_rank (the same quantities for every rank, with rank and stage;
calibration reads per_rank's stage, peak_memory_bytes, dispatch_s and combine_s, so those are
checked where per_rank is present).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from planner.inputs.json_errors import DuplicateKey, json_error_line, unique_object
from planner.inputs.safe_read import open_input
from planner.specs import SpecError

# Every step must carry these, numbers >= 0 (the first five are what calibration reads).
REQUIRED_KEYS = (
    "step",
    "step_time_s",
    "dispatch_s",
    "combine_s",
    "peak_memory_bytes",
    "tokens_per_s",
    "bytes_intra_node",
    "bytes_inter_node",
    "loss",
)
RERUN = "re-run 'piper run'"
MAX_VALUE = 1e30  # above any time, byte count or rate a run records
PER_RANK_KEYS = ("peak_memory_bytes", "dispatch_s", "combine_s")
# A line holds one step: 0.95 MB for 1,024 ranks with per_rank entries (runtime/metrics.py
# step_line, measured with 20 byte kinds per rank), so this bound holds ~70,000 ranks. A
# 40,000-step run of 1,024 ranks writes ~36 GiB, so the file is streamed, never capped.
MAX_LINE_BYTES = 64 * 2**20


def _number(value: Any) -> bool:
    """A JSON number in [0, MAX_VALUE] (not a bool, not NaN or infinite)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 <= value <= MAX_VALUE


def _check_per_rank(d: dict[str, Any], where: str) -> None:
    ranks = d.get("per_rank", [])
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        raise SpecError(f"{where}: 'per_rank' must be a list of objects; {RERUN}")
    for i, r in enumerate(ranks):
        stage = r.get("stage", 0)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < 1 << 24:
            raise SpecError(f"{where}: per_rank[{i}].stage must be an integer >= 0; {RERUN}")
        bad = next((k for k in PER_RANK_KEYS if not _number(r.get(k))), None)
        if bad:
            raise SpecError(f"{where}: per_rank[{i}].{bad} must be a number >= 0; {RERUN}")


def _check_step(d: Any, where: str, index: int) -> None:
    """One object: required keys present, numbers >= 0, steps in order, a finite loss."""
    if not isinstance(d, dict):
        raise SpecError(f"{where}: not a JSON object; {RERUN}")
    missing = [k for k in REQUIRED_KEYS if k not in d]
    if missing:
        raise SpecError(f"{where}: missing '{missing[0]}'; {RERUN}")
    for key in REQUIRED_KEYS[:-1]:
        value = d[key]
        if not _number(value):
            shown = repr(value)[:40]
            raise SpecError(f"{where}: '{key}' must be a number >= 0, got {shown}; {RERUN}")
    if d["step"] != index:
        raise SpecError(
            f"{where}: step {d['step']}, expected {index}; metrics.jsonl lists steps 0, 1, 2, "
            f"... in order: {RERUN} into an empty --out"
        )
    loss = d["loss"]
    if isinstance(loss, bool) or not isinstance(loss, int | float) or not abs(loss) <= MAX_VALUE:
        raise SpecError(
            f"{where}: loss must be a finite number, got {repr(loss)[:40]}; the run diverged or "
            f"recorded no loss: {RERUN} (a lower --lr keeps it finite)"
        )
    _check_per_rank(d, where)


# A step a resumed run carried over from a checkpoint of another layout (runtime/checkpoint.py
# marks it): it measures that layout, not the plan's.
EARLIER_LAYOUT = "earlier_layout"


def this_layout(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps run on the layout of the run's plan: all but those a resume carried over
    from another layout's checkpoint (EARLIER_LAYOUT); all of them when none is left."""
    return [d for d in rows if not d.get(EARLIER_LAYOUT)] or rows


def parse_metrics(text: str, source: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """Parse metrics.jsonl text; every fault is a SpecError naming `source` and the line.

    Returns:
        One dict per step, in file order (blank lines skipped).
    """
    return _parse_lines(enumerate(text.splitlines(), start=1), source)


def _parse_lines(lines: Iterable[tuple[int, str]], source: str) -> list[dict[str, Any]]:
    """The steps of (line number, line) pairs (parse_metrics)."""
    rows: list[dict[str, Any]] = []
    for n, line in lines:
        if not line.strip():
            continue
        try:
            d = json.loads(line, object_pairs_hook=unique_object)
        except json.JSONDecodeError as exc:
            fix = "metrics.jsonl has one JSON object per line, as 'piper run' writes it"
            raise SpecError(json_error_line(source, exc, fix, line=n)) from None
        except DuplicateKey as exc:
            raise SpecError(
                f"{source} line {n}: key {exc.key[:60]!r} is given twice; keep one"
            ) from None
        except (ValueError, RecursionError):  # a > 4300-digit number, deep nesting
            raise SpecError(
                f"{source} line {n}: not JSON; metrics.jsonl has one object per line"
            ) from None
        _check_step(d, f"{source} line {n}", len(rows))
        rows.append(d)
    if not rows:
        raise SpecError(f"{source}: no steps; run at least one step with 'piper run'")
    return rows


def _file_lines(fh: BinaryIO, p: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of an open metrics.jsonl, no line read past MAX_LINE_BYTES."""
    for n in itertools.count(1):
        try:
            raw = fh.readline(MAX_LINE_BYTES + 1)
        except OSError as exc:
            raise SpecError(f"{p}: cannot read the metrics ({exc.strerror or exc})") from None
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES:
            raise SpecError(
                f"{p} line {n}: longer than {MAX_LINE_BYTES // 2**20} MiB, more than any "
                f"step's line; not the metrics.jsonl 'piper run' writes: {RERUN}"
            )
        try:
            yield n, raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(
                f"{p} line {n}: not a text file; metrics.jsonl has one JSON object per line"
            ) from None


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a metrics.jsonl file (parse_metrics), streamed: a regular file
    (planner/inputs/safe_read.py) of any length, each line at most MAX_LINE_BYTES."""
    p = Path(path)
    if not p.exists():
        raise SpecError(f"{p}: no such metrics file; produce one with 'piper run'")
    with open_input(p, "metrics", max_bytes=None) as fh:
        return _parse_lines(_file_lines(fh, p), str(p))
