"""torchtitan's memory-budget AC through `piper estimate` and `piper plan`: priced between
per-op SAC and no recompute, searched beside per-op SAC and full, refused by other targets.

DeepSeek-V3 on 1024 H100s, pp=1 dp=256 tp=4 ep=256, 2 x 2 micro-batches of 4096: no
recompute needs 82 GiB of 74.5; budget 0.1 keeps the GEMM outputs and reruns only the
pointwise tensors, so it fits and runs as fast as no recompute, faster than per-op SAC."""

from __future__ import annotations

import json

import pytest

from tests.hardening_cli import run_piper

LAYOUT = ["--model", "deepseek-v3", "--cluster", "h100", "--pp", "1", "--dp", "256",
          "--tp", "4", "--ep", "256", "--micro-batch", "2", "--num-microbatches", "2"]  # fmt: skip


def _estimate(*extra: str) -> dict:
    out = run_piper(["estimate", *LAYOUT, "--target", "torchtitan", "--json", *extra])
    assert out.code == 0, out.stderr
    return json.loads(out.stdout)


def test_estimate_prices_a_budget_between_op_sac_and_no_recompute():
    op = _estimate("--recompute-modules", "op")
    budget = _estimate("--memory-budget", "0.1")
    none = _estimate("--recompute", "none")
    assert budget["parallel"]["recompute_modules"] == ["budget:0.1"]
    act = [r["stages"][0]["memory_gib"]["activations"] for r in (op, budget, none)]
    step = [r["step_time_s"] for r in (op, budget, none)]
    assert act[1] < act[0] < act[2]
    assert step[2] <= step[1] < step[0]
    assert budget["fits"] and not none["fits"]


def test_search_picks_the_budget_where_it_beats_op_sac_and_full(tmp_path):
    args = ["plan", "--model", "deepseek-v3", "--cluster", "h100", "--gpus", "1024",
            "--target", "torchtitan", "--pp", "1", "--tp", "4", "--ep", "256",
            "--out", str(tmp_path)]  # fmt: skip
    assert run_piper(args).code == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["parallel"]["recompute"] == "selective"
    assert plan["parallel"]["recompute_modules"] == ["budget:0.1"]


@pytest.mark.parametrize("target", ["megatron", "piper"])
def test_other_targets_refuse_the_budget_in_one_line(target):
    out = run_piper(["estimate", *LAYOUT, "--target", target, "--memory-budget", "0.5"])
    assert out.code == 2 and len(out.err_lines) == 1
    assert "--memory-budget 0.5" in out.stderr and "--target torchtitan" in out.stderr
