"""A Slurm job's node list: hostlist expressions expanded as `scontrol show hostnames` does.

Syntax (Slurm's hostlist functions, `slurm_hostlist_create(3)`, and the Slurm::Hostlist
manual; checked against `scontrol show hostnames` of slurm-client 22.05.8 in
tests/planner/inputs/test_hostlist.py): hosts are separated by ',' or whitespace; a bracketed
hostlist is a common prefix followed by numeric ranges in brackets, `tux[0-5,12,20-25]`. A
range keeps the width of its first number (`frontier[00012-00016]` -> frontier00012 ...
frontier00016; `n[8-10]` -> n8 n9 n10; `n[01-3]` -> n01 n02 n03) and holds at most 65,536
hosts (Slurm's MAX_RANGE); a name with several bracket groups expands left to right, the
first group varying slowest (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2); text after the last ']'
is refused, as Slurm refuses it. Hosts keep the order written, duplicates included. A range
number has at most 18 digits, and the hosts of a list are counted before any is built: more
than MAX_HOSTS, or a name longer than 253 characters, is refused without expanding.

`load_nodelist(text_or_path)` also accepts a file with one host (or expression) per line;
'#' starts a comment. A malformed expression, a character a hostname cannot hold (anything
but letters, digits, '-', '_' and '.'), a host listed twice or an empty list is a SpecError.
"""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path

from planner.inputs.safe_read import read_input_bytes
from planner.inputs.shown import shown
from planner.specs import SpecError

MAX_HOSTS = 1 << 20  # far above any machine; stops `n[0-999999999]` from filling memory
MAX_RANGE = 1 << 16  # hosts in one range, as Slurm's hostlist.c allows
MAX_DIGITS = 18  # a range number fits an int64; no node is numbered past it
MAX_NAME = 253  # a DNS name
HOSTNAME = re.compile(r"[A-Za-z0-9_.-]{1,253}\Z")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?\Z")
_Range = tuple[int, int, int]  # first, last, width of the first number


def expand_hostlist(expression: str, where: str = "--nodelist", before: int = 0) -> tuple[str, ...]:
    """The hosts of a Slurm hostlist expression, in order (duplicates kept, as Slurm does).
    `before`: hosts already read from other lines of the same list, counted against MAX_HOSTS."""
    hosts: list[str] = []
    for item in _split_items(expression, where):
        hosts += _expand_item(item, where, MAX_HOSTS - before - len(hosts))
    for host in hosts:
        if not HOSTNAME.match(host):
            raise SpecError(
                f"{where}: {_shown(host)} is not a hostname (letters, digits, '-', '_', '.'); "
                "fix the node list"
            )
    return tuple(hosts)


def load_nodelist(value: str) -> tuple[str, ...]:
    """Hosts from a hostlist expression, or from a file of one host (or expression) a line.

    Raises SpecError for a malformed list, a host listed twice, or no hosts at all.
    """
    path = Path(value)
    if "[" not in value and "," not in value and path.is_file():
        try:
            text = read_input_bytes(path, "node list").decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(f"{value}: not a text file; pass one host per line") from None
        lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        hosts = []
        for i, line in enumerate(lines):
            if line:
                hosts += expand_hostlist(line, f"{value}: line {i + 1}", len(hosts))
        where = value
    else:
        hosts, where = list(expand_hostlist(value)), "--nodelist"
    if not hosts:
        raise SpecError(f"{where}: no hosts; pass a Slurm hostlist such as node[01-04]")
    seen: set[str] = set()
    for host in hosts:
        if host in seen:
            raise SpecError(f"{where}: host {shown(host)} is listed twice; list each node once")
        seen.add(host)
    return tuple(hosts)


def _split_items(expression: str, where: str) -> list[str]:
    """Split at ',' and whitespace outside brackets; refuse unbalanced or nested brackets."""
    items, current, depth = [], [], 0
    for ch in expression:
        if ch == "[":
            if depth:
                raise SpecError(
                    f"{where}: nested '[' in {_shown(expression)}; close each range first"
                )
            depth = 1
        elif ch == "]":
            if not depth:
                raise SpecError(
                    f"{where}: ']' without '[' in {_shown(expression)}; fix the brackets"
                )
            depth = 0
        if depth == 0 and (ch == "," or ch.isspace()):
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise SpecError(f"{where}: '[' without ']' in {_shown(expression)}; close the range")
    items.append("".join(current))
    return [item for item in items if item]


def _shown(text: str) -> str:
    """`text` quoted for a message, cut to 60 characters."""
    return repr(text) if len(text) <= 60 else repr(text[:57] + "...")


def _expand_item(item: str, where: str, room: int) -> list[str]:
    """One name with zero or more bracket groups -> its hosts; SpecError, before any host is
    built, when they number more than `room` or a name would exceed MAX_NAME characters."""
    parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
    if len(parts) > 1 and parts[-1]:
        raise SpecError(
            f"{where}: text {_shown(parts[-1])} after ']' in {_shown(item)}; Slurm's hostlists "
            "end with a range, so list such hosts one by one"
        )
    groups = [_parse_ranges(part, item, where) for part in parts[1::2]]
    count, longest = 1, sum(len(text) for text in parts[::2])
    for ranges in groups:
        count *= sum(last - first + 1 for first, last, _ in ranges)
        longest += max(max(width, len(str(last))) for _, last, width in ranges)
        if count > room:
            raise SpecError(
                f"{where}: expands to more than {MAX_HOSTS} hosts ({_shown(item)}); check the "
                "ranges"
            )
    if longest > MAX_NAME:
        raise SpecError(
            f"{where}: {_shown(item)} makes names of up to {longest} characters, more than a "
            f"hostname's {MAX_NAME}; fix the node list"
        )
    choices = [[text] for text in parts[::2]]
    for i, ranges in enumerate(groups):
        choices.insert(2 * i + 1, _numbers(ranges))
    return ["".join(combo) for combo in product(*choices)]


def _parse_ranges(ranges: str, item: str, where: str) -> list[_Range]:
    """'0-5,12' -> [(0, 5, 1), (12, 12, 2)]: each range's bounds and the width it pads to."""
    out: list[_Range] = []
    for piece in ranges.split(","):
        m = _RANGE.match(piece.strip())
        if not m:
            raise SpecError(
                f"{where}: {_shown(piece)} in {_shown(item)} is not a number or range like "
                "01-04; fix the node list"
            )
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        if max(len(lo_text), len(hi_text)) > MAX_DIGITS:
            raise SpecError(
                f"{where}: range {_shown(piece)} in {_shown(item)} has a number of more than "
                f"{MAX_DIGITS} digits; no node is numbered that high: fix the node list"
            )
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise SpecError(
                f"{where}: range {_shown(piece)} in {_shown(item)} runs backwards; write lo-hi"
            )
        if hi - lo + 1 > MAX_RANGE:
            raise SpecError(f"{where}: range {_shown(piece)} holds more than {MAX_RANGE} hosts")
        out.append((lo, hi, len(lo_text)))
    return out


def _numbers(ranges: list[_Range]) -> list[str]:
    """The numbers of parsed ranges as text, zero-padded to each range's first number's width."""
    return [str(n).zfill(width) for lo, hi, width in ranges for n in range(lo, hi + 1)]
