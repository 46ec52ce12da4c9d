"""What a run executed against what its plan priced, read from the run's run.json.

`piper run` writes run.json beside metrics.jsonl (runtime/launch.py, `_run_info`): the layout
as executed (after --scale), the dispatcher, sequence length, model width and depth.
`run_differences(plan, info)` lists every setting where the run and the plan disagree, so
`piper calibrate` can say that its comparison is not like for like; `repricing` says how the
resource model prices the run's dispatcher instead (planner.calibrate.compare applies it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.inputs.safe_read import read_input_bytes
from planner.plan.schema import Plan
from planner.resources.layer_comm import RUNTIME_DISPATCHERS
from planner.search.space import a2a_overlap_allowed
from planner.specs import SpecError

RUN_FILE = "run.json"  # written by `piper run` beside metrics.jsonl
LAYOUT_KEYS = ("pp", "dp", "tp", "ep", "vp", "etp", "micro_batch", "num_microbatches")


@dataclass(frozen=True)
class Difference:
    """One setting on which the run and the plan disagree."""

    setting: str  # "dispatcher", "pp", "hidden_size", ...
    planned: str
    ran: str


def load_run_info(metrics_path: str | Path) -> dict[str, Any] | None:
    """run.json beside `metrics_path`, or None when the run left none; read only from a
    regular file of at most MAX_TEXT_BYTES (planner/inputs/safe_read.py: a FIFO, a device or
    a directory of that name is one SpecError line)."""
    path = Path(metrics_path).parent / RUN_FILE
    if not os.path.lexists(path):
        return None
    raw = read_input_bytes(path, RUN_FILE)
    try:
        info = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SpecError(
            f"{path}: not the run.json 'piper run' writes ({type(exc).__name__}); re-run "
            "'piper run' or remove it"
        ) from None
    if not isinstance(info, dict):
        raise SpecError(f"{path}: not the run.json 'piper run' writes (not an object); re-run it")
    return info


def planned_settings(plan: Plan) -> dict[str, Any]:
    """The settings of `plan` that run.json also records, under run.json's names."""
    par = plan.parallel
    extra = plan.extra if isinstance(plan.extra, dict) else {}
    model = plan.model_spec()
    out: dict[str, Any] = {key: getattr(par, key) for key in LAYOUT_KEYS}
    out.update(
        dispatcher=extra.get("dispatcher", "flat"),
        seq_len=plan.training.get("seq_len"),
        fsdp=bool(plan.training.get("fsdp", False)),
        recompute=par.recompute,
        hidden_size=model.hidden_size,
        layers=model.num_layers,
    )
    return out


def run_differences(plan: Plan, info: Mapping[str, Any] | None) -> tuple[Difference, ...]:
    """The settings recorded in `info` (run.json) that differ from `plan`'s, in a fixed order;
    () without a run.json."""
    if info is None:
        return ()
    planned = planned_settings(plan)
    return tuple(
        Difference(key, str(value), str(info[key]))
        for key, value in planned.items()
        if key in info and info[key] is not None and info[key] != value
    )


@dataclass(frozen=True)
class Repricing:
    """How to price the run instead of the plan: the run's dispatcher, and whether the
    all-to-all overlap stays on (the model allows it only with some dispatchers,
    planner.search.space.a2a_overlap_allowed)."""

    dispatcher: str  # one of planner.resources.layer_comm.RUNTIME_DISPATCHERS
    a2a_overlap: bool


def repricing(plan: Plan, differences: tuple[Difference, ...]) -> Repricing | None:
    """The Repricing for a run whose dispatcher differs from the plan's; None when it does
    not, or when the model prices no dispatcher like the run's."""
    dispatcher = next((d.ran for d in differences if d.setting == "dispatcher"), None)
    if dispatcher not in RUNTIME_DISPATCHERS:
        return None
    overlap = bool(plan.training.get("a2a_overlap", False))
    if overlap:
        model = plan.model_spec()
        mtp = plan.training.get("mtp_layers")
        mtp = model.num_mtp_layers if mtp is None else int(mtp)
        overlap = a2a_overlap_allowed(plan.parallel.config(), dispatcher, mtp)[0]
    return Repricing(dispatcher, overlap)


def differences_line(
    differences: tuple[Difference, ...], reprice: Repricing | None, plan_overlap: bool
) -> str:
    """One line for the output and the report: what differs and what was repriced; '' when
    the run did what the plan priced."""
    if not differences:
        return ""
    listed = ", ".join(f"{d.setting} {d.ran} (plan: {d.planned})" for d in differences)
    line = f"the run differs from what the plan priced: {listed}"
    if reprice is not None:
        line += f"; predictions repriced for the {reprice.dispatcher} dispatcher"
        if plan_overlap and not reprice.a2a_overlap:
            line += f", without the all-to-all overlap (not allowed with {reprice.dispatcher})"
    if any(d.setting != "dispatcher" for d in differences):
        line += "; the other differences are not repriced"
    return line
