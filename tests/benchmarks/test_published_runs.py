"""benchmarks/published_runs.py: every published row as its exact layout, the split, the rank
correlation, and which rows the resource model fits."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import published_runs as pr  # noqa: E402

from planner.inputs.clusters import load_cluster  # noqa: E402
from planner.inputs.models import load_model  # noqa: E402
from planner.resources.cost import estimate  # noqa: E402


def _rows() -> dict[str, dict[str, str]]:
    with open(pr.RUNS, newline="") as f:
        return {row["id"]: row for row in csv.DictReader(f)}


def test_accounted_split_counts_embedding_and_loss():
    # 94 layers + 2 units over 8 ranks: 12 each, the first and last rank one layer fewer
    split = pr.accounted_split(94, 8)
    assert [len(s) for s in split] == [11, 12, 12, 12, 12, 12, 12, 11]
    assert split[0][0] == 0 and split[-1][-1] == 93
    assert [len(s) for s in pr.accounted_split(61, 4)] == [15, 16, 16, 14]
    assert pr.accounted_split(5, 1) == ((0, 1, 2, 3, 4),)


def test_rows_become_their_exact_layouts():
    rows = _rows()
    r4 = pr.run_of(rows["4"])  # Qwen3-235B, tp2 pp8 vp4 ep32, DeepEP + the all-to-all overlap
    p, t = r4.parallel, r4.training
    assert (p.tp, p.pp, p.vp, p.cp, p.ep, p.etp, p.dp, p.edp) == (2, 8, 4, 1, 32, 1, 16, 1)
    assert p.num_microbatches == 2048 // 16 and p.selective_modules == ("layernorm", "moe_act")
    assert r4.dispatcher == "deepep" and t.a2a_overlap and t.zero and not t.fsdp
    r5 = pr.run_of(rows["5"])  # FSDP, full recompute, edp 32
    assert r5.training.fsdp and not r5.training.zero and r5.parallel.edp == 32
    assert r5.parallel.recompute == "full" and r5.parallel.num_microbatches == 4
    r6 = pr.run_of(rows["6"])
    assert r6.dispatcher == "flat" and (r6.parallel.pp, r6.parallel.vp) == (32, 3)
    r9 = pr.run_of(rows["9"])
    assert r9.parallel.cp == 2 and r9.metric == "TFLOPS/GPU" and r9.measured == 335
    r36 = pr.run_of(rows["36"])
    assert r36.training.dtype == "mxfp8" and load_model(rows["36"]["model"]).num_mtp_layers == 1


def test_spearman_by_hand():
    assert pr.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert pr.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # ranks (1, 2, 3, 4) vs (2, 1, 4, 3): 1 - 6 x 4 / (4 x 15) = 0.6
    assert pr.spearman([1, 2, 3, 4], [2, 1, 4, 3]) == pytest.approx(0.6)


def test_every_row_is_estimated_and_all_but_row_1_fit():
    fits = {}
    for rid, row in _rows().items():
        run = pr.run_of(row)
        est = estimate(
            load_model(row["model"]), load_cluster(pr.CLUSTERS[row["hardware"]]), run.training,
            run.parallel, stage_layers=run.stage_layers, dispatcher=run.dispatcher,
        )  # fmt: skip
        assert 0 < est.step_time_s < 1e3, rid
        fits[rid] = est.fits
    assert len(fits) == 18
    # row 1 (mbs 4): 45 GiB of state leave too little for 4 x 4 x 4096 tokens in flight
    assert [rid for rid, ok in fits.items() if not ok] == ["1"]
