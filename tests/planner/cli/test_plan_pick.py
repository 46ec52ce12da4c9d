"""`piper plan` says how sure its pick is and what was measured for its setting: the pick's
P(best) in plan.json and on the console (the tie line below the threshold), `--shortlist auto`
sized by the summed P(best), and the published measurement of the same setting printed as
published beside the prediction of that layout."""

from __future__ import annotations

import json
import re

import pytest

from planner.search.uncertain_rank import THRESHOLD, leading
from tests.hardening_cli import run_piper

QWEN_FP8_16 = ["--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "16", "--dtype", "fp8",
               "--global-batch", "1024", "--no-plots"]  # fmt: skip
TINY_FIXED = ["--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "2", "--seq-len", "64",
              "--global-batch", "8", "--no-plots", "--pp", "1", "--dp", "2", "--tp", "1", "--ep",
              "2", "--micro-batch", "1", "--recompute", "none", "--dispatcher", "flat",
              "--no-zero", "--no-fsdp", "--no-a2a-overlap"]  # fmt: skip


@pytest.fixture(scope="module")
def qwen_auto(tmp_path_factory):
    """Qwen3-30B-A3B in FP8 on 16 H100s (published: profiles/runs/published_runs.csv id 35,
    holdout_runs.csv ids 101-104), with a shortlist sized to P(best) 0.5."""
    out = tmp_path_factory.mktemp("pick") / "qwen"
    argv = ["plan", *QWEN_FP8_16, "--shortlist", "auto", "--shortlist-probability", "0.5",
            "--trial-steps", "5", "--out", str(out)]  # fmt: skip
    result = run_piper(argv)
    assert result.code == 0, result.stderr
    return out, result.stdout, json.loads((out / "plan.json").read_text())


def one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_plan_json_holds_the_picks_p_best(qwen_auto):
    _, _, plan = qwen_auto
    pick = plan["extra"]["pick"]
    p = [c["p_best"] for c in pick["contenders"]]
    assert sum(p) == pytest.approx(1.0, abs=1e-3)  # each rounded to 4 decimals
    assert pick["p_best"] == p[0] and 2 <= len(p) <= 12
    steps = [c["step_time_s"] for c in pick["contenders"]]
    assert steps[0] == min(steps) and max(steps) <= steps[0] * 1.15  # the window
    assert steps[0] == pytest.approx(plan["predicted"]["step_time_s"], rel=1e-6)  # the pick
    assert pick["residual_log_sd"] == pytest.approx(0.71 * 0.087, abs=1e-6)  # h100's s_loo


def test_the_console_says_the_leading_candidates_cannot_be_told_apart(qwen_auto):
    _, stdout, plan = qwen_auto
    pick = plan["extra"]["pick"]
    assert pick["p_best"] < THRESHOLD and pick["told_apart"] is False
    text = one_line(stdout)
    count = len(leading([c["p_best"] for c in pick["contenders"]], 0.9))
    assert f"the leading {count} candidates cannot be told apart (P(best) {pick['p_best']:.2f}, " \
        in text  # fmt: skip
    assert f"pick: P(best) {pick['p_best']:.2f} among the {len(pick['contenders'])} layouts" in text


def test_shortlist_auto_is_the_fewest_reaching_the_probability(qwen_auto):
    out, stdout, plan = qwen_auto
    pick = plan["extra"]["pick"]
    p = [c["p_best"] for c in pick["contenders"]]
    chosen = leading(p, 0.5)
    trials = sorted(d for d in (out / "shortlist").iterdir() if d.is_dir())
    assert len(trials) == len(chosen) == pick["shortlist_trials"] >= 2
    total = sum(p[i] for i in chosen)
    assert pick["shortlist_p_best"] == pytest.approx(total, abs=1e-3)
    assert total >= 0.5 > total - min(p[i] for i in chosen)  # one fewer would not reach it
    assert pick["shortlist_probability"] == 0.5
    md = (out / "shortlist" / "shortlist.md").read_text()
    assert "whose summed probability of being the fastest reaches 0.5" in md
    assert f"Summed P(best) of these trials: {total:.2f}" in md
    layouts = [pick["contenders"][i]["layout"] for i in chosen]
    assert all(f"| {layout} |" in md for layout in layouts)


def test_the_published_measurement_of_the_setting_is_printed_beside_the_prediction(qwen_auto):
    _, stdout, plan = qwen_auto
    text = one_line(stdout)
    per_gpu = plan["predicted"]["tokens_per_s"] / 16
    # id 35: pp1 ep16 DeepEP, 8,960 tokens/s/GPU measured, predicted 9,055 on h100
    # (results/published_runs.md, column "preset")
    assert ("published: Megatron-Bridge 26.04.01 measured 8,960 tokens/s/GPU at pp=1 dp=16 tp=1 "
            "ep=16 mb=1 m=64 recompute=none dispatcher=deepep (also 8,901 in 26.04, 8,826 in "
            "26.06; published_runs.csv id 35; holdout_runs.csv id 102, 101)") in text  # fmt: skip
    assert f"(this plan predicts {per_gpu:,.0f} for its pick; the published layout is " \
        "predicted 9,055)" in text  # fmt: skip
    assert "published: Megatron-Bridge 26.02.01 measured 9,058 tokens/s/GPU at pp=2" in text
    published = plan["extra"]["published"]
    assert [p["row_ids"] for p in published] == [["103", "104"], ["35", "102", "101"]]


def test_no_published_line_and_no_tie_line_where_there_is_none(tmp_path):
    result = run_piper(["plan", *TINY_FIXED, "--out", str(tmp_path / "tiny")])
    assert result.code == 0, result.stderr
    assert "published:" not in result.stdout and "cannot be told apart" not in result.stdout
    assert "pick: P(best) 1.00: no other layout predicted within 15% of its step" in result.stdout
    extra = json.loads((tmp_path / "tiny" / "plan.json").read_text())["extra"]
    assert "published" not in extra and extra["pick"]["p_best"] == 1.0
    as_json = run_piper(["plan", *TINY_FIXED, "--json", "--out", str(tmp_path / "j")])
    doc = json.loads(as_json.stdout)
    assert doc["pick"] == extra["pick"] and doc["published"] == []  # --json carries them


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shortlist", "3", "--shortlist-probability", "0.8"], "give --shortlist auto"),
        (["--shortlist-probability", "1.5"], "give a probability in (0, 1]"),
        (["--shortlist", "many"], "or auto"),
    ],
)
def test_bad_shortlist_flags_are_one_line_and_write_nothing(tmp_path, flags, message):
    out = tmp_path / "bad"
    result = run_piper(["plan", *TINY_FIXED, *flags, "--out", str(out)])
    assert result.code == 2 and len(result.err_lines) == 1
    assert message in result.err_lines[0] and "Traceback" not in result.stderr
    assert not out.exists()
