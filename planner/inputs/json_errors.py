"""One wording for a JSON file that does not parse, wherever the CLI reads one.

`FILE: invalid JSON at line L column C: <what> (fix: ...)`. The decoder's own message ends in
"at" because it expects its position to follow ("Unterminated string starting at: line 1
column 2 (char 1)", json/decoder.py, `JSONDecodeError.__init__`); that tail is dropped and
the position given once, as line and column.
"""

from __future__ import annotations

import json

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
