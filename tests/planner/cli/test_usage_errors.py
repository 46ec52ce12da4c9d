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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["estimate", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--routing-skew", "nan"],
         "argument --routing-skew: nan is not a finite number"),
        (["plan", "--seed", str(2**70)], f"argument --seed: {2**70} is out of range"),
        (["plan", "--global-batch", str(2**70)], "argument --global-batch:"),
        (["a2a-sim", "--cluster", "h100", "--nodes", "2", "--bytes-per-rank", "1MiB",
          "--overhead-us", "inf"], "argument --overhead-us: inf is not a finite number"),
    ],
)  # fmt: skip
def test_non_finite_and_huge_numbers_are_refused_by_the_parser(argv, message, capsys):
    """Every number a flag takes: floats finite, integers within 32 bits (a 2**70 global batch
    made the divisor search hang, a 2**70 seed crashed the solver)."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["a2a-sim", "--cluster", "h100", "--nodes", "2", "--bytes-per-rank", "1e400"],
         "--bytes-per-rank '1e400': give less than 1 PiB per rank"),
        (["trace", "synth", "--seed", "-1", "--out", "t.csv"], "--seed -1: give a seed >= 0"),
        (["trace", "synth", "--layers", "10000", "--experts", "10000", "--out", "t.csv"],
         "exceeds 67,108,864"),
    ],
)  # fmt: skip
def test_out_of_range_values_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err and not (tmp_path / "t.csv").exists()


def test_migrate_time_limit_and_redundant_slots_are_bounded(capsys, tmp_path):
    trace = tmp_path / "t.csv"
    assert main(["trace", "synth", "--layers", "1", "--experts", "8", "--intervals", "2",
                 "--tokens", "64", "--topk", "2", "--out", str(trace)]) == 0  # fmt: skip
    capsys.readouterr()
    base = ["migrate", "--trace", str(trace), "--ep", "2", "--out", str(tmp_path / "m")]
    assert main([*base, "--time-limit-s", "-1"]) == 2
    assert "--time-limit-s must be > 0" in capsys.readouterr().err
    assert main([*base, "--redundant-slots", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--redundant-slots 100000: at most 8 for 8 experts on 2 ranks" in err
    assert not (tmp_path / "m").exists()
