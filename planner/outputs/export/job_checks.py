"""The Slurm job's first step: refuse a plan file or a sourced file made from another plan.

The job carries the stamp of the plan it was exported from (planner.outputs.export.stamp).
Before it lists hosts or places ranks it checks, each failure one line on stderr naming the
file and the `piper export` command that rewrites it, then exit 1:

- plan.json is there and its bytes hash to the stamp's sha256 (a re-plan or an edit since the
  export changes it: the job's rank table and the args would describe another plan);
- the Megatron or torchtitan args file it sources, and torchtitan's config module beside it,
  exist and carry the same stamp line among their first lines.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Sequence

from planner.outputs.export.stamp import HEAD_LINES, PlanStamp

# `sha256sum` is coreutils' (Linux); `shasum -a 256` is Perl's (macOS, for a dry run there)
_PLAN_CHECK = (
    'if [[ ! -f "$PLAN" ]]; then',
    '  echo "piper: $PLAN is missing: this job runs that plan; re-plan, then rewrite the job '
    'with: $JOB_EXPORT" >&2',
    "  exit 1",
    "fi",
    'if command -v sha256sum > /dev/null; then PLAN_SUM="$(sha256sum < "$PLAN")"; '
    'else PLAN_SUM="$(shasum -a 256 < "$PLAN")"; fi',
    'if [[ "${PLAN_SUM%% *}" != "$PLAN_SHA256" ]]; then',
    '  echo "piper: $PLAN is not the plan this job was written for (re-planned or edited '
    'since); rewrite the job with: $JOB_EXPORT" >&2',
    "  exit 1",
    "fi",
    "check_stamp() {  # FILE FIX: stop unless FILE was written for this very plan file",
    f'  if [[ "$(sed -n \'1,{HEAD_LINES}{{/^# piper-plan: /p;}}\' "$1")" != "$PLAN_STAMP" ]]; then',
    '    echo "piper: $1 was written for another plan than $PLAN (or another version of it); '
    'rewrite it with: $2" >&2',
    "    exit 1",
    "  fi",
    "}",
)


def plan_check_lines(stamp: PlanStamp, job_export: str) -> list[str]:
    """The plan's stamp as variables and the check of plan.json; `job_export` is the command
    that rewrites the job."""
    return [
        "# the plan this job was exported from (planner/outputs/export/stamp.py); the job",
        "# stops at once on another plan file or on a sourced file stamped for another plan",
        f"PLAN_SHA256={stamp.sha256}",
        f"PLAN_STAMP={shlex.quote(stamp.line)}",
        "# shellcheck disable=SC2016  # the command is text here ($ in --command stays as is)",
        f"JOB_EXPORT={shlex.quote(job_export)}",
        *_PLAN_CHECK,
    ]


def args_check_lines(
    args_file: str, export: str, modules: Sequence[str], stamp: PlanStamp | None
) -> list[str]:
    """Lines that stop the job when the args file (or a config module beside it) is missing or,
    with a stamp, made from another plan; `export` is the command that rewrites them."""
    fix = shlex.quote(export)
    lines = [
        f"ARGS_FILE={shlex.quote(args_file)}",
        'if [[ ! -f "$ARGS_FILE" ]]; then',
        f'  echo "piper: $ARGS_FILE is missing; write it with:" {fix} >&2; exit 1',
        "fi",
    ]
    if stamp is None:
        return lines
    lines.append(f'check_stamp "$ARGS_FILE" {fix}')
    folder = posixpath.dirname(args_file)
    for name in modules:  # torchtitan's config module; the args file checks it is there
        module = shlex.quote(posixpath.join(folder, name))
        lines.append(f"if [[ -f {module} ]]; then check_stamp {module} {fix}; fi")
    return lines
