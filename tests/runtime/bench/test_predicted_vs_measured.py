"""runtime/bench/predicted_vs_measured.py: the preset's prediction in the bench's units."""

from __future__ import annotations

import json

import pytest

from planner.inputs.clusters import load_cluster
from runtime.bench import predicted_vs_measured as pvm


def raw() -> dict:
    return {
        "machine": {"device": "dev", "dtype": "bf16", "torch": "2"},
        "sizes": {
            "gemm_k": 4096,
            "gemm_n": 4096,
            "experts": 8,
            "attn_heads": 32,
            "attn_head_dim": 128,
        },  # fmt: skip
        "compute": {
            "gemm": {"x": [8192], "y": [600.0]},
            "gemm_grouped_shapes": [
                {"model": "m", "k": 4096, "n": 1536, "x": [16, 4096], "grouped": [20.0, 500.0]}
            ],
            "attention": {"x": [4096], "y": [400.0], "head_dim": 128},
            "attention_head_dims": [{"head_dim": 64, "x": [4096], "y": [300.0]}],
            "membw": {"x": [2**28, 2**30], "y": [4000.0, 4200.0]},
            "permute": {"x": [16384], "y": [2100.0]},
            "unpermute": {"x": [16384], "y": [1400.0]},
        },
    }


def test_points_follow_the_resource_model_formulas():
    base = load_cluster("h200")
    assert not base.tables  # the preset's constants alone predict
    got = {(p.table, p.x): p for p in pvm.points(raw(), base)}
    peak = base.device.peak("bf16") * 1e12
    # grouped GEMM at 4096 tokens per expert, compute-bound: peak x eff x M / (M + half)
    m, k, n, e = 4096, 4096, 1536, 8
    flops = 3 * 2 * e * m * k * n
    eff = base.gemm_efficiency * m / (m + base.grouped_gemm_half_rows)
    t = max(flops / (peak * eff), 2 * 3 * e * (k * n + m * (k + n)) / base.hbm_bytes_per_s)
    t += 3 * 5e-6
    point = got[("grouped 4096x1536 m", 4096)]
    assert point.predicted == pytest.approx(flops / t / 1e12)
    assert point.error == pytest.approx((point.predicted - 500.0) / 500.0)
    # attention at head dim 128, s = 4096: the kernel computes (s + 128) / 2 keys per query
    s = 4096
    useful = 3 * 2 * 32 * s * s * 128
    kernel = 3 * 2 * 32 * s * (s + 128) / 2 * 2 * 128
    t = kernel / (peak * base.attention_efficiency) + 3 * 5e-6
    assert got[("attention hd128", s)].predicted == pytest.approx(useful / t / 1e12)
    # head dim 64: the efficiency scaled by (64 / (64 + 96)) / (128 / (128 + 96))
    eff64 = base.attention_efficiency * (64 / 160) / (128 / 224)
    t = kernel / 2 / (peak * eff64) + 3 * 5e-6
    assert got[("attention hd64", s)].predicted == pytest.approx(useful / 2 / t / 1e12)
    assert got[("copy", 2**30)].predicted == base.device.hbm_gbps
    assert got[("permute", 16384)].predicted == pytest.approx(
        base.device.hbm_gbps * base.hbm_efficiency
    )


def test_report_and_bad_file(tmp_path, capsys):
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw()))
    assert pvm.main([str(path), "--base", "h200"]) == 0
    text = capsys.readouterr().out
    assert "median |error| per table:" in text and "grouped 4096x1536 m" in text
    # measured hbm_efficiency: pair 2 / (1/2100 + 1/1400) = 1680 GB/s over the 4200 copy
    assert "measured 0.4 (x 4200 GB/s = 1680)" in text
    bad = raw()
    del bad["compute"]["membw"]
    path.write_text(json.dumps(bad))
    assert pvm.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "membw" in err
