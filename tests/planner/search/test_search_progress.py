"""The search reports a determinate count: one total, every candidate the search enumerated,
fixed from the first call; the count only grows and ends at the total. With -v each solved
candidate is one log line."""

from __future__ import annotations

import logging

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.ip.solvers import SolverOptions
from planner.search.make_plan import make_plan
from planner.specs import TrainingSpec
from planner.targets import get_target


def test_the_counter_has_one_total_and_ends_there(caplog):
    calls: list[tuple[int, int | None]] = []
    with caplog.at_level(logging.INFO, logger="planner.search.branch_bound"):
        result = make_plan(load_model("mixtral-8x7b"), load_cluster("frontier"),
                           TrainingSpec(seq_len=4096, global_batch=1024), 64, {},
                           SolverOptions("cpsat", 10, 1, 0), target=get_target("megatron"),
                           progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    totals = {t for _, t in calls}
    assert len(totals) == 1 and None not in totals
    total = totals.pop()
    assert total == len(result.rows)  # every enumerated candidate is a row of candidates.csv
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == total and len(calls) >= 3
    solved = [r for r in result.rows if r.status == "solved"]
    logged = [m for m in caplog.messages if m.startswith("candidate pp=")]
    assert len(logged) >= len(solved) > 0
