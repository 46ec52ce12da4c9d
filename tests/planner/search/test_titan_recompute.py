"""torchtitan's per-op selective AC in the search and in `piper estimate`: searched beside
none and full, picked where no recompute does not fit and full recompute is slower, priced
when asked for, refused in one line where the engine does not run it."""

from __future__ import annotations

import json

from planner.cli import main
from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.ip.solvers import SolverOptions
from planner.search.make_plan import make_plan
from planner.specs import TrainingSpec
from planner.targets import TARGETS

OPTS = SolverOptions("cpsat", 10.0, 1, 0)
# Qwen3-30B-A3B on 16 H100s, ep 8, two sequences of 4096 per micro-batch: without recompute
# a rank needs ~91 GiB; op-SAC keeps ~73 GiB, full recompute ~43 GiB
FIXED = {"pp": 1, "tp": 1, "ep": 8, "micro_batch": 2, "cp": 1, "vp": 1, "etp": 1}


def _plan(recompute):
    model, cluster = load_model("qwen3-30b-a3b"), load_cluster("h100")
    training = TrainingSpec(global_batch=256, seq_len=4096)
    result = make_plan(model, cluster, training, 16, FIXED, OPTS,
                       target=TARGETS["torchtitan"], recompute=recompute)  # fmt: skip
    return result.plan


def test_the_search_picks_selective_where_none_does_not_fit_and_full_is_slower():
    """Of per-op SAC and the searched memory budgets, budget 0.1 keeps less and reruns only
    pointwise tensors on this layout (tests/planner/search/test_titan_budget_search.py)."""
    assert _plan(["none"]) is None  # no layout without recompute fits
    full, picked = _plan(["full"]), _plan(None)
    assert (picked.parallel.recompute, picked.parallel.recompute_modules) == (
        "selective", ("budget:0.1",),
    )  # fmt: skip
    assert max(picked.predicted.memory_gib_per_stage) <= 74.5
    assert picked.predicted.step_time_s < full.predicted.step_time_s
    assert all(s.recompute_layers == s.layers for s in picked.stages)  # every block wrapped


def _estimate(capsys, tmp_path, *extra):
    args = ["estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--nodes", "2",
            "--target", "torchtitan", "--dp", "16", "--ep", "8", "--global-batch", "256",
            "--out", str(tmp_path), *extra]  # fmt: skip
    return main(args), capsys.readouterr()


def test_estimate_prices_selective_for_torchtitan(capsys, tmp_path):
    gib = {}
    for policy in ("none", "selective", "full"):
        code, out = _estimate(capsys, tmp_path / policy, "--recompute", policy)
        assert code == 0, out.err
        data = json.loads((tmp_path / policy / "estimate.json").read_text())
        gib[policy] = data["stages"][0]["memory_gib"]["activations"]
        if policy == "selective":
            assert "recompute=selective(op)" in out.out
            assert data["parallel"]["recompute_modules"] == ["op"]
    assert gib["full"] < gib["selective"] < gib["none"]


def test_estimate_refuses_what_torchtitan_does_not_run(capsys, tmp_path):
    code, out = _estimate(capsys, tmp_path, "--recompute-modules", "core_attn")
    assert code == 2 and len(out.err.strip().splitlines()) == 1
    assert "reruns only op" in out.err and not (tmp_path / "estimate.json").exists()
    args = ["estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--nodes", "2",
            "--target", "megatron", "--dp", "16", "--ep", "8", "--recompute-modules", "op",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'op' is torchtitan's per-op selective AC" in err
