"""benchmarks/published_runs.py: every published row is priced and fits, the rank correlation
by hand, and the issue's targets pass for exact predictions and fail for a biased model."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import published_runs as pr  # noqa: E402

from planner.calibrate.runs import estimate_run, load_runs  # noqa: E402
from planner.inputs.clusters import load_cluster  # noqa: E402


def test_spearman_by_hand():
    assert pr.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert pr.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # ranks (1, 2, 3, 4) vs (2, 1, 4, 3): 1 - 6 x 4 / (4 x 15) = 0.6
    assert pr.spearman([1, 2, 3, 4], [2, 1, 4, 3]) == pytest.approx(0.6)


def test_every_published_layout_is_priced_and_predicted_to_fit():
    runs = load_runs(pr.RUNS)
    assert len(runs) == 18
    for run in runs:
        est = estimate_run(run, load_cluster(pr.CLUSTERS[run.hardware]))
        assert 0 < est.step_time_s < 1e3, run.label
        assert est.fits, (run.label, est.reason)  # they ran, so they fit


def _rows(scale_bf16: float):
    """Rows whose 'estimates' predict each run exactly, BF16 ones times scale_bf16."""
    rows = []
    for run in load_runs(pr.RUNS):
        k = scale_bf16 if run.training.dtype == "bf16" else 1.0
        value = run.measured * k
        est = SimpleNamespace(tokens_per_s=value * run.parallel.world, tflops_per_gpu=value,
                              fits=True)  # fmt: skip
        rows.append(pr.Row(run, est, est, k))
    return rows


def test_targets_pass_for_exact_predictions_and_fail_for_a_biased_model():
    exact = pr._target_values(_rows(1.0), "preset")
    assert all(ok for _, ok in exact.values()), exact
    assert exact["first pick there is the measured fastest (ids 4, 5 tie)"][0] in ("id 4", "id 5")
    biased = pr._target_values(_rows(1.4), "fit")
    failed = {name for name, (_, ok) in biased.items() if not ok}
    assert failed == {
        "BF16 geomean predicted / measured in [0.92, 1.08]",
        "BF16 rows within +-15%: >= 75%",
        "worst BF16 row within +-35%",
    }
    assert biased["BF16 geomean predicted / measured in [0.92, 1.08]"][0] == "1.400"


def test_time_per_layer_and_micro_batch_by_hand():
    """GPT-OSS-120B on 64 GB200s (ids 21, 22; 36 layers, pp 1): the step a tokens/s/GPU row
    implies, per micro-batch and layer."""
    runs = {r.field("id"): r for r in pr.load_runs(pr.RUNS)}
    a, b = runs["21"], runs["22"]
    # id 21: 1280 x 8192 tokens over 64 GPUs at 15,876 tokens/s/GPU, 20 micro-batches
    step = 1280 * 8192 / (64 * 15876.0)
    assert pr.measured_step_s(a) == pytest.approx(step)
    assert pr.per_layer_microbatch_s(a, step) == pytest.approx(step / 20 / 36)
    assert (pr.micro_batch_tokens(a), pr.micro_batch_tokens(b)) == (8192, 16384)
    t1 = 1280 * 8192 / (64 * 15876.0) / 20 / 36
    t2 = 1280 * 4096 / (64 * 16640.0) / 5 / 36
    assert pr.per_layer_microbatch_s(b, pr.measured_step_s(b)) == pytest.approx(t2)
    assert t2 > t1 * 1.8  # twice the tokens, nearly twice the time: little of it is fixed
