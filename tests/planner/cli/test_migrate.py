"""`piper migrate` end to end: outputs, --plan, replication rows, determinism."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from planner.cli import main
from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model, model_config
from planner.plan import (
    ClusterEntry,
    ExpertPlacement,
    ModelEntry,
    ParallelPlan,
    Plan,
    Predicted,
    RankPlan,
    SolveReport,
    StagePlan,
)
from tests.planner.migration.conftest import write_csv

E, LAYERS, INTERVALS = 8, (1, 2, 3), 5


def _trace(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for t in range(INTERVALS):
        for layer in LAYERS:
            tokens = rng.multinomial(2000, np.array([8, 4, 2, 1, 1, 1, 1, 1]) / 19)
            rows += [(t, layer, e, int(n)) for e, n in enumerate(tokens)]
    return write_csv(tmp_path / "trace.csv", rows)


def _read(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def _plan(tmp_path):
    ranks = tuple(RankPlan(i, i // 2, i % 2, 0, i, 0, i) for i in range(4))
    plan = Plan(
        model=ModelEntry("tiny-moe", config=model_config(load_model("tiny-moe"))),
        cluster=ClusterEntry("cpu-gloo", "cpu-gloo"),
        training={"seq_len": 128, "global_batch": 8},
        parallel=ParallelPlan(1, 4, 1, 4, 1, 1, 2, "none"),
        stages=(StagePlan(0, (0, 1, 2, 3)),),
        experts=tuple(ExpertPlacement(layer, (3, 3, 2, 2, 1, 1, 0, 0)) for layer in LAYERS),
        ranks=ranks,
        predicted=Predicted(1.0, 0.5, 1.0, 1.0, 0.0, (1.0,), 4.0),
        solver=SolveReport("none", "OPTIMAL", 0.0, 0.0, 0.0),
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return str(path)


def test_outputs_and_their_consistency(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["migrate", "--trace", _trace(tmp_path), "--ep", "4", "--out", str(out)]
    assert main([*args, "--model", "tiny-moe", "--cluster", "cpu-gloo", "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "Piper" in printed and "greedy swap" in printed and "solver ms" in printed
    placements = _read(out / "placements.csv")
    assert len(placements) == INTERVALS * len(LAYERS) * E
    first = [int(r["rank"]) for r in placements if r["interval"] == "0" and r["layer"] == "1"]
    assert first == [e // 2 for e in range(E)]  # expert e starts on rank e // (E / R)
    summary = {row["policy"]: row for row in json.loads((out / "summary.json").read_text())}
    moves = _read(out / "migrations.csv")
    assert len(moves) == summary["piper"]["experts_moved"]
    assert sum(int(m["bytes"]) for m in moves) == summary["piper"]["bytes_moved"]
    assert set(summary) == {"none", "swap", "repack", "piper"}
    assert "timings.json" in {p.name for p in out.iterdir()}
    assert "ms" not in (out / "summary.md").read_text().split("|---")[1]


def test_plan_gives_start_placement_and_rank_devices(tmp_path):
    out = tmp_path / "out"
    args = ["migrate", "--trace", _trace(tmp_path), "--ep", "4", "--plan", _plan(tmp_path)]
    assert main([*args, "--out", str(out), "--no-plots", "--policy", "repack"]) == 0
    first = [int(r["rank"]) for r in _read(out / "placements.csv") if r["interval"] == "0"]
    assert first[:E] == [3, 3, 2, 2, 1, 1, 0, 0]
    # cpu-gloo: 2 ranks per node; the plan puts EP rank i on node i // 2
    node, system = load_cluster("cpu-gloo").levels[:2]
    moves = _read(out / "migrations.csv")
    assert {int(m["src_rank"]) // 2 == int(m["dst_rank"]) // 2 for m in moves} == {True, False}
    for m in moves:
        level = node if int(m["src_rank"]) // 2 == int(m["dst_rank"]) // 2 else system
        expected = int(m["bytes"]) / (level.bw_gbps * 1e9) + level.latency_us * 1e-6
        assert float(m["seconds"]) == pytest.approx(expected, rel=1e-6)


def test_plan_with_other_ep_is_rejected(tmp_path, capsys):
    args = ["migrate", "--trace", _trace(tmp_path), "--ep", "2", "--plan", _plan(tmp_path)]
    assert main([*args, "--out", str(tmp_path / "o")]) == 2
    assert "--ep 4" in capsys.readouterr().err


def test_redundant_slots_write_replica_rows(tmp_path):
    out = tmp_path / "out"
    args = ["migrate", "--trace", _trace(tmp_path), "--ep", "4", "--redundant-slots", "1"]
    assert main([*args, "--model", "tiny-moe", "--out", str(out), "--no-plots"]) == 0
    rows = _read(out / "placements.csv")
    last = [r for r in rows if r["interval"] == str(INTERVALS - 1) and r["layer"] == "1"]
    experts = [r["expert"] for r in last]
    assert len(experts) > E and "0" in [e for e in experts if experts.count(e) > 1]
    pairs = [(r["expert"], r["rank"]) for r in last]
    assert len(pairs) == len(set(pairs))


def test_model_must_match_the_trace(tmp_path, capsys):
    args = ["migrate", "--trace", _trace(tmp_path), "--ep", "4", "--model", "deepseek-v3"]
    assert main([*args, "--out", str(tmp_path / "o")]) == 2
    assert "256 routed experts but the trace has 8" in capsys.readouterr().err


def test_two_runs_are_byte_identical(tmp_path):
    trace = _trace(tmp_path)
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert main(["migrate", "--trace", trace, "--ep", "2", "--out", str(out)]) == 0
        outs.append({p.name: p.read_bytes() for p in out.iterdir() if p.name != "timings.json"})
    assert outs[0] == outs[1] and "imbalance.png" in outs[0]


def test_plan_from_piper_plan_with_ep_folded_over_tp(tmp_path):
    """A real `piper plan` output (tp=2, ep=8 folded over dp*tp) prices moves on its cluster."""
    plan_dir = tmp_path / "plan"
    sizes = ["--gpus", "8", "--pp", "1", "--tp", "2", "--ep", "8"]
    shape = ["--seq-len", "128", "--global-batch", "16"]
    args = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", *sizes, *shape]
    assert main([*args, "--out", str(plan_dir)]) == 0
    plan = json.loads((plan_dir / "plan.json").read_text())
    out = tmp_path / "out"
    args = ["migrate", "--trace", _trace(tmp_path), "--ep", "8"]
    args += ["--plan", str(plan_dir / "plan.json"), "--policy", "repack"]
    assert main([*args, "--out", str(out), "--no-plots"]) == 0
    start = {p["layer"]: p["rank_of_expert"] for p in plan["experts"]}
    for layer, ranks in start.items():
        rows = [r for r in _read(out / "placements.csv") if r["interval"] == "0"]
        got = [int(r["rank"]) for r in rows if int(r["layer"]) == layer]
        assert got == ranks


def test_plan_with_redundant_slots_starts_from_its_slots(tmp_path, capsys):
    """piper plan --redundant-slots 4 (tiny-moe, ep 4): every experts entry lists 4 ranks'
    slots holding 12 slots for 8 experts; piper migrate --plan starts from exactly them and
    refuses another --redundant-slots."""
    plan_dir = tmp_path / "plan"
    sizes = ["--gpus", "4", "--pp", "1", "--tp", "1", "--ep", "4", "--redundant-slots", "4"]
    args = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", *sizes]
    assert main([*args, "--seq-len", "128", "--global-batch", "16", "--out", str(plan_dir)]) == 0
    plan = json.loads((plan_dir / "plan.json").read_text())
    assert plan["extra"]["redundant_slots"]["redundant_slots"] == 4
    slots = {p["layer"]: p["slots"] for p in plan["experts"]}
    assert all(sum(len(row) for row in rows) == E + 4 for rows in slots.values())
    out = tmp_path / "out"
    args = ["migrate", "--trace", _trace(tmp_path), "--ep", "4", "--plan"]
    args += [str(plan_dir / "plan.json"), "--no-plots", "--out", str(out)]
    assert main(args) == 0
    first = [r for r in _read(out / "placements.csv") if r["interval"] == "0"]
    for layer, rows in slots.items():
        got = {(int(r["expert"]), int(r["rank"])) for r in first if int(r["layer"]) == layer}
        assert got == {(e, rank) for rank, row in enumerate(rows) for e in row}
    assert main([*args[:-1], str(tmp_path / "o2"), "--redundant-slots", "2"]) == 2
    assert "the plan gives layer" in capsys.readouterr().err
