"""benchmarks/other_stacks.py: the other-stacks file loads with a source per row and ids and
layouts apart from the calibration and held-out files; its summary, flush, speed-up and
FSDP2-held-set arithmetic match hand-computed values."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import other_stacks as os_  # noqa: E402

from planner.calibrate.runs import load_runs  # noqa: E402
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


def test_fsdp2_held_set_counts_deepseek_v3_from_its_config(runs):
    """id 406: pipeline rank 1 holds 8 MoE layers; 8 of 256 experts per layer (EP 32), FSDP2
    shards them over edp = 64 / 32 = 2, so they are part of the unsharded set."""
    run = next(r for r in runs if r.label == "id 406")
    layers = run.stage_layers[1]
    assert len(layers) == 8 and run.parallel.edp == 2
    dense = _mla_moe_dense_params(heads=128, experts=256)
    experts = 8 * 3 * 7168 * 2048
    params_gib, grads_gib = os_.fsdp2_held_gib(run, layers, "torchtitan")
    assert params_gib == pytest.approx(2 * 8 * (dense + experts) / GIB, rel=1e-12)
    assert grads_gib == pytest.approx(4 * 8 * (dense + experts) / GIB, rel=1e-12)
    # AutoModel's experts (no mixed-precision policy) keep bf16 gradients
    _, bf16_expert_grads = os_.fsdp2_held_gib(run, layers, "automodel")
    assert bf16_expert_grads == pytest.approx(8 * (4 * dense + 2 * experts) / GIB, rel=1e-12)


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
    params_gib, grads_gib = os_.fsdp2_held_gib(run, layers, "automodel")
    assert params_gib == pytest.approx(2 * 8 * dense / GIB, rel=1e-12)
    assert grads_gib == pytest.approx(4 * 8 * dense / GIB, rel=1e-12)


def test_stack_peak_by_hand():
    memory = {"weights": 2.0, "grads": 4.0, "optimizer": 12.0, "activations": 5.0,
              "fsdp_gathered": 3.0, "framework": 5.0}  # fmt: skip
    # 31 - 18 (model state) + 8 / 2 x 2 (stack state) = 21; held 6 replaces the 3 gathered
    assert os_.stack_peak_gib(memory, 8, 6.0) == pytest.approx(31.0 - 18.0 + 8.0 - 3.0 + 6.0)
    assert os_.stack_peak_gib(memory, 16, 0.0) == pytest.approx(31.0 - 18.0 + 16.0)


def test_fsdp2_once_per_flush_by_hand():
    def stage(total_s, fsdp_s):
        return SimpleNamespace(total_s=total_s, time_s=(("experts", total_s - fsdp_s),
                                                        ("fsdp_leaf", fsdp_s)))  # fmt: skip

    run = SimpleNamespace(parallel=SimpleNamespace(pp=2, vp=1, world=4, num_microbatches=4))
    # slot 1.1 = slowest stage 1.0 + p2p 0.1; step = (4 + 1) x 1.1 + 0.5 fixed = 6.0 s
    est = SimpleNamespace(stages=(stage(1.0, 0.3), stage(0.9, 0.0)), slot_s=1.1,
                          step_time_s=6.0, tokens_per_s=400.0)  # fmt: skip
    # slot' = max(0.7, 0.9) + 0.1 = 1.0; step' = 6.0 - 5 x 1.1 + (4 + 2 x 1) x 1.0 + 2 x 0.3
    step_s = 6.0 - 5 * 1.1 + 6 * 1.0 + 2 * 0.3
    assert os_.fsdp2_pp_tokens_per_gpu(run, est, 2) == pytest.approx(400.0 * 6.0 / step_s / 4)
    no_fsdp = SimpleNamespace(stages=(stage(1.0, 0.0),), slot_s=1.1, step_time_s=6.0,
                              tokens_per_s=400.0)  # fmt: skip
    assert os_.fsdp2_pp_tokens_per_gpu(run, no_fsdp, 1) == pytest.approx(100.0)
