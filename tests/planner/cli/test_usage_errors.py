"""argparse's usage errors are one line and exit code 2, like every other bad input."""

from __future__ import annotations

import pytest

from planner.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--gpus", "nan"], "piper plan: error: argument --gpus: invalid int value: 'nan'"),
        (["estimate", "--model"], "argument --model: expected one argument"),
        (["trace", "synth", "--skew", "x", "--out", "t.csv"], "piper trace synth: error:"),
        (["bogus"], "piper: error: argument COMMAND: invalid choice: 'bogus'"),
        (["export", "plan.json"], "the following arguments are required: --to"),
    ],
)
def test_usage_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err and "--help'" in err
