"""metrics.jsonl and trace.csv as written here and read back by the planner's readers,
aggregation, and the byte accounting rules."""

from __future__ import annotations

import json

import pytest

from planner.calibrate.metrics import parse_metrics
from planner.migration.trace import trace_from_text, trace_rows
from planner.specs import SpecError
from runtime.dispatch.base import DispatchStats
from runtime.metrics import ByteCounter, rank_record, step_line, trace_csv


def test_ring_allreduce_bytes_split_by_successor_node():
    nodes = [0, 0, 1, 1]
    c = ByteCounter(nodes, me=1)
    c.add_allreduce("grad", 1000, [1, 3])  # 2 ranks: 2*(n-1)/n * 1000 = 1000 to rank 3
    assert c.inter == {"grad": 1000} and c.intra == {}
    c0 = ByteCounter(nodes, me=0)
    c0.add_allreduce("grad", 1200, [0, 1, 2, 3])  # successor of 0 is 1 (same node)
    assert c0.intra == {"grad": 1800}
    c0.add_allreduce("grad", 1200, [0])  # a group of one sends nothing
    assert c0.intra == {"grad": 1800}


def _record(step, rank, loss, t, intra, inter):
    stats = DispatchStats(
        bytes_intra_node=intra, bytes_inter_node=inter, dispatch_s=0.1, combine_s=0.2 * (rank + 1)
    )
    c = ByteCounter([0, 1], me=rank)
    c.add("p2p", 64, 1 - rank)
    return rank_record(step, rank, rank, loss, t, 1000 + rank, stats, c)


def test_step_line_aggregates_ranks():
    recs = [_record(0, 0, None, 0.5, 10, 20), _record(0, 1, 4.0, 0.25, 30, 40)]
    line = step_line(recs, tokens_per_step=1000, migrated=3)
    assert line["loss"] == 4.0 and line["step_time_s"] == 0.5
    assert line["tokens_per_s"] == 2000.0
    assert line["bytes_intra_node"] == 40 and line["bytes_inter_node"] == 60 + 128
    assert line["combine_s"] == pytest.approx(0.4) and line["peak_memory_bytes"] == 1001
    assert line["migrated_experts"] == 3 and len(line["per_rank"]) == 2
    text = json.dumps(line) + "\n"
    assert parse_metrics(text)[0]["loss"] == 4.0


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"loss": None}, "finite"),
        ({"step": 3}, "expected 0"),
        ({"bytes_inter_node": -1}, ">= 0"),
    ],
)
def test_the_planners_reader_rejects(bad, msg):
    good = step_line([_record(0, 1, 4.0, 0.25, 1, 2)], 10)
    good.update(bad)
    with pytest.raises(SpecError, match=msg):
        parse_metrics(json.dumps(good))
    del good["dispatch_s"]
    with pytest.raises(SpecError, match="dispatch_s"):
        parse_metrics(json.dumps({**good, **{"loss": 1.0, "step": 0}}))


def test_trace_round_trip_and_errors():
    rows = [(1, 3, 0, 5), (0, 3, 1, 7), (0, 3, 0, 2), (1, 3, 1, 0)]
    text = trace_csv(rows)
    assert text.splitlines()[0] == "interval,layer,expert,tokens"
    assert trace_rows(trace_from_text(text)) == sorted(rows)
    for bad, msg in [
        ("a,b\n", "header"),
        (text + "0,3,0,1\n", "duplicate"),
        (text + "0,3,x,1\n", "'expert' must be a non-negative integer"),
    ]:
        with pytest.raises(SpecError, match=msg):
            trace_from_text(bad)
