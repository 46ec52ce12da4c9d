"""--time-limit-s is honoured by every IP and a solve stopped by it still returns its best
solution with a consistent bound and gap, on both backends (issue 9).

The instance: 64 experts with Zipf-skewed loads on 8 EP ranks, which neither backend proves
optimal within a fraction of a second on a CPU, so the time limit is what stops it.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from planner.ip.expert_ip import solve_experts
from planner.ip.solvers import SolverOptions
from tests.hardening_cli import run_piper

LIMIT_S = 0.3
# model building, presolve and a loaded CI machine. Without the limit both backends run this
# instance for 20 s and more, so the slack still tells an honoured limit from an ignored one.
SLACK_S = 5.0


def hard_loads(seed: int = 2, experts: int = 64) -> tuple[float, ...]:
    rng = np.random.default_rng(seed)
    loads = rng.zipf(1.5, experts).clip(1, 1000) * 100 + rng.integers(0, 99, experts)
    return tuple(float(x) for x in loads)


@pytest.mark.parametrize("backend", ["cpsat", "cbc"])
def test_time_limited_expert_ip_returns_its_best_placement_and_gap(backend):
    load_E = hard_loads()
    ep = 8
    start = time.perf_counter()
    sol = solve_experts(load_E, ep, SolverOptions(backend, LIMIT_S, 1, 0))
    wall_s = time.perf_counter() - start
    rep = sol.report
    assert wall_s <= LIMIT_S + SLACK_S, f"{backend} ran {wall_s:.2f} s on a {LIMIT_S} s limit"
    assert rep.status in ("OPTIMAL", "FEASIBLE"), rep  # never nothing
    # a real placement: E/ep experts on every rank, loads summed correctly
    assert [sol.rank_of_expert.count(r) for r in range(ep)] == [len(load_E) // ep] * ep
    rank_load = [0.0] * ep
    for e, r in enumerate(sol.rank_of_expert):
        rank_load[r] += load_E[e]
    assert max(rank_load) == pytest.approx(sol.max_rank_load, rel=1e-6)
    # the bound is a lower bound (no placement beats sum/ep) and the gap matches the pair
    assert sum(load_E) / ep <= sol.max_rank_load
    assert rep.bound <= rep.objective * (1 + 1e-9)
    assert 0.0 <= rep.gap < 1.0
    expected_gap = (rep.objective - rep.bound) / rep.objective
    assert rep.gap == pytest.approx(expected_gap, abs=1e-6)
    if rep.status == "OPTIMAL":
        assert rep.gap == pytest.approx(0.0, abs=1e-9)


def _write_inputs(tmp_path):
    model = {"model_type": "moe", "hidden_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_hidden_layers": 3, "first_k_dense_replace": 1,
             "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 64,
             "num_experts_per_tok": 4, "vocab_size": 1024}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(model))
    lines = ["interval,layer,expert,tokens"]
    for layer, seed in ((1, 2), (2, 3)):
        lines += [f"0,{layer},{e},{int(t)}" for e, t in enumerate(hard_loads(seed))]
    (tmp_path / "trace.csv").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("backend", ["cpsat", "cbc"])
def test_plan_with_a_time_limit_reports_every_ip(backend, tmp_path):
    _write_inputs(tmp_path)
    out = tmp_path / "out"
    args = ["plan", "--model", str(tmp_path / "config.json"), "--cluster", "cpu-gloo",
            "--gpus", "8", "--seq-len", "256", "--global-batch", "32", "--ep", "8",
            "--trace", str(tmp_path / "trace.csv"), "--solver", backend,
            "--time-limit-s", str(LIMIT_S), "--out", str(out)]  # fmt: skip
    result = run_piper(args)
    assert result.code == 0, result.stderr
    plan = json.loads((out / "plan.json").read_text())
    reports = {"stage": plan["solver"], "expert": plan["extra"]["expert_solver"]}
    for name, rep in reports.items():
        assert rep["status"] in ("OPTIMAL", "FEASIBLE"), (name, rep)
        assert 0.0 <= rep["gap"] < 1.0, (name, rep)
    assert reports["expert"]["backend"] == backend
    # two MoE layers with different loads: two expert IP solves, each within its limit
    timings = json.loads((out / "timings.json").read_text())
    assert timings["placement_s"] <= 2 * (LIMIT_S + SLACK_S)
