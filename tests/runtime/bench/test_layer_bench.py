"""runtime/bench/layer_bench.py on CPU: the per-layer prediction beside the measurement."""

from __future__ import annotations

import json

import pytest
import torch

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.parallel import ParallelConfig
from planner.resources.layer_cost import layer_cost
from planner.specs import TrainingSpec
from runtime.bench import layer_bench as lb
from runtime.model.transformer import StageModule


@pytest.mark.parametrize("index", [0, 1])  # tiny-moe: layer 0 dense, layer 1 MoE
def test_prediction_is_layer_cost_at_world_one(index):
    model, cluster = load_model("tiny-moe"), load_cluster("h200")
    pred = lb.predicted(model, index, cluster, 64, 2)
    cost = layer_cost(
        model, index, cluster, TrainingSpec(seq_len=64, global_batch=2),
        ParallelConfig(pp=1, dp=1, ep=1, micro_batch=2),
    )  # fmt: skip
    assert pred["pred_fwd_bwd_s"] == pytest.approx(cost.time_s)
    assert pred["pred_comm_s"] == 0.0  # one rank: no exposed communication
    assert sum(pred["pred_work_s"].values()) == pytest.approx(cost.compute_s)
    # the planner's weights + gradients are bf16 (2 + 2 B) of the parameters the runtime's
    # module for that layer holds: the same layer is priced and measured
    held = sum(p.numel() for p in StageModule(model, [index], first=False, last=False).parameters())
    assert pred["pred_mem_bytes"] == pytest.approx(4 * held + cost.act.total)


def test_fp32_prediction_prices_fp32():
    model, cluster = load_model("tiny-moe"), load_cluster("cpu-gloo")
    bf16 = lb.predicted(model, 1, cluster, 64, 1, "bf16")
    fp32 = lb.predicted(model, 1, cluster, 64, 1, "fp32")
    # activations in 4-byte elements (the fp32 router logits and 1-byte masks stay put)
    assert 1.9 < fp32["pred_act_bytes"] / bf16["pred_act_bytes"] <= 2.0
    assert fp32["pred_fwd_bwd_s"] > bf16["pred_fwd_bwd_s"]


def test_errors_and_verdict():
    row = {"fwd_s": 0.004, "bwd_s": 0.006, "pred_fwd_bwd_s": 0.011, "flops_fwd_bwd": 1e12}
    out = lb.compare(row, 0.10, 0.05)
    assert out["time_error"] == pytest.approx(0.10) and out["pass"]  # +10% is inside 10%
    assert out["measured_tflops"] == pytest.approx(100.0)
    assert not lb.compare(row, 0.09, 0.05)["pass"]
    row.update(mem_bytes=100.0, pred_mem_bytes=94.0)
    out = lb.compare(row, 0.10, 0.05)
    assert out["mem_error"] == pytest.approx(-0.06) and not out["pass"]
    assert lb.compare(row, 0.10, 0.07)["pass"]


def test_cpu_run_prints_prediction_beside_measurement(tmp_path, capsys):
    prefix = tmp_path / "lb"
    argv = ["--model", "tiny-moe", "--cluster", "cpu-gloo", "--seq-len", "32", "--iters", "1"]
    assert lb.main(argv + ["--out", str(prefix), "--time-tol", "1e9"]) == 0
    text = capsys.readouterr().out
    assert text.count("predicted fwd+bwd") == 2 and text.count("time error") == 2
    assert "peak memory not measured on this device" in text and "PASS" in text
    rows = json.loads((tmp_path / "lb.json").read_text())
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        total = r["fwd_s"] + r["bwd_s"]
        assert r["time_error"] == pytest.approx((r["pred_fwd_bwd_s"] - total) / total)
        assert r["device"] == "cpu" and "mem_bytes" not in r
    assert "time_error" in (tmp_path / "lb.csv").read_text().splitlines()[0]
    # a zero tolerance fails every row, and --check turns that into exit code 1
    assert lb.main(argv + ["--layers", "1", "--time-tol", "0", "--check"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bad_layers_is_one_line_exit_2(capsys):
    assert lb.main(["--model", "tiny-moe", "--layers", "0,7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--layers 0,7" in err and "0..3" in err
    assert lb.main(["--model", "tiny-moe", "--layers", "a"]) == 2
    assert "comma-separated" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_layer_measures_memory_near_prediction():
    """On a GPU at a small width: peak memory is measured and within 25% of the prediction
    (the device check holds the full-size layer to 5%)."""
    model = load_model("mixtral-8x7b")
    from dataclasses import replace

    from planner.run.scale import scale_layer

    small = replace(
        model, layers=tuple(scale_layer(x, 0.25) for x in model.layers), hidden_size=1024
    )
    rows = lb.bench(small, load_cluster("h200"), 2048, 1, [0], iters=3)
    assert rows[0]["device"].startswith("cuda") and rows[0]["mem_bytes"] > 0
    assert abs(rows[0]["mem_error"]) < 0.25


def test_other_cluster_predicts_the_same_measurement(capsys):
    model = load_model("tiny-moe")
    rows = lb.bench(
        model, load_cluster("cpu-gloo"), 32, 1, [1], iters=1, other=load_cluster("h200")
    )
    alt, total = rows[0]["other"], rows[0]["fwd_s"] + rows[0]["bwd_s"]
    assert alt["cluster"] == "h200"
    assert alt["pred_fwd_bwd_s"] == pytest.approx(
        lb.predicted(model, 1, load_cluster("h200"), 32, 1, "fp32")["pred_fwd_bwd_s"]
    )
    assert alt["time_error"] == pytest.approx((alt["pred_fwd_bwd_s"] - total) / total)
    assert "cluster h200 predicts" in lb.format_row(rows[0])
