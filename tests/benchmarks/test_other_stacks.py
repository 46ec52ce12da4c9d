"""benchmarks/other_stacks.py: the other-stacks file loads with a source per row and ids and
layouts apart from the calibration and held-out files; its summary, flush, speed-up and
FSDP2-held-set arithmetic match hand-computed values."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import other_stacks as os_  # noqa: E402

from planner.calibrate.runs import estimate_run, load_runs  # noqa: E402
from planner.inputs.clusters import load_cluster  # noqa: E402
from planner.specs import GIB  # noqa: E402

RUNS_DIR = ROOT / "profiles" / "runs"
KEY = ("model", "hardware", "gpus", "precision", "seq", "gbs", "mbs", "tp", "pp", "vp", "cp",
       "ep", "etp", "measured_tokens_per_s_per_gpu", "measured_tflops_per_gpu")  # fmt: skip
PINNED = re.compile(r"@?[0-9a-f]{7,40}\b|https://")


@pytest.fixture(scope="module")
def runs():
    return load_runs(os_.RUNS)


def test_every_row_has_a_pinned_source_and_a_known_stack(runs):
    assert len(runs) == 9
    for run in runs:
        assert PINNED.search(run.field("source")), run.label
        assert run.field("note"), run.label
        assert run.field("stack") in (*os_.FSDP2_STACKS, "megatron"), run.label
        assert int(run.field("pipeline_flushes")) >= 1, run.label
        assert run.hardware == "H100" and run.training.dtype == "bf16", run.label


def test_ids_and_layouts_apart_from_the_calibration_and_holdout_files(runs):
    ids = [run.field("id") for run in runs]
    assert len(set(ids)) == len(ids)
    for name in ("published_runs.csv", "holdout_runs.csv"):
        other = load_runs(RUNS_DIR / name)
        assert not set(ids) & {r.field("id") for r in other}, name
        layouts = {tuple(r.field(k) for k in KEY) for r in other}
        assert not [r.label for r in runs if tuple(r.field(k) for k in KEY) in layouts], name


def test_fsdp2_rows_are_priced_with_fsdp_and_megatron_rows_with_the_distributed_optimizer(runs):
    for run in runs:
        fsdp2 = run.field("stack") in os_.FSDP2_STACKS
        assert run.training.fsdp is fsdp2 and run.training.zero is not fsdp2, run.label


def test_summarize_by_hand():
    s = os_.summarize([0.8, 1.0, 1.25, 1.1])
    assert s.n == 4
    assert s.geomean == pytest.approx(1.1**0.25, rel=1e-12)  # 0.8 x 1.25 = 1
    assert s.within == (0.5, 0.75)  # +-15%: 1.0, 1.1; +-20% adds 0.8 (|0.8 - 1| = 0.2)


def test_flushed_tokens_by_hand():
    run = SimpleNamespace(parallel=SimpleNamespace(pp=4, vp=2, world=8))
    est = SimpleNamespace(slot_s=1.0, step_time_s=10.0, tokens_per_s=800.0)
    assert os_.flushed_tokens_per_gpu(run, est, 1) == pytest.approx(100.0)
    # 3 flushes: 2 more fills and drains of (4 - 1) / 2 slots each = 3 s on a 10 s step
    assert os_.flushed_tokens_per_gpu(run, est, 3) == pytest.approx(8000.0 / 13.0 / 8.0)


def test_speedup_by_hand():
    points = {"a": os_.Point("a", "t", 579.0, 600.0, 600.0),
              "b": os_.Point("b", "t", 346.0, 480.0, 480.0)}  # fmt: skip
    measured, predicted = os_.speedup(points, "a", "b")
    assert measured == pytest.approx(579.0 / 346.0)
    assert predicted == pytest.approx(1.25)


def _held_by_the_model(run, stage: int) -> tuple[float, float]:
    """(weights GiB, grads GiB) the model adds to `stage` for FSDP2 under pipelining: the
    row priced with fsdp_hold_unsharded minus without."""
    held = replace(run.training, fsdp_hold_unsharded=True)
    plain = replace(run.training, fsdp_hold_unsharded=False)
    cluster = load_cluster("h100")
    a = dict(estimate_run(replace(run, training=held), cluster).stages[stage].memory_gib)
    b = dict(estimate_run(replace(run, training=plain), cluster).stages[stage].memory_gib)
    return a["weights"] - b["weights"], a["grads"] - b["grads"]


def test_fsdp2_held_set_counts_deepseek_v3_from_its_config(runs):
    """id 406: pipeline rank 1 holds 8 MoE layers; 8 of 256 experts per layer (EP 32), FSDP2
    shards them over edp = 64 / 32 = 2, so they are part of the unsharded set."""
    run = next(r for r in runs if r.label == "id 406")
    layers = run.stage_layers[1]
    assert len(layers) == 8 and run.parallel.edp == 2
    dense = _mla_moe_dense_params(heads=128, experts=256)
    experts = 8 * 3 * 7168 * 2048
    params_gib, grads_gib = _held_by_the_model(run, 1)
    assert params_gib == pytest.approx(2 * 8 * (dense + experts) / GIB, rel=1e-12)
    assert grads_gib == pytest.approx(4 * 8 * (dense + experts) / GIB, rel=1e-12)


def _mla_moe_dense_params(heads: int, experts: int) -> int:
    """Non-expert parameters of one DeepSeek-V3-style MoE layer (hidden 7168, q_lora 1536,
    kv_lora 512, rope 64, nope 128, v 128, one shared expert of 2048): MLA, shared expert,
    router weight and bias, two norms."""
    h, q_lora, kv_lora = 7168, 1536, 512
    attention = (h * q_lora + q_lora + q_lora * heads * 192 + h * (kv_lora + 64) + kv_lora
                 + kv_lora * heads * 256 + heads * 128 * h)  # fmt: skip
    return attention + 3 * h * 2048 + experts * h + experts + 2 * h


def test_experts_outside_fsdp_are_not_held(runs):
    """id 403 (Kimi K2, 64 heads, 384 experts): EP 32 = data-parallel 32, so AutoModel leaves
    the experts out of FSDP2 and only the 8 layers' non-expert parameters are held."""
    run = next(r for r in runs if r.label == "id 403")
    layers = run.stage_layers[1]
    assert len(layers) == 8 and run.parallel.edp == 1
    dense = _mla_moe_dense_params(heads=64, experts=384)
    params_gib, grads_gib = _held_by_the_model(run, 1)
    assert params_gib == pytest.approx(2 * 8 * dense / GIB, rel=1e-12)
    assert grads_gib == pytest.approx(4 * 8 * dense / GIB, rel=1e-12)


