"""What an export may write into a shell file: checked names, quoted values, inert comments.

Plans are files people pass around, so every string a plan carries into a bash file is either
checked against what the shell accepts (environment variable names) and refused
with one line, or quoted with shlex.quote (values, paths, flags), or written only inside a
comment that it cannot end (`comment`). The free-text fields of a plan that reach comments
(`model.name`, `model.source`, `cluster.name`) must not hold control characters: a newline
there would end the comment and run the rest of the line.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

from planner.plan.env_names import env_name
from planner.plan.schema import Plan
from planner.specs import SpecError

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def export_lines(env: Mapping[str, str], where: str) -> list[str]:
    """`export NAME='value'` lines, names checked, values quoted, in name order."""
    lines = []
    for name in sorted(env):
        value = env[name]
        key = env_name(name, where)
        if "\x00" in value:
            raise SpecError(f"{where}.{key}: the value holds a NUL byte; remove it")
        lines.append(f"export {key}={shlex.quote(value)}")
    return lines


def comment(text: str) -> str:
    """A '# ' comment line of `text`: control characters (a newline would end the comment)
    become spaces."""
    return "# " + _CONTROL.sub(" ", text)


def check_plan_text(plan: Plan) -> None:
    """Refuse a plan whose names that reach comments hold control characters."""
    for where, text in (
        ("model.name", plan.model.name),
        ("model.source", plan.model.source),
        ("cluster.name", plan.cluster.name),
    ):
        if _CONTROL.search(text):
            raise SpecError(
                f"plan.json: {where} {text!r} holds a control character (a newline would end "
                "a comment in the exported script); remove it"
            )
