"""The exports' save interval: Megatron's --save-interval and torchtitan's --checkpoint.interval
are the plan's checkpoint interval (planner.size.checkpoint_interval) for the engine's blocking
save, with a note naming its inputs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planner.inputs.models import load_model
from planner.outputs.export import export_plan
from planner.resources.params import count_params
from planner.size.checkpoint_interval import plan_checkpoint_interval
from planner.size.request import FAILURES_PER_GPU_HOUR
from tests.planner.outputs.export_plans import bash_array, knob_plan, make_plan, priced_for

ARRAYS = {"megatron": "MEGATRON_ARGS", "torchtitan": "TORCHTITAN_ARGS"}
FLAG = {"megatron": "--save-interval", "torchtitan": "--checkpoint.interval"}


def exported(plan, engine: str) -> tuple[list[str], str]:
    result = export_plan(plan, engine)
    return bash_array(result.text, ARRAYS[engine]), result.text


def value(args: list[str], flag: str) -> int:
    assert args.count(flag) == 1
    return int(args[args.index(flag) + 1])


def fsdp(plan):
    return replace(plan, training={**plan.training, "fsdp": True})


@pytest.mark.parametrize("engine", ["megatron", "torchtitan"])
def test_the_export_saves_at_the_plans_interval(engine):
    """tiny-moe-deep on 8 GPUs, a 0.25 s step: a blocking save of 14 B per parameter at
    2,000 GB/s, failures every 3600 / (Llama 3's rate x 8) s: sqrt(2 C M) / 0.25 s steps."""
    plan = priced_for(fsdp(make_plan()), engine)
    plan = replace(plan, predicted=replace(plan.predicted, step_time_s=0.25))
    save_s = 14 * count_params(load_model("tiny-moe-deep")).total / 2e12
    by_hand = round(math.sqrt(2 * save_s * 3600 / (FAILURES_PER_GPU_HOUR * 8)) / 0.25)
    interval = plan_checkpoint_interval(plan, target=engine)
    assert interval.steps == by_hand > 1
    args, text = exported(plan, engine)
    assert value(args, FLAG[engine]) == by_hand
    assert f"\n# {FLAG[engine]} {by_hand}: the checkpoint interval that minimises" in text
    assert not any(FLAG[engine] in n for n in export_plan(plan, engine).notes)
    assert f"C = {interval.save_s:.3g} s per blocking save ({engine})" in text
    assert "--async-save" not in args


def test_torchtitan_turns_checkpoints_on_and_megatron_leaves_save_dir_to_the_user():
    titan, _ = exported(priced_for(fsdp(make_plan()), "torchtitan"), "torchtitan")
    assert "--checkpoint.enable" in titan
    mega, text = exported(priced_for(fsdp(make_plan()), "megatron"), "megatron")
    assert "--save" not in mega and "Megatron saves only with --save DIR" in text


def test_every_knob_plan_exports_megatrons_interval_without_async_save():
    """DeepSeek-V3 with FSDP (--ckpt-format fsdp_dtensor): blocking, no --async-save."""
    plan = priced_for(knob_plan("bf16"), "megatron")
    args, _ = exported(plan, "megatron")
    assert value(args, "--save-interval") == plan_checkpoint_interval(plan, target="megatron").steps
    assert "--async-save" not in args


@pytest.mark.parametrize("engine", ["megatron", "torchtitan"])
def test_a_plan_without_a_step_time_exports_no_interval_and_says_why(engine):
    plan = priced_for(fsdp(make_plan()), engine)
    plan = replace(plan, predicted=replace(plan.predicted, step_time_s=0.0))
    args, text = exported(plan, engine)
    assert FLAG[engine] not in args and "--checkpoint.enable" not in args
    assert "predicted.step_time_s is 0, so no checkpoint interval follows from it" in text
