"""`piper plan --shortlist K|auto [--shortlist-probability P] [--trial-steps N]`: the trial
loop's jobs beside the plan, and the pick's odds in plan.json.

The K layouts come from planner.calibrate.shortlist (the predicted best, then the layouts that
pin the model down; with `auto`, the fewest whose summed P(best) reaches P); each is planned
with its layout fixed (the same search, every size and knob given), and
planner.outputs.trials writes OUT/shortlist/ (planner/PROFILING.md, "The trial loop").
`with_odds` puts the pick's P(best) (planner.calibrate.pick_odds) into plan.json's
`extra.pick`, and the shortlist's summed P(best) beside it (planner/PLANNING.md, "The pick
under uncertainty").
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from planner.outputs.console import Phases
from planner.search.uncertain_rank import SHORTLIST_PROBABILITY, Odds
from planner.specs import ModelSpec, SpecError

TRIAL_STEPS = 30
# flags the re-plan does not repeat: its own --cluster and --out, and the trial loop's
NOT_REPEATED = {"help", "cluster", "out", "shortlist", "shortlist_probability", "trial_steps",
                "json", "target"}  # fmt: skip
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
        metavar="K|auto",
        help="also write OUT/shortlist/: K layouts whose predicted intervals overlap the "
        "best one's, chosen to pin the model down, each with a short benchmark job for the "
        "target engine, and collect.sh (refit on their logs, re-plan); 'auto': the fewest "
        "layouts whose summed probability of being the fastest reaches "
        "--shortlist-probability; planner/PROFILING.md",
    )
    p.add_argument(
        "--shortlist-probability",
        type=float,
        default=None,
        metavar="P",
        help=f"with --shortlist auto (implied): the summed P(best) the trials cover, in (0, 1] "
        f"(default {SHORTLIST_PROBABILITY}); planner/PLANNING.md",
    )
    p.add_argument(
        "--trial-steps",
        type=int,
        default=TRIAL_STEPS,
        metavar="N",
        help=f"iterations of each trial job (default {TRIAL_STEPS}; the first is the warm-up)",
    )


@dataclass(frozen=True)
class ShortlistAsk:
    """--shortlist as asked: K trials, or (`auto`) the summed P(best) they must cover."""

    count: int
    probability: float | None = None


def shortlist_count(args: argparse.Namespace) -> ShortlistAsk | None:
    """--shortlist K (an int >= 1) or auto (with --shortlist-probability P in (0, 1], which
    alone implies auto), --trial-steps checked; None when no shortlist is asked; SpecError
    otherwise (before the search, so a bad flag costs nothing and writes nothing)."""
    text, probability = args.shortlist, getattr(args, "shortlist_probability", None)
    if text is None and probability is None:
        return None
    if probability is not None and not 0 < probability <= 1:
        raise SpecError(
            f"--shortlist-probability {probability}: give a probability in (0, 1], e.g. 0.9"
        )
    if text is not None and text.strip() != "auto" and probability is not None:
        raise SpecError(
            f"--shortlist {text} with --shortlist-probability: the probability sizes the list "
            "itself; give --shortlist auto or drop the probability"
        )
    if args.trial_steps < 2:
        raise SpecError(
            f"--trial-steps {args.trial_steps}: give >= 2 (the first step is the warm-up)"
        )
    if text is None or text.strip() == "auto":
        return ShortlistAsk(0, SHORTLIST_PROBABILITY if probability is None else probability)
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1 or str(count) != text.strip():
        raise SpecError(
            f"--shortlist {text}: give a whole number of trial layouts >= 1 (e.g. 3) or auto"
        )
    return ShortlistAsk(count)


def with_odds(result: Any, inputs: PlanInputs) -> tuple[Any, Odds | None]:
    """The result whose plan.json carries the pick's P(best) in `extra.pick` and the
    published measurements of its setting in `extra.published` (planner.calibrate.pick_odds;
    each left out where there is none), and the odds (None when nothing was solved)."""
    from planner.calibrate.pick_odds import pick_odds, published_measurements
    from planner.outputs.pick_lines import published_entries

    odds = pick_odds(result.rows, inputs.model, inputs.cluster, inputs.training, inputs.target)
    if result.plan is None:
        return result, odds
    published = published_measurements(inputs.model, inputs.cluster, inputs.training, result.gpus)
    extra = dict(result.plan.extra)
    if odds is not None:
        extra["pick"] = odds.to_dict()
    if published:
        extra["published"] = published_entries(published)
    return replace(result, plan=replace(result.plan, extra=extra)), odds


def _with_pick(result: Any, pick: dict[str, Any]) -> Any:
    plan = result.plan
    return replace(result, plan=replace(plan, extra={**plan.extra, "pick": pick}))


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
    ask: ShortlistAsk,
    out: str,
    search: Search,
    odds: Odds | None = None,
) -> tuple[Any, dict[str, str]]:
    """The files of OUT/shortlist/ for the plan `result` (planner.outputs.trials), and the
    result whose `extra.pick` records the shortlist's summed P(best) (and, with auto, the
    probability asked for)."""
    from planner.calibrate.error_bars import with_intervals
    from planner.calibrate.shortlist import shortlist
    from planner.outputs.trials import check_path, trial_files

    folder = Path(out, "shortlist").resolve()
    check_path(folder, "--out")
    chosen = shortlist(
        result.rows, inputs.model, inputs.cluster, inputs.training, inputs.target, ask.count,
        odds=odds, probability=ask.probability,
    )  # fmt: skip
    if odds is not None and result.plan is not None:
        pick = {**result.plan.extra["pick"], "shortlist_trials": len(chosen.trials),
                "shortlist_p_best": round(chosen.p_best_total, 4)}  # fmt: skip
        if ask.probability is not None:
            pick["shortlist_probability"] = ask.probability
        result = _with_pick(result, pick)
    plans = [with_intervals(result, inputs.cluster).plan]
    for trial in chosen.trials[1:]:
        found = search(fixed_layout(args, trial.row), Phases(None))
        if found is None:
            raise KeyboardInterrupt
        plans.append(with_intervals(found[0], inputs.cluster).plan)
    files, _ = trial_files(
        chosen, plans, folder, replan_argv(args, inputs), inputs.cluster, args.trial_steps
    )
    return result, files


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
