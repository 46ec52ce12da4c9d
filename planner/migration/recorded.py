"""The intervals `piper migrate` replays: from the run that wrote the trace, the plan, or flags.

`piper run` writes run.json next to its trace.csv (runtime/launch.py, `_run_info`): the run's
`ep`, `steps`, `migrate_every` (steps per migration interval, 0 = never), `trace_every`
(steps summed into one trace row) and its seq_len, micro_batch and num_microbatches. A
replay of that trace uses the run's own intervals: migrate_every / trace_every trace rows per
interval, migrate_every steps per interval. The plan gives ep and the tokens each EP rank
feeds its MoE layers per step (seq_len x micro_batch x num_microbatches, as
planner/run/migration.py prices the run's live moves); without a plan the run gives both.
The policies see the rows the run's policy saw: run.json's `migrate_rows_per_interval` rows
per interval. A flag that contradicts the run or the plan is a SpecError, as is a trace
whose shape contradicts them; a flag is only needed for what neither records.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.inputs.json_errors import DuplicateKey, unique_object
from planner.migration.trace import Trace
from planner.plan import Plan
from planner.specs import SpecError

log = logging.getLogger(__name__)

RUN_FILE = "run.json"  # written by `piper run` beside trace.csv
RUN_KEYS = ("ep", "steps", "migrate_every", "trace_every")
TOKEN_KEYS = ("seq_len", "micro_batch", "num_microbatches")  # tokens per EP rank and step
DEFAULT_STEPS_PER_INTERVAL = 100  # a trace of one row per interval, without a run.json


@dataclass(frozen=True)
class RunRecord:
    """What run.json says about the run that wrote a trace."""

    path: str
    ep: int
    steps: int
    migrate_every: int  # steps per migration interval; 0 = the run never migrated
    trace_every: int  # steps summed into one trace row
    tokens_per_rank_step: int | None = None  # seq_len x micro_batch x num_microbatches
    policy_rows: int | None = None  # rows of one interval in the run's policy history


@dataclass(frozen=True)
class ReplayIntervals:
    """The settings of one replay, resolved from flags, the run and the plan."""

    ep: int
    rows_per_interval: int  # trace rows summed into one interval
    steps_per_interval: int  # training steps of one interval (prices the expert compute)
    tokens_per_rank_step: int | None  # None: migrate_setup's default
    source: str  # where they came from, printed with the table
    trace_rows: int  # rows replayed: the whole intervals of the trace (of a run, see below)
    rows_per_history_row: int = 1  # trace rows summed into one row the policies see


def plan_tokens_per_rank_step(plan: Plan) -> int:
    """Tokens each EP rank feeds its MoE layers per step: seq_len x micro_batch x
    num_microbatches of the plan."""
    par = plan.parallel
    return int(plan.training.get("seq_len", 4096)) * par.micro_batch * par.num_microbatches


def load_run_record(trace_path: str) -> RunRecord | None:
    """run.json beside the trace, or None when there is none."""
    path = Path(trace_path).parent / RUN_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(), object_pairs_hook=unique_object)
    except DuplicateKey as exc:
        raise SpecError(
            f"{path}: key {exc.key[:60]!r} is given twice; rerun 'piper run' to rewrite it"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{path}: not the run.json 'piper run' writes ({exc})") from None
    except (ValueError, RecursionError):  # a > 4300-digit number, nesting past the stack
        raise SpecError(f"{path}: not the run.json 'piper run' writes (too deep or long)") from None
    values = data if isinstance(data, dict) else {}
    bad = [k for k in RUN_KEYS if not isinstance(values.get(k), int) or values[k] < 0]
    if bad or values["ep"] < 1 or values["trace_every"] < 1:
        field = bad[0] if bad else ("ep" if values["ep"] < 1 else "trace_every")
        raise SpecError(
            f"{path}: field '{field}' must be a positive integer; rerun 'piper run' to "
            f"rewrite it, or move the trace out of that folder"
        )
    shape = [values.get(k) for k in TOKEN_KEYS]
    tokens = int(np.prod(shape)) if all(isinstance(v, int) and v > 0 for v in shape) else None
    policy_rows = values.get("migrate_rows_per_interval")
    policy_rows = policy_rows if isinstance(policy_rows, int) and policy_rows > 0 else None
    return RunRecord(str(path), *(int(values[k]) for k in RUN_KEYS), tokens, policy_rows)


def _agree(flag: str, given: int | None, value: int, where: str) -> int:
    """`value` (recorded in `where`), after checking the flag the user gave, if any."""
    if given is not None and given != value:
        raise SpecError(
            f"{flag} {given} contradicts {where} ({value}); drop it or pass {flag} {value}"
        )
    return value


def _resolve_ep(ep: int | None, run: RunRecord | None, plan: Plan | None, plan_path: str) -> int:
    if plan is not None and run is not None and run.ep != plan.parallel.ep:
        raise SpecError(
            f"{run.path}: the run that wrote the trace had ep={run.ep}, {plan_path} has "
            f"ep={plan.parallel.ep}; pass the plan that run trained"
        )
    if plan is not None:
        return _agree("--ep", ep, plan.parallel.ep, f"{plan_path}'s ep")
    if run is not None:
        return _agree("--ep", ep, run.ep, f"the ep of the run that wrote the trace, {run.path}")
    if ep is None:
        raise SpecError("--ep is needed: pass --ep R or --plan PLAN.json")
    return ep


def _run_rows(run: RunRecord, trace: Trace, rows: int | None, steps: int | None):
    """(rows, steps) per interval of the run that wrote `trace`, checked against its shape."""
    written = -(-run.steps // run.trace_every)
    if trace.num_intervals != written:
        raise SpecError(
            f"{trace.source}: {trace.num_intervals} rows, but {run.path} records {run.steps} "
            f"steps summed {run.trace_every} per row ({written} rows); pass that run's trace"
        )
    if run.migrate_every == 0:  # the run never migrated: intervals are the user's choice
        k = 1 if rows is None else rows
        return k, _agree("--steps-per-interval", steps, k * run.trace_every, "the run's rows")
    if run.migrate_every % run.trace_every:
        raise SpecError(
            f"{run.path}: migrate_every {run.migrate_every} is no whole number of trace rows "
            f"of {run.trace_every} steps; rerun with a --trace-every that divides it"
        )
    k = run.migrate_every // run.trace_every
    where = f"{run.path} (migrate_every {run.migrate_every}, trace_every {run.trace_every})"
    k = _agree("--rows-per-interval", rows, k, where)
    if trace.num_intervals < k:
        raise SpecError(
            f"{trace.source}: {trace.num_intervals} rows, fewer than one of the run's {k}-row "
            f"intervals; replay a run of at least --migrate-every steps"
        )
    return k, _agree("--steps-per-interval", steps, run.migrate_every, where)


def replay_intervals(
    trace: Trace,
    run: RunRecord | None,
    plan: Plan | None,
    plan_path: str = "plan.json",
    ep: int | None = None,
    rows_per_interval: int | None = None,
    steps_per_interval: int | None = None,
    tokens_per_rank_step: int | None = None,
) -> ReplayIntervals:
    """Resolve the replay's settings (module docstring); None = the flag was not given.

    Without a run.json: rows per interval default 1; steps per interval default 100 when each
    row is an interval, else the rows (each row a step). With one, a trailing partial interval
    (a run whose --steps is not a multiple of --migrate-every) is left out, with a warning.
    """
    ranks = _resolve_ep(ep, run, plan, plan_path)
    if run is not None:
        rows, steps = _run_rows(run, trace, rows_per_interval, steps_per_interval)
    else:
        rows = 1 if rows_per_interval is None else rows_per_interval
        steps = steps_per_interval
        if steps is None:
            steps = DEFAULT_STEPS_PER_INTERVAL if rows == 1 else rows
    tokens = tokens_per_rank_step
    if plan is not None:
        per_step = plan_tokens_per_rank_step(plan)
        tokens = _agree("--tokens-per-step", tokens, per_step, f"{plan_path}'s tokens per rank")
    elif run is not None and run.tokens_per_rank_step is not None:
        where = f"the tokens per rank of the run, {run.path}"
        tokens = _agree("--tokens-per-step", tokens, run.tokens_per_rank_step, where)
    sources = [s for s, used in ((plan_path, plan), (run and run.path, run)) if used]
    used = trace.num_intervals
    if run is not None and used % rows:
        used -= used % rows
        log.warning(
            "%s: replaying the first %d of %d rows; the run's last interval is partial "
            "(--steps not a multiple of --migrate-every) and is left out",
            trace.source, used, trace.num_intervals,
        )  # fmt: skip
    source = " and ".join(sources) or "flags"
    return ReplayIntervals(ranks, rows, steps, tokens, source, used, _history_rows(run))


def _history_rows(run: RunRecord | None) -> int:
    """Trace rows per row of the run's policy history: `piper run` hands its policy
    migrate_rows_per_interval rows per interval (runtime.train.rows_per_interval: one per
    step up to 20 steps, coarser above), so the replay sums the trace's rows the same way."""
    if run is None or run.migrate_every == 0 or run.policy_rows is None:
        return 1
    steps = run.migrate_every // run.policy_rows
    if run.migrate_every % run.policy_rows or steps % run.trace_every:
        log.warning(
            "%s: the run's policy saw rows of %d / %d steps, which rows of %d steps do not "
            "make up; the replay's policies see the trace's rows",
            run.path, run.migrate_every, run.policy_rows, run.trace_every,
        )  # fmt: skip
        return 1
    return steps // run.trace_every
