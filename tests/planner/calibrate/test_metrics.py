"""metrics.jsonl reader: what a valid run writes loads; every fault is one SpecError line
naming the file, the line and the fix."""

from __future__ import annotations

import json
import math

import pytest

from planner.calibrate.metrics import REQUIRED_KEYS, load_metrics, parse_metrics
from planner.specs import SpecError


def _steps(n=3):
    return [{k: 1.0 for k in REQUIRED_KEYS} | {"step": i, "per_rank": []} for i in range(n)]


def _text(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_valid_steps_load_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_text(_steps()) + "\n")  # a trailing blank line is ignored
    rows = load_metrics(path)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["per_rank"] == []


@pytest.mark.parametrize(
    ("line", "change", "needle"),
    [
        (2, {"loss": None}, "line 2: loss must be a finite number, got None"),
        (1, {"loss": math.nan}, "line 1: loss must be a finite number, got nan"),
        (3, {"step": 5}, "line 3: step 5, expected 2"),
        (2, {"bytes_inter_node": -1}, "line 2: 'bytes_inter_node' must be a number >= 0"),
        (1, {"tokens_per_s": True}, "line 1: 'tokens_per_s' must be a number >= 0, got True"),
        (1, {"step_time_s": math.nan}, "'step_time_s' must be a number >= 0, got nan"),
    ],
)
def test_faults_are_one_line_naming_file_and_line(line, change, needle):
    rows = _steps()
    rows[line - 1].update(change)
    with pytest.raises(SpecError) as err:
        parse_metrics(_text(rows), "run/metrics.jsonl")
    message = str(err.value)
    assert needle in message and message.startswith("run/metrics.jsonl line")
    assert "piper run" in message and "\n" not in message


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_every_documented_key_is_required(key):
    rows = _steps(1)
    del rows[0][key]
    with pytest.raises(SpecError, match=f"line 1: missing '{key}'"):
        parse_metrics(_text(rows))


def test_undecodable_file_is_a_spec_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SpecError, match="not a text file"):
        load_metrics(path)
