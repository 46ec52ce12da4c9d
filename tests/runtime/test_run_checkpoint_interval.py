"""`piper run --checkpoint-dir D` without --checkpoint-every saves at the plan's interval that
minimises lost time (planner.size.checkpoint_interval), capped at --steps, and says why on one
line; an explicit --checkpoint-every wins. torchrun is not started: the command it would run is
read instead."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planner.cli import main
from planner.inputs.clusters import cluster_to_dict, load_cluster
from planner.inputs.models import load_model, model_config
from planner.plan import ClusterEntry, ModelEntry
from planner.resources.offload import host_link
from planner.resources.params import count_params
from planner.size.request import FAILURES_PER_GPU_HOUR
from tests.runtime.tiny_plans import hand_plan

GPUS = 2


def by_hand_interval_s() -> float:
    """sqrt(2 C M) for tiny-moe on 2 cpu-gloo ranks under Piper's runtime: an async save
    blocks for each rank's share of 14 B per parameter (bf16 weights, fp32 master and moments)
    over the host link, C = 14 P / 2 / link; M = 3600 / (Llama 3's rate x 2)."""
    params = count_params(load_model("tiny-moe")).total
    save_s = 14 * params / GPUS / (host_link(load_cluster("cpu-gloo")).link_gbps * 1e9)
    mtbf_s = 3600 / (FAILURES_PER_GPU_HOUR * GPUS)
    return math.sqrt(2 * save_s * mtbf_s)


def write_plan(tmp_path, step_time_s: float):
    """tiny-moe, pp 2, on cpu-gloo, predicting `step_time_s` per step."""
    model = load_model("tiny-moe")
    plan = hand_plan(
        model, 2, 1, 1, micro_batch=2, seq_len=64, gpus_per_node=2,
        model_entry=ModelEntry("tiny-moe", model.source, model_config(model)),
    )  # fmt: skip
    cluster = ClusterEntry.from_dict({**cluster_to_dict(load_cluster("cpu-gloo")), "gpus": GPUS})
    predicted = replace(plan.predicted, step_time_s=step_time_s)
    path = tmp_path / "plan.json"
    path.write_text(replace(plan, cluster=cluster, predicted=predicted).to_json())
    return path


@pytest.fixture
def launched(monkeypatch):
    """The torchrun command `piper run` would start (nothing is started)."""
    cmds: list[list[str]] = []

    def fake_train(cmd, env, out, steps):
        cmds.append(cmd)
        return 0, False

    monkeypatch.setattr("planner.cli.run._train", fake_train)
    monkeypatch.setattr("planner.cli.run._summary", lambda out, checkpoint=None: "done")
    return cmds


def every(cmd: list[str]) -> int:
    return int(cmd[cmd.index("--checkpoint-every") + 1])


def run(tmp_path, plan, *flags: str) -> int:
    argv = ["run", str(plan), "--checkpoint-dir", str(tmp_path / "ck"), "--out"]
    return main([*argv, str(tmp_path / "out"), *flags])


def test_the_default_is_the_plans_interval_and_a_flag_overrides_it(tmp_path, launched, capsys):
    """A step of sqrt(2 C M) / 10: the default saves every 10 steps."""
    plan = write_plan(tmp_path, by_hand_interval_s() / 10)
    assert run(tmp_path, plan, "--steps", "25") == 0
    assert every(launched[-1]) == 10
    lines = [x for x in capsys.readouterr().out.splitlines() if "checkpoint every" in x]
    assert len(lines) == 1 and lines[0].startswith("piper run: checkpoint every 10 steps: ")
    assert "async save (piper)" in lines[0] and "--checkpoint-every N overrides it" in lines[0]
    assert run(tmp_path, plan, "--steps", "25", "--checkpoint-every", "3") == 0
    assert every(launched[-1]) == 3
    assert "minimises lost time" not in capsys.readouterr().out
    assert run(tmp_path, plan, "--steps", "25", "--checkpoint-every", "0") == 0
    assert every(launched[-1]) == 0


def test_a_run_no_longer_than_one_interval_saves_after_the_last_step_only(
    tmp_path, launched, capsys
):
    plan = write_plan(tmp_path, by_hand_interval_s() / 10)
    assert run(tmp_path, plan, "--steps", "10") == 0
    assert every(launched[-1]) == 0
    out = capsys.readouterr().out
    assert "piper run: checkpoint after the last step only (10 steps): the interval that " in out
    assert "is 10 steps (sqrt(2 C M)" in out


def test_a_plan_without_a_step_time_saves_after_the_last_step_only(tmp_path, launched, capsys):
    assert run(tmp_path, write_plan(tmp_path, 0.0), "--steps", "5") == 0
    assert every(launched[-1]) == 0
    out = capsys.readouterr().out
    assert "piper run: checkpoint after the last step only: plan.json: predicted.step_time_s" in out
