"""benchmarks/runtime_bytes.py: the planner's communication volumes against a real run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import runtime_bytes as rb  # noqa: E402

from planner.inputs.models import load_model  # noqa: E402
from planner.parallel import ParallelConfig  # noqa: E402
from planner.resources.traffic import step_traffic  # noqa: E402
from planner.specs import TrainingSpec  # noqa: E402


def test_step_traffic_by_hand():
    model = load_model("tiny-moe")  # d 64, 4 layers: 1 dense, 3 MoE top-2 + a shared expert
    training = TrainingSpec(seq_len=128, dtype="fp32", bytes_per_param=18)
    par = ParallelConfig(pp=2, dp=2, tp=2, ep=2, micro_batch=2, num_microbatches=3)
    layers = ((0, 1), (2, 3))
    out = step_traffic(model, training, par, layers, [100.0, 200.0], [10.0, 20.0])
    act = 4 * 2 * 128 * 64  # fp32 b s d of one micro-batch
    ranks, m = 4, 3  # per stage
    # p2p: forward + backward of a 1/tp slice per micro-batch, one boundary, every rank
    assert out["p2p"] == 2 * m * 1 * ranks * act / 2
    # tp: 2 all-reduces per sharded block (attention; the dense MLP of layer 0; the shared
    # expert of layers 1-3), 2 passes of (n-1)/n each: 8 blocks over the 4 layers
    assert out["tp"] == pytest.approx(ranks * m * 8 * 2 * (2 * 0.5 * act))
    # dispatch: 4 all-to-alls per MoE layer, the remote half of T k d, T = b s / tp
    assert out["dispatch"] == pytest.approx(ranks * m * 3 * 4 * 0.5 * (4 * 128 * 2 * 64))
    # gradients: ring all-reduce of 4 B per parameter over dp = 2 and edp = 2
    assert out["grad_dense"] == pytest.approx(ranks * (100 + 200) * 4 * 2 * 0.5)
    assert out["grad_expert"] == pytest.approx(ranks * (10 + 20) * 4 * 2 * 0.5)


@pytest.mark.slow
def test_planner_bytes_match_a_real_run(tmp_path):
    pred, meas = rb.run_layout(tmp_path, "fp32", 4, 2, 1, 2, 2)  # pp x tp x ep, 4 processes
    assert meas["p2p"] == pred["p2p"] > 0  # exact: activation slices between the stages
    assert meas["dispatch"] == pytest.approx(pred["dispatch"], rel=0.05)  # routing varies
    # TP: the model's per-layer collectives, plus two passes per stage end in the runtime
    # (the vocab-parallel embedding's reduce-scatter and its backward all-gather on the first
    # stage, the gather before the head and its backward reduce-scatter on the last) and the
    # vocab-parallel cross entropy's 3 all-reduces of one fp32 number per token (2 passes)
    per_pass = 0.5 * 4 * 2 * 128 * 64 * 2 * 2  # (n-1)/n of fp32 b s d, x m, x 2 ranks/stage
    loss = 3 * 2 * per_pass / 64
    assert meas["tp"] == pytest.approx(pred["tp"] + 4 * per_pass + loss)
    assert meas["grad_dense"] == pred["grad_dense"]  # dp = 1: none


@pytest.mark.slow
def test_interleaved_pipeline_sends_the_models_p2p(tmp_path):
    pred, meas = rb.run_layout(tmp_path, "fp32", 4, 2, 2, 1, 2, vp=2)  # pp x dp, 2 chunks a rank
    # by hand: fp32 [b s d] forward and backward over each of the pp * vp - 1 chunk
    # boundaries, m = 2 micro-batches, on each of the dp = 2 pipelines
    act = 4 * 2 * 128 * 64
    assert meas["p2p"] == pred["p2p"] == 2 * 2 * (2 * 2 - 1) * 2 * act
    assert meas["dispatch"] == pytest.approx(pred["dispatch"], rel=0.05)  # routing varies
    assert meas["grad_dense"] == pred["grad_dense"]


@pytest.mark.slow
def test_fsdp_collectives_against_the_model(tmp_path):
    pred, meas = rb.run_layout(tmp_path, "fp32", 4, 2, 2, 1, 1, fsdp=True)  # edp = dp = 2
    # a reduce-scatter per micro-batch (one ring pass each), as the model counts
    assert meas["grad_dense"] == pred["grad_dense"] > 0
    assert meas["grad_expert"] == pred["grad_expert"] > 0
    # all-gathers: the model moves the fp32 run's fp32 weights twice per micro-batch, as the
    # run does but for FSDP2's root unit (embedding; final norm + head), once per micro-batch
    model = load_model("tiny-moe")
    d, v, m, dp = model.hidden_size, model.vocab_size, 2, 2
    root = v * d + (d + d * v)  # the two stages' root units
    once = dp * (dp - 1) / dp * 4 * m * root  # the root gathers the run does not repeat
    assert meas["param_gather"] == pred["param_gather"] - once
