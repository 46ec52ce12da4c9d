"""Trace CSV: round trip, and every fault rejected with one line naming file and row."""

from __future__ import annotations

import numpy as np
import pytest

from planner.cli import main
from planner.migration.trace import (
    check_divisible,
    load_trace,
    trace_from_text,
    trace_rows,
    trace_to_csv,
)
from planner.specs import SpecError
from tests.planner.migration.conftest import make_trace, write_csv


def _rows(intervals=2, layers=(3, 5), experts=4):
    return [
        (t, la, e, 10 * t + e) for t in range(intervals) for la in layers for e in range(experts)
    ]


def test_round_trip_keeps_every_count(tmp_path):
    path = write_csv(tmp_path / "t.csv", _rows())
    trace = load_trace(path)
    assert trace.tokens_ILE.shape == (2, 2, 4)
    assert trace.layer_ids == (3, 5)
    assert trace.tokens_ILE[1, 1, 3] == 13
    again = tmp_path / "again.csv"
    again.write_text(trace_to_csv(trace))
    assert np.array_equal(load_trace(again).tokens_ILE, trace.tokens_ILE)


def test_column_order_and_extra_columns_are_accepted(tmp_path):
    rows = [(tok, e, "x", t, la) for t, la, e, tok in _rows()]
    path = write_csv(tmp_path / "t.csv", rows, header="tokens,expert,note,interval,layer")
    assert load_trace(path).tokens_ILE[1, 0, 2] == 12


@pytest.mark.parametrize(
    ("rows", "header", "needle"),
    [
        (_rows(), "interval,layer,tokens", "missing column(s) expert"),
        ([(0, 3, 0, -1), *_rows()[1:]], None, "row 2: column 'tokens' is negative"),
        ([(0, 3, 0, "2.5"), *_rows()[1:]], None, "row 2: column 'tokens' must be a non-negative"),
        ([r for r in _rows(intervals=3) if r[0] != 1], None, "interval 1 is missing"),
        (_rows()[:-1], None, "no row for interval 1, layer 5, expert 3"),
        ([r for r in _rows() if r[2] != 2], None, "expert 2 never appears"),
        ([*_rows(), _rows()[0]], None, "appears more than once"),
        ([], None, "no data rows"),
    ],
)
def test_bad_traces_are_one_line_spec_errors(tmp_path, rows, header, needle):
    if header is not None:
        rows = [r[:2] + r[3:] for r in rows]
    path = write_csv(tmp_path / "bad.csv", rows, header=header or "interval,layer,expert,tokens")
    with pytest.raises(SpecError) as err:
        load_trace(path)
    assert needle in str(err.value)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_experts_must_divide_over_ranks():
    trace = make_trace(np.ones((1, 1, 6)))
    check_divisible(trace, 3)
    with pytest.raises(SpecError, match="6 experts do not divide over --ep 4 ranks"):
        check_divisible(trace, 4)


@pytest.mark.parametrize("command", [["trace", "check"], ["migrate", "--ep", "2", "--trace"]])
def test_cli_exits_2_with_one_line(tmp_path, capsys, command):
    path = write_csv(tmp_path / "bad.csv", [(0, 0, 0, 5), (0, 0, 1, -5)])
    code = main([*command, path, *(["--out", str(tmp_path / "o")] if "migrate" in command else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "row 3" in err[0] and "negative" in err[0]
    assert not (tmp_path / "o").exists()


def test_cli_rejects_experts_not_divisible(tmp_path, capsys):
    path = write_csv(tmp_path / "t.csv", [(0, 0, e, 5) for e in range(6)])
    assert main(["migrate", "--trace", path, "--ep", "4", "--out", str(tmp_path / "o")]) == 2
    assert "--ep" in capsys.readouterr().err


def test_text_variant_names_its_source_and_rows_come_back_sorted():
    rows = _rows()
    text = "interval,layer,expert,tokens\n" + "".join(
        ",".join(map(str, r)) + "\n" for r in reversed(rows)
    )
    assert trace_rows(trace_from_text(text)) == sorted(rows)
    with pytest.raises(SpecError) as err:
        trace_from_text(text + "0,3,0,1\n", "run/trace.csv")
    assert str(err.value).startswith("run/trace.csv: interval 0, layer 3, expert 0")
    assert "duplicate" in str(err.value)


def test_gzip_traces_read_like_plain_ones_and_a_bad_one_is_one_line(tmp_path):
    import gzip

    path = write_csv(tmp_path / "t.csv", _rows())
    packed = tmp_path / "t.csv.gz"
    packed.write_bytes(gzip.compress((tmp_path / "t.csv").read_bytes()))
    assert np.array_equal(load_trace(packed).tokens_ILE, load_trace(path).tokens_ILE)
    fake = tmp_path / "fake.csv.gz"
    fake.write_text("interval,layer,expert,tokens\n")
    with pytest.raises(SpecError, match="not a gzip file"):
        load_trace(fake)


def test_cli_replays_steps_by_rows_per_interval(tmp_path, capsys):
    rows = [(t, 0, e, 10 + (t % 3) * e) for t in range(12) for e in range(8)]
    path = write_csv(tmp_path / "steps.csv", rows)
    out = tmp_path / "o"
    assert main(["migrate", "--trace", path, "--ep", "2", "--rows-per-interval", "3",
                 "--out", str(out), "--no-plots"]) == 0  # fmt: skip
    assert "4 intervals" in capsys.readouterr().out
    placements = (out / "placements.csv").read_text().splitlines()
    assert len(placements) == 1 + 4 * 8  # header + 4 intervals x 8 experts
    for bad in ("5", "0"):
        code = main(["migrate", "--trace", path, "--ep", "2", "--rows-per-interval", bad,
                     "--out", str(tmp_path / "bad")])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "--rows-per-interval" in err[0]
        assert not (tmp_path / "bad").exists()
