"""Megatron-LM and torchtitan logs read back (planner/calibrate/logs.py) and turned into runs
against their plan (log_runs.py): the figures after the warm-up, and every bad log one
SpecError line."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from planner.calibrate.log_runs import resolve_plan, run_of_log
from planner.calibrate.logs import after_warmup, parse_log
from planner.specs import SpecError
from tests.planner.calibrate.engine_logs import (
    MEGATRON_ARGS,
    megatron_log,
    titan_log,
    titan_mesh,
    titan_step,
)
from tests.planner.calibrate.test_compare import tiny_plan

ELAPSED_S = (9.0, 2.0, 2.2, 2.4)  # the first iteration is the warm-up
TOKENS_PER_ITERATION = 8 * 64  # tiny_plan: global batch 8, sequence 64
WORLD = 4


def _write(tmp_path, text: str, name: str = "train.log", target: str | None = None):
    plan = tiny_plan()
    if target:
        plan = replace(plan, extra={**plan.extra, "target": target})
    (tmp_path / "plan.json").write_text(plan.to_json())
    log = tmp_path / name
    log.write_text(text)
    return f"{tmp_path / 'plan.json'}:{log}"


def test_megatron_lines_give_time_throughput_memory_and_layout():
    log = parse_log(megatron_log(ELAPSED_S), "train.log")
    assert log.engine == "megatron"
    assert [s.step_time_s for s in log.steps] == list(ELAPSED_S)
    assert [s.tflops_per_gpu for s in log.steps] == [12.5] * 4
    assert [s.first for s in log.steps] == [1, 2, 3, 4]  # log_interval 1
    assert log.peak_gib == 1536.0 / 1024  # largest max allocated, MB -> GiB
    layout = dict(log.layout)
    assert layout["tp"] == 1 and layout["pp"] == 2 and layout["vp"] == 1  # None -> 1
    assert layout["dp"] == 2 and layout["world"] == 4 and layout["global_batch"] == 8
    assert [s.iteration for s in after_warmup(log, 1)] == [2, 3, 4]


def test_a_megatron_log_interval_window_starts_after_the_warm_up():
    args = {**MEGATRON_ARGS, "log_interval": 2}
    text = megatron_log(ELAPSED_S, args).replace("iteration        1/", "iteration        X/")
    log = parse_log(text, "train.log")  # lines for iterations 2, 3, 4 remain
    assert [(s.first, s.iteration) for s in log.steps] == [(1, 2), (2, 3), (3, 4)]
    assert [s.iteration for s in after_warmup(log, 1)] == [3, 4]


def test_a_megatron_log_is_a_run_of_its_plan(tmp_path):
    run = run_of_log(_write(tmp_path, megatron_log(ELAPSED_S), target="megatron"))
    expected = statistics.median(TOKENS_PER_ITERATION / t / WORLD for t in ELAPSED_S[1:])
    assert run.metric == "tokens/s/GPU" and run.measured == pytest.approx(expected)
    assert run.measured_peak_gib == 1.5 and run.parallel.pp == 2 and run.parallel.ep == 2


def test_torchtitan_lines_give_tps_memory_and_layout(tmp_path):
    text = titan_log((900.0, 1000.0, 1100.0, 1050.0), (3.0, 2.0, 2.5, 2.25))
    assert "\x1b[31m" in text  # the colours are in the log as torchtitan prints them
    log = parse_log(text, "titan.log")
    assert log.engine == "torchtitan"
    assert [s.tokens_per_s_per_gpu for s in log.steps] == [900, 1000, 1100, 1050]
    assert dict(log.layout) == {"pp": 2, "dp": 2, "cp": 1, "tp": 1, "ep": 2, "world": 4}
    run = run_of_log(_write(tmp_path, text, target="torchtitan"), skip_steps=1)
    assert run.measured == 1050.0  # median of 1000, 1100, 1050: the first step is warm-up
    assert run.measured_peak_gib == 2.5  # the largest peak reserved after the warm-up


def test_an_export_beside_the_plan_resolves_to_it(tmp_path):
    pair = _write(tmp_path, megatron_log(ELAPSED_S))
    log = pair.rsplit(":", 1)[1]
    export = tmp_path / "megatron_args.sh"
    export.write_text("MEGATRON_ARGS=()\n")
    assert resolve_plan(export) == tmp_path / "plan.json"
    assert run_of_log(f"{export}:{log}").measured == run_of_log(pair).measured
    titan = tmp_path / "titan.log"
    titan.write_text(titan_log((900.0, 1000.0), (1.0, 1.0)))
    with pytest.raises(SpecError, match="torchtitan log, but .*megatron_args.sh is the Megatron"):
        run_of_log(f"{export}:{titan}")
    alone = tmp_path / "elsewhere" / "torchtitan_args.sh"
    alone.parent.mkdir()
    alone.write_text("")
    with pytest.raises(SpecError, match="an export with no plan.json beside it"):
        run_of_log(f"{alone}:{log}")


def _bad_logs() -> list[tuple[str, str, str, str | None]]:
    good = megatron_log(ELAPSED_S)
    titan = titan_log((900.0, 1000.0, 1100.0), (3.0, 2.0, 2.5))
    return [
        ("cut", good[: good.rindex("number of nan")], "line 24: an iteration line cut short",
         None),
        ("no iteration", good.split(" [2026")[0], "no 'iteration N/M", None),
        ("oom", good + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n",
         "ran out of memory", None),
        ("traceback", good + "Traceback (most recent call last):\n  File x\n",
         "raised an exception", None),
        ("nan count", megatron_log(ELAPSED_S, nan_at=3), "1 NaN iterations", None),
        ("titan nan", titan + titan_step(4, float("nan"), 2.0, 1000, 1.0) + "\n",
         "loss is nan", None),
        ("titan cut", titan + titan_step(4, 7.0, 2.0, 1000, 1.0)[:-30] + "\n", "cut short",
         None),
        ("titan oom", titan + "WARNING - 2 CUDA OOM errors thrown.\n", "2 out-of-memory", None),
        ("warm-up", megatron_log(ELAPSED_S[:1]), "none after the 1 warm-up", None),
        ("layout", megatron_log(ELAPSED_S, {**MEGATRON_ARGS, "tensor_model_parallel_size": 2}),
         "the log's layout has tp=2", None),
        ("titan layout", titan_log((1.0, 2.0), (1.0, 1.0), titan_mesh(ep=4)),
         "the log's layout has ep=4", None),
        ("target", good, "a Megatron-LM log, but", "torchtitan"),
        ("not a log", "hello\n", "neither a Megatron-LM log", None),
    ]  # fmt: skip


@pytest.mark.parametrize("case", _bad_logs(), ids=lambda c: c[0])
def test_bad_logs_are_one_line(tmp_path, case):
    _, text, message, target = case
    with pytest.raises(SpecError) as err:
        run_of_log(_write(tmp_path, text, target=target), skip_steps=1)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "train.log" in str(err.value)
