"""benchmarks/memory_ran.py: Megatron's pipeline-layout strings as layers per rank (against
the layouts' own counts), and the evidence file: every row loads, cites where its settings
come from, and applies them to the training spec."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_ran as mr  # noqa: E402


@pytest.mark.parametrize(
    ("layout", "pp", "counts"),
    [
        # DeepSeek-V3's 61 layers: 32 virtual stages, stage j on rank j mod 8
        ("Et|(tt|)*30mL", 8, [7, 8, 8, 8, 8, 8, 8, 6]),
        # 16 virtual stages over 4 ranks: rank 0 holds 4 x 4, rank 3 the last "t" + MTP + loss
        ("Et*4|(tttt|)*14tmL", 4, [16, 16, 16, 13]),
        ("Et*2|(tt|)*22t|(tt|)*7mL", 8, [8, 8, 8, 8, 8, 8, 8, 5]),
    ],
)
def test_layout_counts(layout, pp, counts):
    got = mr.layout_layer_counts(layout, pp)
    assert got == counts
    assert sum(got) == 61
    split = mr.contiguous(got)
    assert [len(s) for s in split] == counts
    assert [i for s in split for i in s] == list(range(61))


def test_evidence_rows_load_with_their_settings():
    items = mr.load_evidence(mr.EVIDENCE)
    ids = [fields["id"] for fields, _ in items]
    assert len(ids) == len(set(ids))
    for fields, run in items:
        assert fields["settings_source"], fields["id"]
        assert run.hardware in mr.CLUSTERS
        t = run.training
        assert t.optimizer_offload_fraction == float(fields["optimizer_offload_fraction"])
        assert t.precision_aware_optimizer == (fields["precision_aware_optimizer"] == "1")
        assert (t.grad_dtype or "") == fields["grad_dtype"]
        assert t.activation_offload_modules == fields["activation_offload_modules"]
        if fields["pipeline_layout"]:
            counts = mr.layout_layer_counts(fields["pipeline_layout"], run.parallel.pp)
            assert [len(s) for s in run.stage_layers] == counts
