"""metrics.jsonl, the runtime's per-step record, read back and validated.

`piper run` writes one JSON object per step (runtime/metrics.py, rank 0): step (0, 1, 2, ...
in order), loss (finite), step_time_s (slowest rank), tokens_per_s, peak_memory_bytes
(largest rank), dispatch_s and combine_s (slowest rank), bytes_intra_node and
bytes_inter_node (summed over ranks), all numbers >= 0; and bytes_by_kind,
migrated_experts and per_rank (the same quantities for every rank, with rank and stage).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

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


def _check_step(d: Any, where: str, index: int) -> None:
    """One object: required keys present, numbers >= 0, steps in order, a finite loss."""
    if not isinstance(d, dict):
        raise SpecError(f"{where}: not a JSON object; {RERUN}")
    missing = [k for k in REQUIRED_KEYS if k not in d]
    if missing:
        raise SpecError(f"{where}: missing '{missing[0]}'; {RERUN}")
    for key in REQUIRED_KEYS[:-1]:
        value = d[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise SpecError(f"{where}: '{key}' must be a number >= 0, got {value!r}; {RERUN}")
    if d["step"] != index:
        raise SpecError(
            f"{where}: step {d['step']}, expected {index}; metrics.jsonl lists steps 0, 1, 2, "
            f"... in order: {RERUN} into an empty --out"
        )
    loss = d["loss"]
    if isinstance(loss, bool) or not isinstance(loss, int | float) or not math.isfinite(loss):
        raise SpecError(
            f"{where}: loss must be a finite number, got {loss!r}; the run diverged or recorded "
            f"no loss: {RERUN} (a lower --lr keeps it finite)"
        )


def parse_metrics(text: str, source: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """Parse metrics.jsonl text; every fault is a SpecError naming `source` and the line.

    Returns:
        One dict per step, in file order (blank lines skipped).
    """
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            raise SpecError(
                f"{source} line {n}: not JSON; metrics.jsonl has one object per line"
            ) from None
        _check_step(d, f"{source} line {n}", len(rows))
        rows.append(d)
    if not rows:
        raise SpecError(f"{source}: no steps; run at least one step with 'piper run'")
    return rows


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a metrics.jsonl file (parse_metrics)."""
    p = Path(path)
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise SpecError(
            f"{p}: not a text file; metrics.jsonl has one JSON object per line"
        ) from None
    except OSError:
        raise SpecError(f"{p}: no such metrics file; produce one with 'piper run'") from None
    return parse_metrics(text, str(p))
