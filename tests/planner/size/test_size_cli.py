"""`piper size` end to end on a small model: rows per cluster and size, days from tokens/s,
the files written, and bad input as one line with exit code 2 and nothing written."""

from __future__ import annotations

import csv
import io

import pytest

from tests.hardening_cli import run_piper

TOKENS = 1e12
ARGS = [
    "size",
    "--model",
    "qwen3-30b-a3b",
    "--tokens",
    "1T",
    "--cluster",
    "h100,h800",
    "--gpus",
    "8,64",
    "--time-limit-s",
    "0.5",
    "--deadline",
    "30d",
]


@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    out = tmp_path_factory.mktemp("size") / "out"
    result = run_piper([*ARGS, "--out", str(out), "--jobs", "1"])
    assert result.code == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO((out / "sizes.csv").read_text())))
    return result, out, rows


def test_one_row_per_cluster_and_size(sized):
    _, out, rows = sized
    assert [(r["cluster"], int(r["gpus"])) for r in rows] == [
        ("h100", 8),
        ("h100", 64),
        ("h800", 8),
        ("h800", 64),
    ]
    assert sorted(p.name for p in out.iterdir()) == ["sizes.csv", "sizes.png", "summary.md"]
    assert (out / "sizes.png").read_bytes()[:4] == b"\x89PNG"


def test_days_are_tokens_over_tokens_per_s_and_failures_lengthen_them(sized):
    for r in sized[2]:
        tps, lo, hi = (float(r[k]) for k in ("tokens_per_s", "tokens_per_s_lo", "tokens_per_s_hi"))
        ideal = float(r["ideal_days"])
        assert ideal == pytest.approx(TOKENS / tps / 86400, rel=2e-5)
        days = float(r["days"])
        assert days == pytest.approx(ideal / float(r["effective_fraction"]), rel=2e-5)
        assert float(r["days_lo"]) == pytest.approx(days * tps / hi, rel=2e-5)
        assert float(r["days_hi"]) == pytest.approx(days * tps / lo, rel=2e-5)
        assert float(r["gpu_hours"]) == pytest.approx(days * 24 * int(r["gpus"]), rel=2e-5)
        assert float(r["energy_mwh"]) == pytest.approx(float(r["gpu_hours"]) * 700e-6, rel=2e-5)
        steps = float(r["checkpoint_every_s"]) / float(r["step_time_s"])
        assert int(r["checkpoint_every_steps"]) == max(1, round(steps))


def test_cost_where_a_list_price_is_on_record(sized):
    for r in sized[2]:
        if r["cluster"] == "h800":  # DeepSeek-V3's $2 per H800 GPU-hour
            assert float(r["cost_usd"]) == pytest.approx(2.0 * float(r["gpu_hours"]), rel=2e-5)
        else:
            assert r["cost_usd"] == ""


def test_summary_is_readable_and_answers_the_deadline(sized):
    result, out, rows = sized
    text = (out / "summary.md").read_text()
    assert result.stdout == text
    assert max(len(line) for line in text.splitlines()) <= 100
    meets = {
        c: min(
            (int(r["gpus"]) for r in rows if r["cluster"] == c and float(r["days"]) <= 30),
            default=None,
        )
        for c in ("h100", "h800")
    }
    lines = [line for line in text.splitlines() if "smallest size that meets it" in line]
    assert len(lines) == 2 and None not in meets.values()
    for line, gpus in zip(lines, meets.values(), strict=True):
        assert f"smallest size that meets it: {gpus} GPUs" in line
    assert any(r["pareto"] == "1" for r in rows)


def test_sizes_planned_in_two_processes_give_the_same_rows(sized, tmp_path):
    argv = [*ARGS, "--out", str(tmp_path / "out"), "--jobs", "2"]
    argv[argv.index("h100,h800")] = "h100"
    assert run_piper(argv).code == 0
    two = list(csv.DictReader(io.StringIO((tmp_path / "out" / "sizes.csv").read_text())))
    one = [r for r in sized[2] if r["cluster"] == "h100"]
    assert len(two) == len(one) == 2
    for a, b in zip(one, two, strict=True):
        assert {k: v for k, v in a.items() if k != "pareto"} == {
            k: v for k, v in b.items() if k != "pareto"
        }


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--tokens", "15Q", "--tokens '15Q'"),
        ("--deadline", "3x", "--deadline '3x'"),
        ("--gpus", "300..1000", "--gpus '300..1000'"),
        ("--price-per-gpu-hour", "-1", "--price-per-gpu-hour -1"),
        ("--storage-gbps", "0", "--storage-gbps 0"),
        ("--jobs", "0", "--jobs 0"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, flag, value, words):
    argv = ["size", "--model", "qwen3-30b-a3b", "--tokens", "1T", "--gpus", "8"]
    at = argv.index(flag) + 1 if flag in argv else None
    argv = argv[:at] + [value] + argv[at + 1 :] if at else [*argv, flag, value]
    result = run_piper([*argv, "--out", str(tmp_path / "out")])
    assert result.code == 2
    assert len(result.err_lines) == 1 and words in result.err_lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_readme_example_parses_into_a_request():
    from pathlib import Path

    from planner.cli import build_parser
    from planner.cli.size import request_of

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    block = readme.split("## Sizing a run", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    argv = block.split()
    assert argv[:2] == ["piper", "size"]
    request = request_of(build_parser(argv[1:]).parse_args(argv[1:]))
    assert request.clusters == ("h800", "h100") and request.tokens == 14.8e12
    assert request.gpus == (256, 512, 1024, 2048, 4096, 8192, 16384)
    assert request.deadline_s == 60 * 86400


def test_json_rows_match_the_csv(sized, tmp_path):
    import json

    argv = [*ARGS, "--out", str(tmp_path / "out"), "--jobs", "1", "--json", "--no-plots"]
    argv[argv.index("8,64")] = "8"
    argv[argv.index("h100,h800")] = "h100"
    result = run_piper(argv)
    assert result.code == 0
    doc = json.loads(result.stdout)
    (row,) = doc["rows"]
    csv_row = sized[2][0]
    assert (row["cluster"], row["gpus"]) == ("h100", 8)
    assert row["tokens_per_s"]["mid"] == pytest.approx(float(csv_row["tokens_per_s"]), rel=1e-5)
    assert row["days"]["hi"] == pytest.approx(float(csv_row["days_hi"]), rel=1e-5)
    assert row["goodput"]["interval_steps"] == int(csv_row["checkpoint_every_steps"])
    assert doc["clusters"][0]["price_usd"] is None and doc["out"] == str(tmp_path / "out")
