"""A Ctrl-C that lands while `piper` imports a subcommand or an extension module (ortools'
CP-SAT reports the cut-short import as ImportError("initialization failed") caused by the
KeyboardInterrupt) stops the command with one line and exit 130, never a traceback."""

from __future__ import annotations

import pytest

import planner.cli as cli


def _import_cut_short() -> ImportError:
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as ctrl_c:
            raise ImportError("initialization failed") from ctrl_c
    except ImportError as exc:
        return exc


def test_an_import_cut_short_by_ctrl_c_counts_as_interrupted():
    assert cli._interrupted(_import_cut_short())
    assert cli._interrupted(KeyboardInterrupt())
    assert not cli._interrupted(ImportError("No module named 'x'"))


def test_ctrl_c_while_the_subcommand_imports_exits_130(monkeypatch, capsys):
    def build_parser(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", build_parser)
    assert cli.main(["plan"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "piper: interrupted; no output was written"


def test_ctrl_c_inside_a_lazy_import_of_the_command_exits_130(monkeypatch, capsys):
    def func(args):
        raise _import_cut_short()

    parser = cli.build_parser(["model-info"])
    args = parser.parse_args(["model-info", "tiny-moe"])
    args.func = func
    monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", lambda self, argv: args)
    assert cli.main(["model-info", "tiny-moe"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_an_import_error_of_its_own_is_not_swallowed(monkeypatch):
    def build_parser(argv):
        raise ImportError("No module named 'ortools'")

    monkeypatch.setattr(cli, "build_parser", build_parser)
    with pytest.raises(ImportError):
        cli.main(["plan"])
