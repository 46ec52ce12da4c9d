"""profiles/evidence/*.yaml: every file loads and validates, every cluster preset maps to one,
each preset gets one range per named efficiency, and constants_outside flags the preset
values the evidence rules out (h100's fitted attention_efficiency 0.8793 among them)."""

from __future__ import annotations

import copy

import pytest
import yaml

from planner.calibrate.evidence import (
    EVIDENCE_DIR,
    EVIDENCE_OF_PRESET,
    constant_checks,
    constants_outside,
    evidence_for,
    load_evidence,
)
from planner.inputs.clusters import list_cluster_presets
from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES, SpecError

BOUNDS = {e.name: e for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES)}
STEMS = sorted(p.stem for p in EVIDENCE_DIR.glob("*.yaml"))


def test_every_preset_maps_to_an_evidence_file_that_lists_it():
    assert set(EVIDENCE_OF_PRESET) == set(list_cluster_presets())
    assert set(STEMS) == {s for s in EVIDENCE_OF_PRESET.values() if s is not None}
    for stem in STEMS:
        mapped = {p for p, s in EVIDENCE_OF_PRESET.items() if s == stem}
        assert set(load_evidence(stem).presets) == mapped, stem
    assert evidence_for("cpu-gloo") is None  # an emulation: no hardware to measure


@pytest.mark.parametrize("stem", STEMS)
def test_file_integrity(stem):
    found = load_evidence(stem)
    assert found.evidence and found.ranges
    for e in found.evidence:
        assert e.constant in BOUNDS and e.source.strip() and e.mapping.strip()
        assert e.value == e.value  # finite, not NaN
    measured = {e.constant for e in found.evidence}
    for r in found.ranges:
        bounds = BOUNDS[r.constant]
        assert bounds.low <= r.low < r.high <= bounds.high, (stem, r.constant)
        assert r.low_reason.strip() and r.high_reason.strip() and r.summary.strip()
        assert r.constant in measured or r.flags == ("no_public_evidence",), (stem, r.constant)
    for preset in found.presets:  # one range per named efficiency for every preset
        named = [r.constant for r in found.ranges if preset in r.presets]
        assert sorted(set(named)) == sorted(named), (stem, preset)
        assert {e.name for e in EFFICIENCIES} <= set(named), (stem, preset)


def test_h100_attention_above_its_evidence_is_flagged():
    r = load_evidence("h100").range_for("h100", "attention_efficiency")
    assert r is not None and r.high < 0.8793  # FA3's forward at hd128 reaches 648/989 = 0.655
    flagged = {c.constant: c for c in constants_outside("h100")}
    attention = flagged["attention_efficiency"]
    assert (attention.value, attention.status) == (0.8793, "outside")
    assert (attention.low, attention.high) == (r.low, r.high)
    # fitted values the evidence rules out are flagged; the measured NVLink rate is not
    assert flagged["hbm_efficiency"].value == 0.3
    assert flagged["grouped_gemm_half_rows"].value == 1528
    assert "scale_up_efficiency" not in flagged and "gemm_efficiency" not in flagged


def test_checks_cover_every_constant_and_mark_range_ends():
    checks = {c.constant: c for c in constant_checks("mi300x")}
    assert {e.name for e in EFFICIENCIES} <= set(checks)
    up = checks["scale_up_efficiency"]  # 0.75 = RCCL's own XGMI ceiling, the range's high end
    assert (up.value, up.high, up.status) == (0.75, 0.75, "at end")
    assert up in constants_outside("mi300x")
    assert constant_checks("cpu-gloo") == ()


def _good() -> dict:
    return yaml.safe_load((EVIDENCE_DIR / "h100.yaml").read_text())


def _unknown_constant(d):
    d["evidence"][0]["constant"] = "gemm_speed"


def _outside_bounds(d):
    d["ranges"][0]["high"] = 0.99  # gemm_efficiency's bound is 0.95


def _low_not_below_high(d):
    d["ranges"][0]["low"] = d["ranges"][0]["high"]


def _no_source(d):
    del d["evidence"][0]["source"]


def _no_evidence_behind(d):
    d["evidence"] = [e for e in d["evidence"] if e["constant"] != "gemm_efficiency"]


def _twice(d):
    d["ranges"].append(copy.deepcopy(d["ranges"][0]))


def _stray_preset(d):
    d["ranges"][0]["presets"] = ["b200"]


@pytest.mark.parametrize(
    ("break_it", "words"),
    [
        (_unknown_constant, "evidence[0].constant: unknown constant gemm_speed"),
        (_outside_bounds, "ranges[0]: gemm_efficiency range [0.7, 0.99] is not inside"),
        (_low_not_below_high, "ranges[0]: gemm_efficiency range [0.84, 0.84]"),
        (_no_source, "evidence[0].source: missing or empty"),
        (_no_evidence_behind, "ranges[0]: no evidence entry for gemm_efficiency"),
        (_twice, "h100 has two ranges for gemm_efficiency"),
        (_stray_preset, "ranges[0].presets: b200 is not in the file's presets"),
    ],
)
def test_a_broken_file_is_one_line_naming_the_field(tmp_path, break_it, words):
    data = _good()
    break_it(data)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as err:
        load_evidence(path)
    message = str(err.value)
    assert words in message and str(path) in message and "\n" not in message


def test_an_unmapped_preset_is_refused():
    with pytest.raises(SpecError, match="no evidence file is mapped"):
        evidence_for("tpu-v5")
