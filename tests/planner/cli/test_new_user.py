"""`piper plan` as a new user meets it: progress in logs, abbreviated flags, layouts that
cannot run as given, output that fits a terminal."""

from __future__ import annotations

import io
import time

import pytest

from planner.cli import main
from planner.outputs.console import Phases
from tests.hardening_cli import run_piper_process

TINY = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "8", "--seq-len", "128",
        "--global-batch", "16", "--time-limit-s", "2"]  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--gpu", "8"],
        ["estimate", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--glob", "8"],
    ],
)
def test_an_abbreviated_flag_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.splitlines()) == 1
    assert f"unrecognized arguments: {argv[-2]}" in err


def test_plan_on_a_pipe_prints_one_line_per_phase(tmp_path):
    """stderr is a pipe (a log): each phase is a line, in order, with its start time."""
    done = run_piper_process([*TINY, "--out", str(tmp_path / "out")])
    assert done.code == 0, done.stderr
    lines = [line for line in done.err_lines if line.startswith("piper plan: ")]
    labels = [line.removeprefix("piper plan: ").split(" (at ")[0] for line in lines]
    assert labels[:2] == ["reading the model, cluster and inputs", "search: candidates solved"]
    assert "writing plan.json, tables and plots" in labels
    assert all(" (at " in line and line.endswith(" s)") for line in lines)


def test_plan_verbose_logs_the_search_counter(tmp_path):
    done = run_piper_process([*TINY[:1], "-v", *TINY[1:], "--out", str(tmp_path / "out")])
    assert done.code == 0, done.stderr
    counts = [line for line in done.err_lines if "planner.progress" in line]
    assert counts, done.stderr
    last = counts[-1].rsplit(": ", 1)[1]
    assert last.split("/")[0] == last.split("/")[1]  # the counter ends at its total


def test_a_long_phase_has_a_heartbeat():
    """A small heartbeat interval stands in for ~5 s: a phase running past it says so, with
    its counter; a phase shorter than it does not."""
    stream = io.StringIO()
    clock = Phases(None, stream, "piper plan", heartbeat_s=0.05)
    clock.start("search", "search")
    clock.update(3, 7)
    time.sleep(0.3)
    clock.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("piper plan: search (at ")
    beats = [line for line in lines if "still running" in line]
    assert beats and all(
        line.startswith("piper plan: search: still running, 3/7, ") for line in beats
    )
    quiet = io.StringIO()
    clock = Phases(None, quiet, "piper plan", heartbeat_s=60.0)
    clock.start("inputs", "inputs")
    clock.close()
    assert "still running" not in quiet.getvalue()
