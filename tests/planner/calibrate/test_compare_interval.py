"""`piper calibrate PLAN MEASURED ...`: where each measured figure falls in the plan's 80%
interval. The oracle is the interval's own formula by hand: a plan whose intervals are built
here with known sigmas (lo, hi = mid e^(-+q sigma), q the normal 90% quantile from scipy), and
z = log(measured / predicted) / sigma for measurements placed inside, below and above. Logs
are written with the engines' own format strings (engine_logs.py)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
from scipy.stats import norm

from planner.calibrate.uncertainty import error_model
from planner.inputs.clusters import load_cluster
from planner.plan import ClusterEntry
from planner.plan.schema import Interval, Intervals
from planner.specs import GIB
from tests.hardening_cli import run_piper
from tests.planner.calibrate.engine_logs import megatron_log, titan_log
from tests.planner.calibrate.test_compare import metrics_lines, tiny_plan

SIGMA_T, SIGMA_M = 0.2, 0.1  # the hand-made intervals' log-error sds (tokens/s, memory)
Q = norm.ppf(0.9)  # two-sided 80%
SPREAD_T, SPREAD_M = math.exp(Q * SIGMA_T), math.exp(Q * SIGMA_M)
PRED_TOKENS = 128.0  # tiny_plan: 256 / 2.0 s
TOKENS_PER_STEP = 8 * 64  # tiny_plan's global batch x sequence length
LINE = re.compile(
    r"^  (?P<label>.+?) measured (?P<m>[\d,.]+) vs predicted (?P<p>[\d,.]+) "
    r"\[(?P<lo>[\d,.]+), (?P<hi>[\d,.]+)\] \(80%\): (?P<side>inside|below|above) "
    r"\(z (?P<z>[+-][\d.]+)\)$"
)


def hand_plan():
    """tiny_plan with intervals built by hand around its prediction."""
    plan = tiny_plan()
    pred = plan.predicted

    def iv(mid: float, spread: float) -> Interval:
        return Interval(mid / spread, mid, mid * spread, 0.8)

    ivs = Intervals(
        level=0.8, source="by hand", time_log_sd=SIGMA_T, param_log_sd=0.0,
        memory_log_sd=SIGMA_M, tokens_per_s=iv(pred.tokens_per_s, SPREAD_T),
        step_time_s=iv(pred.step_time_s, SPREAD_T),
        tflops_per_gpu=iv(pred.tflops_per_gpu, SPREAD_T), mfu=iv(pred.mfu, SPREAD_T),
        memory_gib_per_stage=tuple(iv(m, SPREAD_M) for m in pred.memory_gib_per_stage),
    )  # fmt: skip
    return replace(plan, predicted=replace(pred, intervals=ivs))


def write_metrics(path: Path, step_s: float, mem_gib: tuple[float, float]) -> Path:
    """Three equal steps (the first is warm-up): step time, each stage's peak."""
    ranks = [(0, mem_gib[0] * GIB, 0.1, 0.1), (1, mem_gib[1] * GIB, 0.1, 0.1)]
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = metrics_lines([(step_s, 0.1, 0.1, ranks)] * 3)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def z_of(measured: float, predicted: float, sigma: float) -> float:
    return math.log(measured / predicted) / sigma


# step time of a run inside, below and above the tokens/s interval (tokens/s = 256 / step)
CASES = {
    "inside": 2.2,
    "below": 2.0 * SPREAD_T * 1.05,  # slower than the interval's low end
    "above": 2.0 / (SPREAD_T * 1.05),
}


@pytest.fixture()
def plan_path(tmp_path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(hand_plan().to_json())
    return path


@pytest.mark.parametrize("side", list(CASES))
def test_a_run_inside_below_above_gets_that_word_and_its_z(plan_path, tmp_path, side):
    step_s = CASES[side]
    mem = (1.0 * 1.05, 1.5 * SPREAD_M * 1.02)  # stage 0 inside, stage 1 above
    metrics = write_metrics(tmp_path / "run" / "metrics.jsonl", step_s, mem)
    result = run_piper(["calibrate", str(plan_path), str(metrics)])
    assert result.code == 0, result.stderr
    lines = {m["label"]: m for ln in result.stdout.splitlines() if (m := LINE.match(ln))}
    tokens = lines["tokens/s"]
    assert tokens["side"] == side
    want_z = z_of(TOKENS_PER_STEP / 2 / step_s, PRED_TOKENS, SIGMA_T)
    assert float(tokens["z"]) == pytest.approx(want_z, abs=0.051)
    assert float(tokens["lo"]) == pytest.approx(PRED_TOKENS / SPREAD_T, rel=1e-3)
    assert float(tokens["hi"]) == pytest.approx(PRED_TOKENS * SPREAD_T, rel=1e-3)
    step = lines["step time (s)"]
    assert step["side"] == {"inside": "inside", "below": "above", "above": "below"}[side]
    assert float(step["z"]) == pytest.approx(z_of(step_s, 2.0, SIGMA_T), abs=0.051)
    assert lines["memory stage 0 (GiB)"]["side"] == "inside"
    assert lines["memory stage 1 (GiB)"]["side"] == "above"
    assert float(lines["memory stage 1 (GiB)"]["z"]) == pytest.approx(
        z_of(mem[1], 1.5, SIGMA_M), abs=0.051
    )
    assert f"against {plan_path}'s 80% intervals, from {plan_path}:" in result.stdout
    md = (metrics.parent / "calibration.md").read_text()
    assert "tokens/s measured" in md and f": {side} (z" in md


def test_json_carries_each_check_with_the_exact_z(plan_path, tmp_path):
    metrics = write_metrics(tmp_path / "run" / "metrics.jsonl", CASES["below"], (1.0, 1.5))
    result = run_piper(["calibrate", str(plan_path), str(metrics), "--json"])
    assert result.code == 0, result.stderr
    d = json.loads(result.stdout)
    checks = {(c["figure"], c["stage"]): c for c in d["measurements"][0]["checks"]}
    tokens = checks[("tokens_per_s", None)]
    measured = TOKENS_PER_STEP / 2 / CASES["below"]
    assert tokens["side"] == "below" and tokens["log_sd"] == SIGMA_T
    assert tokens["z"] == pytest.approx(z_of(measured, PRED_TOKENS, SIGMA_T), rel=1e-9)
    assert tokens["z"] < -Q  # below the interval: more than q sigmas low
    assert checks[("memory_gib", 1)]["z"] == pytest.approx(0.0, abs=1e-9)
    assert d["summary"][0] == {"kind": "tokens/s", "inside": 0, "below": 1, "above": 0,
                               "count": 1, "mean_z": tokens["z"], "level": 0.8}  # fmt: skip
    assert d["wrote"] == [str(metrics.parent / f"calibration.{x}") for x in ("csv", "md", "png")]


def test_an_old_plan_gets_its_intervals_recomputed_from_its_cluster(tmp_path):
    (tmp_path / "plan.json").write_text(tiny_plan().to_json())  # no predicted.intervals
    metrics = write_metrics(tmp_path / "m" / "metrics.jsonl", 2.5, (1.0, 1.5))
    result = run_piper(["calibrate", str(tmp_path / "plan.json"), str(metrics), "--json"])
    assert result.code == 0, result.stderr
    m = json.loads(result.stdout)["measurements"][0]
    assert (
        m["intervals_from"]
        == f"recomputed from cluster profile cpu-gloo: {tmp_path}/plan.json has none"
    )
    tokens = next(c for c in m["checks"] if c["figure"] == "tokens_per_s")
    model = error_model(load_cluster("cpu-gloo"))
    assert tokens["log_sd"] == pytest.approx(model.time_log_sd)
    q = norm.ppf(0.9) if not model.calibrated else None
    if q is not None:  # the preset records no calibration: normal quantile
        assert tokens["hi"] == pytest.approx(PRED_TOKENS * math.exp(q * model.time_log_sd))
    assert tokens["z"] == pytest.approx(z_of(256 / 2.5, PRED_TOKENS, model.time_log_sd))


def test_an_old_plan_whose_cluster_is_gone_says_so_in_one_line(tmp_path):
    plan = replace(tiny_plan(), cluster=ClusterEntry("no-such-cluster", "", 2, 2))
    (tmp_path / "plan.json").write_text(plan.to_json())
    metrics = write_metrics(tmp_path / "m" / "metrics.jsonl", 2.5, (1.0, 1.5))
    result = run_piper(["calibrate", str(tmp_path / "plan.json"), str(metrics)])
    assert result.code == 0, result.stderr
    said = [ln for ln in result.stdout.splitlines() if "no intervals" in ln]
    assert (
        len(said) == 1 and "no-such-cluster" in said[0] and "re-plan with 'piper plan'" in said[0]
    )
    assert not any(LINE.match(ln) for ln in result.stdout.splitlines())


def test_a_plan_whose_embedded_model_does_not_load_is_refused_in_one_line(tmp_path):
    """A cluster preset that is gone degrades to plan.json's own figures (above); a model
    config embedded in plan.json that does not load is bad input: exit 2, one line."""
    plan = tiny_plan()
    doc = json.loads(plan.to_json())
    if not doc["model"].get("config"):
        pytest.skip("the tiny plan embeds no model config")
    doc["model"]["config"]["hidden_size"] = "abc"
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    metrics = write_metrics(tmp_path / "m" / "metrics.jsonl", 2.5, (1.0, 1.5))
    result = run_piper(["calibrate", str(tmp_path / "plan.json"), str(metrics)])
    assert result.code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "'hidden_size' must be an integer" in result.stderr


def test_training_logs_in_place_of_metrics_and_the_summary(plan_path, tmp_path):
    metrics = write_metrics(tmp_path / "run" / "metrics.jsonl", CASES["inside"], (1.0, 1.5))
    mega = tmp_path / "megatron.log"
    mega.write_text(megatron_log((9.0, 2.0, 2.2, 2.4)))  # 1.5 GiB max allocated
    titan = tmp_path / "titan.log"
    titan.write_text(titan_log((900.0, 100.0, 120.0), (1.0, 1.0, 1.0)))
    argv = ["calibrate", str(plan_path), str(metrics), str(mega), str(titan), "--json"]
    result = run_piper(argv)
    assert result.code == 0, result.stderr
    runs = json.loads(result.stdout)
    assert [m["format"] for m in runs["measurements"]] == ["metrics", "megatron", "torchtitan"]
    # Megatron: the median elapsed time after the warm-up iteration; torchtitan: tps x 4 GPUs
    want = {"megatron": TOKENS_PER_STEP / 2.2, "torchtitan": 110.0 * 4}
    peaks = {"megatron": 1.5, "torchtitan": 1.0}
    z_tokens = [z_of(TOKENS_PER_STEP / 2 / CASES["inside"], PRED_TOKENS, SIGMA_T)]
    for m in runs["measurements"][1:]:
        checks = {c["figure"]: c for c in m["checks"]}
        tokens, peak = checks["tokens_per_s"], checks["peak_memory_gib"]
        assert tokens["measured"] == pytest.approx(want[m["format"]])
        assert tokens["z"] == pytest.approx(z_of(want[m["format"]], PRED_TOKENS, SIGMA_T))
        assert tokens["side"] == "above"  # both beyond 128 x SPREAD_T = 165.7
        assert checks["step_time_s"]["measured"] == pytest.approx(
            TOKENS_PER_STEP / want[m["format"]]
        )
        assert peak["stage"] == 1 and peak["predicted"] == 1.5  # the stage predicted largest
        assert peak["z"] == pytest.approx(z_of(peaks[m["format"]], 1.5, SIGMA_M), abs=1e-9)
        z_tokens.append(tokens["z"])
    summary = {t["kind"]: t for t in runs["summary"]}
    assert (summary["tokens/s"]["inside"], summary["tokens/s"]["above"]) == (1, 2)
    assert summary["tokens/s"]["mean_z"] == pytest.approx(sum(z_tokens) / 3)
    assert summary["memory"]["count"] == 4  # two stages of the run, one peak per log
    text = run_piper(argv[:-1])
    line = text.stdout.splitlines()[-2]
    assert line.startswith("summary over 3 measurements: tokens/s 1 inside, 0 below, 2 above of 3")


def test_log_pairs_without_fit_are_compared(plan_path, tmp_path):
    mega = tmp_path / "megatron.log"
    mega.write_text(megatron_log((9.0, 2.0, 2.2, 2.4)))
    result = run_piper(["calibrate", "--log", f"{plan_path}:{mega}"])
    assert result.code == 0, result.stderr
    assert f"{mega} (Megatron-LM) against {plan_path}'s 80% intervals" in result.stdout
    assert any(
        (m := LINE.match(ln)) and m["label"] == "tokens/s" for ln in result.stdout.splitlines()
    )


def test_bad_and_truncated_logs_are_one_line_and_write_nothing(plan_path, tmp_path):
    metrics = write_metrics(tmp_path / "run" / "metrics.jsonl", 2.2, (1.0, 1.5))
    cut = tmp_path / "cut.log"
    cut.write_text(titan_log((900.0, 100.0, 120.0), (1.0, 1.0, 1.0))[:-40])
    mega = tmp_path / "megatron.log"
    mega.write_text(megatron_log((9.0, 2.0, 2.2)))
    other = tmp_path / "other.txt"
    other.write_text("hello\n")
    cases = [
        ([str(metrics), str(cut)], "an iteration line cut short; the log is truncated"),
        ([str(mega), "--format", "torchtitan"],
         "reads as Megatron-LM output, not --format torchtitan"),
        ([str(other)], "neither a Megatron-LM log"),
        ([str(metrics), str(metrics), "--out", str(tmp_path / "o")],
         "--out and --write-profile take one"),
    ]  # fmt: skip
    for args, message in cases:
        result = run_piper(["calibrate", str(plan_path), *args])
        assert result.code == 2, (args, result.stdout)
        assert len(result.err_lines) == 1 and "Traceback" not in result.stderr, args
        assert message in result.err_lines[0], (message, result.err_lines[0])
        assert result.stdout == ""
    assert not (metrics.parent / "calibration.csv").exists()
    assert not (tmp_path / "o").exists()


def test_a_metrics_line_with_a_key_given_twice_is_one_line(tmp_path):
    from planner.calibrate.metrics import load_metrics
    from planner.specs import SpecError

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "step": 1}\n')
    with pytest.raises(SpecError) as err:
        load_metrics(path)
    assert "line 1: key 'step' is given twice; keep one" in str(err.value)
    assert "\n" not in str(err.value)
