"""`piper plan` accounts for its whole wall time: every phase in timings.json, back to back
from the process's start, the redundant-slot expert solve among them; the bar shows each."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress

from planner.cli import main
from planner.outputs.console import Phases

REPO = Path(__file__).resolve().parents[3]
COMMAND_PHASES = ("startup_s", "inputs_s", "search_s", "redundant_slots_s", "render_s")
SEARCH_PHASES = (
    "space_s", "enumerate_s", "screen_s", "stage_search_s", "baselines_s", "placement_s",
)  # fmt: skip


@pytest.fixture(scope="module")
def slots_run(tmp_path_factory):
    """64 equal experts on 8 EP ranks with 8 redundant slots: the case whose replica solve
    ran CP-SAT past its limit, outside every timer."""
    tmp = tmp_path_factory.mktemp("slots")
    config = json.loads((REPO / "profiles" / "models" / "tiny-moe.json").read_text())
    config.update(num_experts=64, num_experts_per_tok=4)
    (tmp / "config.json").write_text(json.dumps(config))
    argv = ["plan", "--model", str(tmp / "config.json"), "--cluster", "cpu-gloo", "--gpus", "8",
            "--ep", "8", "--seq-len", "128", "--global-batch", "16", "--redundant-slots", "8",
            "--time-limit-s", "2", "--out", str(tmp / "out")]  # fmt: skip
    assert main(argv) == 0
    return tmp / "out"


def test_timings_hold_every_phase_and_sum_to_the_total(slots_run, capsys):
    timings = json.loads((slots_run / "timings.json").read_text())
    assert set(COMMAND_PHASES + SEARCH_PHASES) <= set(timings)
    assert all(timings[k] >= 0 for k in COMMAND_PHASES + SEARCH_PHASES)
    assert timings["startup_s"] > 0  # the interpreter and the imports, from /proc
    assert timings["total_s"] == pytest.approx(sum(timings[k] for k in COMMAND_PHASES))
    search = sum(timings[k] for k in SEARCH_PHASES)
    assert search <= timings["search_s"] and search == pytest.approx(timings["search_s"], abs=0.05)


def test_equal_loads_with_redundant_slots_are_placed_at_the_mean(slots_run, capsys):
    plan = json.loads((slots_run / "plan.json").read_text())
    assert plan["extra"]["redundant_slots"]["redundant_slots"] == 8
    report = plan["extra"]["expert_solver"]
    assert report["status"] == "OPTIMAL" and report["gap"] == 0.0
    assert report["objective"] == report["bound"] == 8.0  # 64 experts / 8 ranks
    for layer in plan["experts"]:
        assert sorted(len(s) for s in layer["slots"]) == [9] * 8


def test_phases_run_back_to_back_and_label_the_bar():
    out = io.StringIO()
    with Progress(console=Console(file=out, force_terminal=True), transient=True) as bar:
        clock = Phases(bar)
        clock.start("inputs", "reading")
        clock.start("search", "search: candidates solved")
        clock.update(3, 7)
        task = bar.tasks[0]
        assert (task.description, task.completed, task.total) == ("search: candidates solved", 3, 7)
        clock.label("baselines")
        assert bar.tasks[0].description == "baselines" and bar.tasks[0].total is None
        times = clock.times()
    assert list(times) == ["startup", "inputs", "search"]
    assert all(t >= 0 for t in times.values())
    quiet = Phases(None)  # not a terminal: timed, nothing drawn
    quiet.start("inputs", "reading")
    assert set(quiet.times()) == {"startup", "inputs"}


def test_replica_solves_share_the_time_limit(slots_run, tmp_path, monkeypatch, capsys):
    """Three MoE layers with different loads: three replica solves of 3 s / 3 each, not 3 s
    each (24 such layers took 24 limits)."""
    from planner.search import assemble

    limits_s = []
    real = assemble.solve_experts

    def recording(load_E, ep, options, **kw):
        limits_s.append(options.time_limit_s)
        return real(load_E, ep, options, **kw)

    monkeypatch.setattr(assemble, "solve_experts", recording)
    rows = ["interval,layer,expert,tokens"]
    for layer in (1, 2, 3):
        rows += [f"0,{layer},{e},{100 + (e * layer) % 17}" for e in range(64)]
    (tmp_path / "trace.csv").write_text("\n".join(rows) + "\n")
    argv = ["plan", "--model", str(slots_run.parent / "config.json"), "--cluster", "cpu-gloo",
            "--gpus", "8", "--ep", "8", "--seq-len", "128", "--global-batch", "16",
            "--redundant-slots", "8", "--trace", str(tmp_path / "trace.csv"),
            "--time-limit-s", "3", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    assert limits_s == [1.0, 1.0, 1.0]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    report = plan["extra"]["expert_solver"]
    assert report["status"] in ("OPTIMAL", "FEASIBLE") and 0.0 <= report["gap"] < 1.0
    assert report["bound"] <= report["objective"]
