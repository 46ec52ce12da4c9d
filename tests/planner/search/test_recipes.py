"""The baselines are the layouts teams publish for the model (profiles/runs/published_runs.csv),
dp scaled to the plan's GPUs; a model without one gets the generic layout."""

from __future__ import annotations

import json

from planner.parallel import ParallelConfig
from planner.search.recipes import recipe_layout, recipes_for
from tests.hardening_cli import run_piper_process


def test_recipes_closest_first_and_scaled_to_the_gpus():
    """Qwen3-235B in BF16 on H100: ModelZoo's 1,861.8 tokens/s/GPU rows (ids 4, then 5) lead;
    id 4's layout (tp 2, pp 8, vp 4, ep 32) on 512 GPUs keeps every size but dp (16 -> 32)."""
    recipes = recipes_for("qwen3-235b-a22b", "H100-SXM5-80GB", "bf16")
    assert [r.row_id for r in recipes[:2]] == ["4", "5"]
    top = recipes[0]
    assert (top.source, top.gpus, top.dispatcher, top.a2a_overlap) == (
        "Megatron-MoE-ModelZoo", 256, "deepep", True)  # fmt: skip
    assert recipe_layout(top, 512, 2048) == ParallelConfig(
        pp=8, dp=32, tp=2, ep=32, micro_batch=1, num_microbatches=64, recompute="selective",
        vp=4, recompute_modules=("layernorm", "moe_act"),
    )  # fmt: skip
    assert recipe_layout(top, 100, 2048) is None  # tp x pp = 16 does not divide 100 GPUs
    assert recipes_for("mixtral-8x7b", "H100-SXM5-80GB", "bf16") == ()
    # on GB200 the GB200 rows come first; deepseek-v3-nomtp's rows serve deepseek-v3
    assert recipes_for("deepseek-v3", "GB200", "bf16")[0].row_id == "20"


def test_the_plan_compares_with_the_published_recipe(tmp_path):
    """Qwen3-30B-A3B in FP8 on 16 H100s: Megatron-Bridge's recipe (id 35: tp 1, pp 1, ep 16,
    HybridEP) is the third baseline, priced as published."""
    out = tmp_path / "out"
    done = run_piper_process(["plan", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus",
                              "16", "--dtype", "fp8", "--no-plots", "--out", str(out)])  # fmt: skip
    assert done.code == 0, done.stderr
    baselines = json.loads((out / "plan.json").read_text())["extra"]["baselines"]
    assert [b["name"] for b in baselines] == ["uniform", "xmoe", "recipe"]
    assert baselines[2]["layout"] == (
        "pp=1 dp=16 tp=1 ep=16 mb=1 m=64 recompute=none zero dispatcher=deepep"
    )
    assert "Megatron-Bridge recipe (16 H100, fp8)" in done.stdout
