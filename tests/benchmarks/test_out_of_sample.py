"""benchmarks/out_of_sample.py: the held-out stack's rows never reach the fit, the out-of-sample
block prints before the in-sample one, stacks and calibration repeats are labelled as the data
files' notes say, and benchmarks/holdout_runs.py counts those repeats apart."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import out_of_sample as oos  # noqa: E402


def test_quick_run_fits_without_the_held_out_stack(monkeypatch, capsys):
    received: list[list[str]] = []
    real_fit = oos.fit

    def recording_fit(runs, *args, **kwargs):
        received.append([r.field("id") for r in runs])
        return real_fit(runs, *args, **kwargs)

    monkeypatch.setattr(oos, "fit", recording_fit)
    oos.report(quick=True)
    out = capsys.readouterr().out

    held = {r.id for r in oos.load_rows(oos.FILES) if r.stack == oos.QUICK_STACK}
    assert held == {"2", "34", "35"}
    assert len(received) == 1  # the release block shares the stack block's fit
    assert not held & set(received[0])
    assert sorted(received[0], key=int) == ["1", "3", "4", "5", "6", "7", "8", "9", "33"]
    assert f"{oos.QUICK_STACK} held out; h100 fitted on ids 1,3,4,5,6,7,8,9,33" in out

    first_out = out.index("OUT-OF-SAMPLE 1")
    assert first_out < out.index("OUT-OF-SAMPLE 2") < out.index("IN-SAMPLE")
    closing = re.search(
        r"^  h100 +all +out-of-sample (\d\.\d+) .*\| in-sample (\d\.\d+) ", out, re.M
    )
    assert closing is not None
    # the closing out-of-sample figure is the geomean of the held-out rows printed above
    held_block = out[first_out : out.index("OUT-OF-SAMPLE 2")]
    assert re.search(r"^\s+2 gpt-oss-120b .* held out \(calibration row\)$", held_block, re.M)
    assert "in-sample" not in held_block
    ratios = [float(m) for m in re.findall(r" (\d\.\d\d)  held out", held_block)]
    assert len(ratios) == 3
    geomean = math.prod(ratios) ** (1 / 3)
    assert float(closing.group(1)) == pytest.approx(geomean, abs=0.01)
    in_block = out[out.index("IN-SAMPLE") :]
    assert len(re.findall(r"in-sample \(fitted on\)$", in_block, re.M)) == 12


def test_stacks_and_repeats_match_the_notes():
    rows = oos.load_rows()
    by_id = {r.id: r for r in rows}
    assert by_id["33"].stack == "H100 Megatron-Bridge 25.09"
    assert by_id["3"].stack == by_id["408"].stack == "H100 ModelZoo"
    assert by_id["24"].stack == "GB200 ModelZoo"
    assert by_id["401"].stack == "H100 AutoModel"
    assert by_id["406"].stack == "H100 torchtitan"
    assert by_id["36"].stack == "GB200 Megatron-Bridge 26.04.01"
    assert by_id["201"].stack == "MI250X Piper paper"
    noted = {}
    for r in rows:
        found = re.search(r"same layout as calibration id (\d+)", r.run.field("note"))
        if found:
            noted[r.id] = found.group(1)
    repeats = {r.id: r.repeat_of for r in rows if r.repeat_of}
    assert repeats == noted
    assert len(repeats) == 16 and not any(by_id[i].calibration for i in repeats)


def test_holdout_summary_counts_repeats_apart(capsys):
    import holdout_runs as hr

    from planner.calibrate.runs import load_runs

    hr.report(load_runs(hr.RUNS))
    out = capsys.readouterr().out
    assert re.search(r"^ 110 gpt-oss-120b .*  repeat of id 2$", out, re.M)
    assert re.search(r"^ 105 qwen3-30b-a3b .*a2a-ovl$", out, re.M)  # no calibration layout
    summary = out[out.index("OUT-OF-SAMPLE") :]
    assert re.search(r"^  all +20 rows ", summary, re.M)
    assert re.search(r"^  repeats +16 rows ", summary, re.M)
    assert re.search(r"^  with rep +36 rows ", summary, re.M)
    assert "target, out-of-sample rows:" in summary
