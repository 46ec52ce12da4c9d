"""Layouts: the folded expert mesh, virtual pipeline chunks, context parallel, expert tensor
parallel and recompute modules; each rule checked on its own, and plan.json carrying them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner.inputs.models import load_model
from planner.parallel import (
    RECOMPUTE_MODULES,
    ParallelConfig,
    check_layout,
    virtual_chunks,
)
from planner.plan import ParallelPlan, load_plan, plan_from_dict
from planner.specs import SpecError, TrainingSpec

OLD_PLAN = Path(__file__).resolve().parent / "data" / "plan_before_knobs.json"  # pp4 dp8 tp2 ep8


def test_expert_mesh_folds_over_tp_cp_dp():
    # Megatron-Core's example: TP4 CP2 DP8 PP4 folds into ETP1 EP64 EDP1
    par = ParallelConfig(pp=4, dp=8, tp=4, cp=2, ep=64)
    assert par.world == 4 * 8 * 4 * 2 == 256
    assert par.etp * par.ep * par.edp == par.tp * par.cp * par.dp
    assert par.edp == 1
    # ep larger than dp * tp is a valid folded layout
    assert ParallelConfig(pp=1, dp=2, tp=2, cp=2, ep=8).edp == 1
    # the published Qwen3-235B FSDP run: tp2 ep8 on 256 GPUs, pp1 -> edp 32
    assert ParallelConfig(pp=1, dp=128, tp=2, ep=8).edp == 32
    assert ParallelConfig(pp=1, dp=4, tp=2, ep=2, etp=2).edp == 2


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"pp": 1, "dp": 2, "tp": 1, "ep": 4}, "etp*ep=4 must divide tp*cp*dp=2"),
        ({"pp": 1, "dp": 4, "tp": 2, "ep": 4, "etp": 4}, "etp*ep=16 must divide tp*cp*dp=8"),
        ({"pp": 1, "dp": 2, "vp": 2}, "vp=2 needs pp > 1"),
        ({"pp": 2, "dp": 1, "vp": 2, "num_microbatches": 3}, "num_microbatches=3 must be"),
        ({"pp": 1, "dp": 1, "cp": 0}, "cp must be >= 1"),
        ({"pp": 1, "dp": 1, "etp": 0}, "etp must be >= 1"),
        ({"pp": 1, "dp": 1, "recompute": "selective", "recompute_modules": ("attn",)}, "attn"),
        ({"pp": 1, "dp": 1, "recompute": "full", "recompute_modules": ("moe",)}, "'selective'"),
        (
            {"pp": 1, "dp": 1, "recompute": "selective", "recompute_modules": ("moe", "moe")},
            "twice",
        ),
    ],
)
def test_invalid_layouts_name_the_rule(kwargs, words):
    with pytest.raises(SpecError, match="parallel: ") as exc:
        ParallelConfig(**kwargs)
    assert words in str(exc.value)


def test_interleaved_layout_with_a_multiple_of_pp_micro_batches():
    par = ParallelConfig(pp=4, dp=2, vp=3, num_microbatches=8)
    assert par.vp == 3 and par.world == 8


def test_selective_modules_default_to_core_attention():
    assert ParallelConfig(1, 1, recompute="selective").selective_modules == ("core_attn",)
    mods = ("layernorm", "moe_act")
    par = ParallelConfig(1, 1, recompute="selective", recompute_modules=mods)
    assert par.selective_modules == mods
    assert ParallelConfig(1, 1, recompute="full").selective_modules == ()
    assert set(RECOMPUTE_MODULES) == {
        "core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts", "op"
    }  # fmt: skip


def test_model_level_rules():
    model = load_model("qwen3-30b-a3b")  # 128 experts of FFN width 768, 48 layers
    ok = TrainingSpec(seq_len=4096)
    check_layout(ParallelConfig(pp=4, dp=4, tp=2, cp=2, ep=8, etp=2), model, ok)
    with pytest.raises(SpecError, match="seq_len=4098 must be a multiple of 4"):
        check_layout(ParallelConfig(pp=1, dp=1, cp=2), model, replace(ok, seq_len=4098))
    with pytest.raises(SpecError, match="ep=3 must divide the model's 128"):
        check_layout(ParallelConfig(pp=1, dp=3, ep=3), model, ok)
    with pytest.raises(SpecError, match="etp=5 must divide layer 0's expert FFN width 768"):
        check_layout(ParallelConfig(pp=1, dp=5, tp=1, ep=1, etp=5), model, ok)
    with pytest.raises(SpecError, match="at least 54 layers"):
        check_layout(ParallelConfig(pp=8, dp=1, vp=7, num_microbatches=8), model, ok)
    # Qwen3-235B's 94 layers on pp32 x vp3 (a published run): embedding and loss fill 2 chunks
    check_layout(
        ParallelConfig(pp=32, dp=1, vp=3, num_microbatches=32), load_model("qwen3-235b-a22b"), ok
    )


def test_virtual_chunks_split_a_rank_evenly_in_order():
    assert virtual_chunks(tuple(range(10, 17)), 3) == ((10, 11, 12), (13, 14), (15, 16))
    assert virtual_chunks((0, 1), 1) == ((0, 1),)
    with pytest.raises(SpecError, match="fewer than vp=3"):
        virtual_chunks((4, 5), 3)


def test_plan_json_carries_the_knobs_and_reads_plans_without_them():
    old = json.loads(OLD_PLAN.read_text())
    assert not {"vp", "cp", "etp", "recompute_modules"} & set(old["parallel"])
    plan = plan_from_dict(old)  # a plan written before these knobs existed
    assert (plan.parallel.vp, plan.parallel.cp, plan.parallel.etp) == (1, 1, 1)
    assert plan.parallel.config() == ParallelConfig(4, 8, 2, 8, 1, 128, "none")
    par = ParallelConfig(4, 8, 2, 8, 1, 128, "selective", vp=2, etp=1, recompute_modules=("moe",))
    again = plan_from_dict(json.loads(replace(plan, parallel=ParallelPlan.of(par)).to_json()))
    assert again.parallel.config() == par
    assert again.parallel.recompute_modules == ("moe",)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"recompute_modules": ["attention"]}, "parallel.recompute_modules"),
        ({"cp": 2}, "parallel.edp"),  # edp no longer tp*cp*dp/(etp*ep)
        ({"etp": 0}, "parallel.etp"),
    ],
)
def test_bad_knobs_in_plan_json_are_one_line(change, words, tmp_path):
    doc = json.loads(OLD_PLAN.read_text())
    doc["parallel"].update(change)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SpecError, match=words):
        load_plan(path)
