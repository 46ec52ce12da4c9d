"""`piper plan --shortlist K [--trial-steps N]`: the trial loop's jobs beside the plan.

The K layouts come from planner.calibrate.shortlist (the predicted best, then the layouts that
pin the model down); each is planned with its layout fixed (the same search, every size and
knob given), and planner.outputs.trials writes OUT/shortlist/ (planner/PROFILING.md, "The
trial loop").
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.outputs.console import Phases
from planner.specs import ModelSpec, SpecError

TRIAL_STEPS = 30
# flags the re-plan does not repeat: its own --cluster and --out, and the trial loop's
NOT_REPEATED = {"help", "cluster", "out", "shortlist", "trial_steps", "json", "target"}
PATH_FLAGS = ("model", "allocation", "trace")


@dataclass(frozen=True)
class PlanInputs:
    """What `piper plan` read: the model, cluster, training (as given) and target."""

    model: ModelSpec
    cluster: Any
    training: Any
    target: Any


def add_shortlist_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shortlist",
        default=None,
        metavar="K",
        help="also write OUT/shortlist/: K layouts whose predicted intervals overlap the "
        "best one's, chosen to pin the model down, each with a short benchmark job for the "
        "target engine, and collect.sh (refit on their logs, re-plan); planner/PROFILING.md",
    )
    p.add_argument(
        "--trial-steps",
        type=int,
        default=TRIAL_STEPS,
        metavar="N",
        help=f"iterations of each trial job (default {TRIAL_STEPS}; the first is the warm-up)",
    )


def shortlist_count(args: argparse.Namespace) -> int:
    """--shortlist K as an int >= 1 (0 when not given), --trial-steps checked; SpecError
    otherwise (before the search, so a bad flag costs nothing and writes nothing)."""
    text = args.shortlist
    if text is None:
        return 0
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1 or str(count) != text.strip():
        raise SpecError(f"--shortlist {text}: give a whole number of trial layouts >= 1, e.g. 3")
    if args.trial_steps < 2:
        raise SpecError(
            f"--trial-steps {args.trial_steps}: give >= 2 (the first step is the warm-up)"
        )
    return count


def check_shortlist_folder(args: argparse.Namespace, out: str) -> None:
    """With --shortlist, refuse an OUT/shortlist folder the trial scripts cannot name, before
    the search (planner.outputs.trials.check_path)."""
    if args.shortlist is None:
        return
    from planner.outputs.trials import check_path

    check_path(Path(out, "shortlist").resolve(), "--out")


Search = Callable[[argparse.Namespace, Phases], "tuple[Any, PlanInputs] | None"]


def shortlist_files(
    args: argparse.Namespace,
    result: Any,
    inputs: PlanInputs,
    count: int,
    out: str,
    search: Search,
) -> dict[str, str]:
    """The files of OUT/shortlist/ for the plan `result` (planner.outputs.trials)."""
    from planner.calibrate.error_bars import with_intervals
    from planner.calibrate.shortlist import shortlist
    from planner.outputs.trials import check_path, trial_files

    folder = Path(out, "shortlist").resolve()
    check_path(folder, "--out")
    chosen = shortlist(
        result.rows, inputs.model, inputs.cluster, inputs.training, inputs.target, count
    )
    plans = [with_intervals(result, inputs.cluster).plan]
    for trial in chosen.trials[1:]:
        found = search(fixed_layout(args, trial.row), Phases(None))
        if found is None:
            raise KeyboardInterrupt
        plans.append(with_intervals(found[0], inputs.cluster).plan)
    files, _ = trial_files(
        chosen, plans, folder, replan_argv(args, inputs), inputs.cluster, args.trial_steps
    )
    return files


def fixed_layout(args: argparse.Namespace, row: Any) -> argparse.Namespace:
    """The flags with every size and knob of the candidate `row` fixed."""
    par, knobs = row.parallel, row.knobs
    fixed = argparse.Namespace(**vars(args))
    for name in ("pp", "dp", "tp", "ep", "vp", "cp", "etp"):
        setattr(fixed, name, getattr(par, name))
    fixed.micro_batch = par.micro_batch
    fixed.recompute = par.recompute
    fixed.recompute_modules = list(par.recompute_modules) or None
    fixed.zero = knobs.sharding == "zero"
    fixed.fsdp = knobs.sharding == "fsdp"
    fixed.a2a_overlap = knobs.a2a_overlap
    fixed.dispatcher = knobs.dispatcher
    return fixed


def replan_argv(args: argparse.Namespace, inputs: PlanInputs) -> list[str]:
    """`plan` and the flags the user gave (files made absolute), with --target fixed to the
    engine planned for; --cluster and --out are the caller's."""
    argv = ["plan", "--target", inputs.target.name]
    for action in args.plan_parser._actions:
        dest = action.dest
        if dest in NOT_REPEATED or not action.option_strings:
            continue
        value = getattr(args, dest, None)
        flag = action.option_strings[0]
        if value is None or value == action.default:
            continue
        if dest in PATH_FLAGS and Path(str(value)).exists():
            value = str(Path(str(value)).resolve())
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv
