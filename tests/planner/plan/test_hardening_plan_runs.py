"""RUNS.csv (planner/calibrate/runs.py) refuses in one line naming the file and the column: an
unknown column (with the closest known name), a column given twice, a NaN or infinity in
either measured column, an id given twice (naming both lines), a control character."""

from __future__ import annotations

import pytest

from planner.calibrate.runs import TFLOPS, TOKENS, parse_runs
from tests.hardening_cli import run_piper
from tests.planner.calibrate.test_runs import GOOD, HEAD
from tests.planner.plan.test_hardening_plan import one_line_refusal


def refused(text: str, *words: str) -> str:
    return one_line_refusal(lambda: parse_runs(text, "mine.csv"), "mine.csv", *words)


def test_an_unknown_column_names_the_closest_known_one():
    head = HEAD.replace(TOKENS, TOKENS + "x")
    refused(head + GOOD, f"unknown column '{TOKENS}x'", f"did you mean '{TOKENS}'?")
    refused(HEAD.replace("note", "zzzz") + GOOD, "unknown column 'zzzz'", "published_runs.csv")
    refused(HEAD.replace("note", "gpus") + GOOD, "column 'gpus' is given twice")


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "abc"])
def test_the_measured_column_not_used_is_checked_too(value):
    (run,) = parse_runs(HEAD + GOOD)  # tokens/s given, TFLOPS empty: tokens/s is used
    assert run.metric == "tokens/s/GPU"
    row = GOOD.replace(",900,,", f",900,{value},")
    refused(HEAD + row, "line 2 (id 7)", f"column '{TFLOPS}'", repr(value))


def test_a_repeated_id_names_both_lines():
    other = GOOD.replace("selective(norm,act)", "full")
    refused(HEAD + GOOD + other, "line 3 (id 7)", "column 'id' repeats the id of line 2")


def test_control_characters_stay_escaped():
    head = HEAD.replace(",note", ",dispatcher,note")
    refused(head + GOOD.replace(",x\n", ',"deep\nep",x\n'), "column 'dispatcher'", r"'deep\nep'")
    refused(HEAD + '"7\n8"' + GOOD[1:], r"(id '7\n8')", "column 'id'")
    (run,) = parse_runs(HEAD + GOOD.replace(",x\n", ',"two\nlines"\n'))  # a note may
    assert run.field("note") == "two\nlines"


def test_through_the_cli(tmp_path):
    runs = tmp_path / "runs.csv"
    runs.write_text(HEAD.replace(TOKENS, TOKENS + "x") + GOOD)
    out = tmp_path / "fitted.yaml"
    result = run_piper(["calibrate", "--fit", str(runs), "--cluster", "h100", "--out", str(out)])
    assert result.code == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert f"{runs}: unknown column '{TOKENS}x'" in result.stderr
    assert not out.exists()
