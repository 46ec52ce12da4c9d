"""`piper COMMAND ...` imports only that subcommand's module; help and errors list them all."""

from __future__ import annotations

import subprocess
import sys

from planner.cli import COMMANDS, build_parser

_PROBE = """
import sys
from planner.cli import build_parser
build_parser(sys.argv[1:])
print(" ".join(sorted(m for m in sys.modules if m.startswith("planner.cli."))))
"""


def _cli_modules(*argv: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return {m.removeprefix("planner.cli.") for m in out.stdout.split()}


def _choices(parser) -> list[str]:
    return list(parser._subparsers._group_actions[0].choices)  # noqa: SLF001


def test_a_named_command_imports_its_module_alone():
    got = _cli_modules("-v", "model-info", "--list")
    assert "model_info" in got
    assert not got & (set(COMMANDS) - {"model_info"})


def test_top_level_help_and_unknown_words_register_every_command():
    every = [c.replace("_", "-") for c in COMMANDS]
    for argv in ([], ["-h"], ["bogus"], ["model_info"], ["--verbose"]):
        assert _choices(build_parser(argv)) == every
    assert _choices(build_parser(None)) == every


def test_a_command_parses_the_same_alone_and_among_all():
    argv = ["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--pp", "4"]
    alone, among = (vars(p.parse_args(argv)) for p in (build_parser(argv), build_parser()))
    assert alone.pop("plan_parser").format_help() == among.pop("plan_parser").format_help()
    assert alone == among
