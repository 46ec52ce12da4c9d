"""The number formatter people read (planner.numbers) and where it is used: `piper plan`'s
summary and baseline table, summary.md, `piper estimate`, rich tables."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from planner.cli import main
from planner.numbers import number, percent
from planner.outputs.console import print_table
from planner.parallel import ParallelConfig
from planner.search.baselines import outside_search
from planner.search.space import Knobs, make_space

TINY_PP2 = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "8", "--tp", "1",
            "--pp", "2", "--seq-len", "128", "--global-batch", "16"]  # fmt: skip
SCIENTIFIC = re.compile(r"\d[eE][+-]\d")


@pytest.mark.parametrize(
    ("value", "digits", "text"),
    [
        (0.009513, 4, "0.009513"),  # small values keep their digits (was 0.0 TFLOPS/GPU)
        (0.0122, 4, "0.0122"),
        (12220.4, 4, "12,220"),  # was 1.222e+04
        (3137842.7, 4, "3,137,843"),  # was 3.138e+06
        (97.58, 3, "97.6"),
        (53.53, 4, "53.53"),
        (999.96, 4, "1,000"),
        (4.0, 4, "4"),
        (0.0, 4, "0"),
        (-0.00123, 3, "-0.00123"),
        (12_345_678, 4, "12,345,678"),  # counts in full
        (np.int64(3_138_000), 4, "3,138,000"),
        (np.float64(0.5042), 4, "0.5042"),
        (None, 4, "-"),
        (float("nan"), 4, "-"),
        (2.5e-9, 3, "2.50e-09"),  # only below 1e-6 an exponent
    ],
)
def test_number_by_magnitude(value, digits, text):
    assert number(value, digits) == text


def test_percent_keeps_small_fractions_non_zero():
    assert percent(0.095) == "9.5%"
    assert percent(0.51) == "51.0%"
    assert percent(0.0001) == "0.01%"
    assert percent(0.0) == "0.0%"


def test_print_table_writes_floats_with_separators_right_aligned(capsys):
    print_table("", ("policy", "tokens/s"), [("a", 3137842.7), ("b", 0.009513)])
    body = [line.rstrip() for line in capsys.readouterr().out.splitlines()[2:] if line.strip()]
    assert body[0].endswith("3,137,843") and body[1].endswith("0.009513")
    assert len(body[0]) == len(body[1])


def test_tiny_plan_prints_readable_numbers_and_why_a_baseline_wins(tmp_path, capsys):
    assert main([*TINY_PP2, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = (tmp_path / "summary.md").read_text()
    tflops = re.search(r"\n  (\S+) TFLOPS/GPU, MFU (\S+)%", out)
    assert tflops is not None and 0.001 < float(tflops.group(1)) < 0.1  # not 0.0
    assert float(tflops.group(2)) > 0
    for text in (out, summary):
        assert not SCIENTIFIC.search(text), SCIENTIFIC.search(text)
    predicted = summary.split("## Predicted")[1].splitlines()[4]
    assert re.match(r"\| \d{2},\d{3} \| \d,\d{3} \| 0\.0\d+ \| 0\.00\d+ \|", predicted)
    xmoe = next(line for line in out.splitlines() if line.startswith("X-MoE-like"))
    speedup = float(re.search(r" (\d\.\d\d)x ", xmoe).group(1))
    assert speedup < 1.0  # the X-MoE-like pp=1 baseline beats the plan pinned to --pp 2 ...
    note = next(line for line in summary.splitlines() if line.startswith("| X-MoE-like"))
    assert note.endswith("| faster: the search excluded pp=1 (--pp 2 given) |")  # ... and says so
    uniform = next(line for line in summary.splitlines() if line.startswith("| best uniform"))
    assert "faster" not in uniform


def test_estimate_prints_small_tflops_non_zero(capsys):
    args = ["estimate", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--pp", "2", "--dp",
            "4", "--tp", "1", "--ep", "4", "--seq-len", "128", "--global-batch", "16"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    first = re.search(r"step (\S+) s, (\S+) TFLOPS/GPU", out)
    assert first is not None and float(first.group(2)) > 0.001
    line = next(x for x in out.splitlines() if x.startswith("TFLOPS per GPU"))
    assert float(line.split()[3]) > 0.001 and "0.001401 GFLOP/token" in line
    weights = next(x for x in out.splitlines() if x.split()[:1] == ["weights"]).split()
    assert float(weights[1]) > 0  # stage 0's weights in GiB, not 0.00


def test_outside_search_names_each_excluded_setting_with_its_flag():
    space = make_space(8, {"pp": 2, "tp": 1}, ("full",), max_ep=4, dispatchers=["halo"])
    par = ParallelConfig(1, 8, 1, 8, 2, 1, "none")
    assert outside_search(space, par, Knobs("none", False, "flat")) == (
        "pp=1 (--pp 2 given)",
        "recompute=none (--recompute full given)",
        "dispatcher=flat (--dispatcher halo given)",
        "ep=8 (--max-ep 4 given)",
    )
    inside = ParallelConfig(2, 4, 1, 4, 2, 1, "full")
    assert outside_search(space, inside, Knobs("zero", False, "halo")) == ()


def test_migrate_table_keeps_small_moves_non_zero(tmp_path, capsys):
    trace = _trace_csv(tmp_path)
    args = ["migrate", "--trace", trace, "--ep", "4", "--model", "tiny-moe", "--cluster",
            "cpu-gloo", "--out", str(tmp_path / "out"), "--no-plots"]  # fmt: skip
    assert main(args) == 0
    rows = {
        row["policy"]: row for row in json.loads((tmp_path / "out" / "summary.json").read_text())
    }
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("greedy swap"))
    moved, gb, transfer = line.split()[5:8]
    assert int(moved) == rows["swap"]["experts_moved"] > 0
    assert rows["swap"]["bytes_moved"] > 0 and rows["swap"]["transfer_s"] > 0
    assert float(gb) == pytest.approx(rows["swap"]["bytes_moved"] / 1e9, rel=1e-3)
    assert float(transfer) == pytest.approx(rows["swap"]["transfer_s"], rel=1e-3)
    summary = (tmp_path / "out" / "summary.md").read_text()
    md = next(x for x in summary.splitlines() if x.startswith("| greedy swap"))
    assert float(md.split("|")[5]) == pytest.approx(rows["swap"]["bytes_moved"] / 1e9, rel=1e-3)


def _trace_csv(tmp_path) -> str:
    """tiny-moe's 8 experts, layers 1-3, 5 intervals of skewed random routing."""
    rng = np.random.default_rng(0)
    lines = ["interval,layer,expert,tokens"]
    for t in range(5):
        for layer in (1, 2, 3):
            tokens = rng.multinomial(2000, np.array([8, 4, 2, 1, 1, 1, 1, 1]) / 19)
            lines += [f"{t},{layer},{e},{n}" for e, n in enumerate(tokens)]
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)
