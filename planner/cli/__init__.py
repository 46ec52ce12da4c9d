"""`piper` command line: parse arguments, call one API function per subcommand, write files.

Each subcommand lives in its own module under planner/cli/ and exposes
`register(subparsers)`, which adds its parser and sets `func` (args -> exit code).
User errors (SpecError, a ValueError subclass) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import sys
from collections.abc import Sequence

from planner.outputs.interrupts import hold_interrupts
from planner.specs import SpecError

# Subcommand modules, in the order `piper --help` lists them. A module that is not
# present yet is skipped, so the CLI works while the tree grows.
COMMANDS = (
    "plan",
    "estimate",
    "model_info",
    "migrate",
    "trace",
    "a2a_sim",
    "run",
    "prepare_data",
    "profile",
    "calibrate",
    "export",
    "place",
    "size",
    "cluster",
)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors (an unknown flag, a value of the wrong type, a missing
    argument) are one line and exit code 2, like every other bad input; subcommand parsers
    inherit the class. Abbreviated flags are refused (`--gpu` is not `--gpus`): a prefix that
    reads as a whole flag would bind to another one silently."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse, then every number given: floats finite, integers within
        [-MAX_INT_FLAG, MAX_INT_FLAG] (sizes, counts and seeds all fit; beyond, a divisor
        search or a solver's int32 seed would hang or fail)."""
        parsed, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None) if action.option_strings else None
            for item in value if isinstance(value, list | tuple) else (value,):
                if isinstance(item, bool) or not isinstance(item, int | float):
                    continue
                flag = action.option_strings[-1]
                if isinstance(item, float) and not math.isfinite(item):
                    self.error(f"argument {flag}: {item} is not a finite number")
                if isinstance(item, int) and abs(item) > MAX_INT_FLAG:
                    self.error(f"argument {flag}: {item} is out of range (at most {MAX_INT_FLAG})")
        return parsed, extras


MAX_INT_FLAG = 2**31 - 1


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `piper` parser. With `argv`, only the subcommand it names is imported and
    registered (importing every subcommand's dependencies costs a plan about a second of
    start-up); without one, or when argv names none or asks for the top-level help, all are."""
    parser = OneLineParser(prog="piper", description="Plan and run Mixture-of-Experts training.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    # dest "subcommand", not "command": a subcommand may have its own --command option.
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    named = _named_command(argv)
    for name in (named,) if named else COMMANDS:
        try:
            module = importlib.import_module(f"planner.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"planner.cli.{name}":
                continue
            raise
        module.register(sub)
    for command in sub.choices.values():  # `piper plan -v` as well as `piper -v plan`
        command.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
            help="log progress to stderr (each phase, the search's counts)",
        )  # fmt: skip
    return parser


def _named_command(argv: Sequence[str] | None) -> str | None:
    """The module of the subcommand argv names (its first word that is not an option), or
    None: no argv, a top-level option other than -v before it, or no such command."""
    for word in argv or ():
        if word in ("-v", "--verbose"):
            continue
        return {name.replace("_", "-"): name for name in COMMANDS}.get(word)
    return None


def _interrupted(exc: BaseException) -> bool:
    """Whether `exc` is a Ctrl-C or was caused by one: an extension module whose import a
    Ctrl-C cut short (ortools' CP-SAT) reports ImportError("initialization failed") with the
    KeyboardInterrupt as its cause."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(argv)  # imports the subcommand: a Ctrl-C may land here
    except (KeyboardInterrupt, ImportError) as exc:
        if not _interrupted(exc):
            raise
        print("piper: interrupted; no output was written", file=sys.stderr)
        return 130
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    name = args.subcommand
    hold_interrupts()  # a Ctrl-C swallowed by a finalizer stops the command before it writes
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a reader gone before the last line is handled here
        return code
    except SpecError as exc:
        print(f"piper {name}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout stopped early (`| head`): nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the exit's own flush would fail again
        return 0
    except OSError as exc:  # an input path that is a directory, unreadable, ...
        print(f"piper {name}: error: {_os_error_line(exc)}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, ImportError) as exc:
        if not _interrupted(exc):
            raise
        print(f"piper {name}: interrupted; no partial output was written", file=sys.stderr)
        return 130


def _os_error_line(exc: OSError) -> str:
    """One line for a file-system error: the path, what is wrong, and the fix."""
    path = exc.filename if exc.filename is not None else "input"
    if isinstance(exc, IsADirectoryError):
        return f"{path}: is a directory; pass the file inside it"
    if isinstance(exc, FileNotFoundError):
        return f"{path}: no such file or directory; check the path"
    if isinstance(exc, NotADirectoryError | FileExistsError):
        return f"{path}: is a file, not a directory; choose another path"
    if isinstance(exc, PermissionError):
        return f"{path}: permission denied; check the file's permissions"
    return f"{path}: {exc.strerror or exc}"


if __name__ == "__main__":
    sys.exit(main())
