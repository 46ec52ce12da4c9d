"""One wording for a JSON file that does not parse, wherever the CLI reads one.

`FILE: invalid JSON at line L column C: <what> (fix: ...)`. The decoder's own message ends in
"at" because it expects its position to follow ("Unterminated string starting at: line 1
column 2 (char 1)", json/decoder.py, `JSONDecodeError.__init__`); that tail is dropped and
the position given once, as line and column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.inputs.paths import read_text_file
from planner.specs import SpecError

_TAILS = (" starting at", " at")


def json_error_line(
    where: str, exc: json.JSONDecodeError, fix: str, line: int | None = None
) -> str:
    """The one-line report of `exc` for the file `where`; `line` overrides the decoder's line
    (a JSON Lines file parses one line at a time, so the decoder always says line 1)."""
    what = exc.msg
    for tail in _TAILS:
        what = what.removesuffix(tail)
    what = what[:1].lower() + what[1:]
    lineno = exc.lineno if line is None else line
    return f"{where}: invalid JSON at line {lineno} column {exc.colno}: {what} (fix: {fix})"


def load_json_file(path: str | Path, what: str, fix: str) -> Any:
    """The parsed JSON of a user's file; every fault is one SpecError line naming `path`: not
    found, not readable, not UTF-8, not JSON (with `fix`), or a number or nesting too large."""
    text = read_text_file(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(json_error_line(str(path), exc, fix)) from None
    except (ValueError, RecursionError):  # a number of > 4300 digits, nesting past the stack
        raise SpecError(f"{path}: a number or nesting too large to read; {fix}") from None


class DuplicateKey(ValueError):
    """A JSON object that gives one key twice (json keeps the last silently)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: the object as a dict, refusing a key given twice
    (DuplicateKey)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out
