"""benchmarks/scaleout_check.py: the tokens per local expert of the layouts it sets side by
side, by hand (ep T k / E rows, T = mbs seq / (tp cp))."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scaleout_check as sc  # noqa: E402

from planner.calibrate.runs import run_of  # noqa: E402
from planner.parallel import ParallelConfig  # noqa: E402


def test_qwen2_folding_and_gpt_oss_run_the_same_expert_rows():
    # Qwen2-57B-A14B: 64 experts top-8; tp 2, ep 4: T = 4096 / 2, 4 x 2048 x 8 / 64 = 1024
    fold = ParallelConfig(pp=4, dp=8, tp=2, ep=4, etp=1, vp=7, micro_batch=1, num_microbatches=4)
    assert sc.expert_rows("qwen2-57b-a14b", fold, 4096) == (16, 1024.0)
    # GPT-OSS-120B id 1: 128 experts top-4; tp 1, ep 8: 8 x 4096 x 4 / 128 = 1024
    rows = sc._rows()
    for rid in sc.SHAPE_IDS:
        run = run_of(rows[rid], f"id {rid}")
        assert run.model.name == "gpt-oss-120b"
        assert sc.expert_rows(run.model.name, run.parallel, run.training.seq_len) == (16, 1024.0)
