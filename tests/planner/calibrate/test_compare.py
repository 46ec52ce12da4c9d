"""piper calibrate PLAN METRICS: predicted vs measured by hand, the --write-profile profile,
the CLI files.

The measured side is a synthetic metrics.jsonl in the format planner/calibrate/metrics.py reads
(tests/runtime/test_run.py reads a real `piper run` metrics.jsonl with the same reader).
"""

from __future__ import annotations

import csv
import io
import json

import pytest

from planner.calibrate.compare import calibrate, estimate_plan, fit_profile, plan_inputs
from planner.calibrate.metrics import load_metrics
from planner.calibrate.report import calibration_csv
from planner.cli import main
from planner.inputs.clusters import cluster_from_dict, load_cluster
from planner.inputs.models import load_model, model_config
from planner.plan import (
    ClusterEntry,
    ExpertPlacement,
    ModelEntry,
    ParallelPlan,
    Plan,
    Predicted,
    SolveReport,
    StagePlan,
)
from planner.resources.cost import estimate
from planner.specs import GIB, SpecError, TrainingSpec


def tiny_plan(step_s=2.0, a2a_s=0.5, mem=(1.0, 1.5)) -> Plan:
    """A hand-made plan: tiny-moe on cpu-gloo, pp=2 dp=2 ep=2, 4 micro-batches."""
    model = load_model("tiny-moe")
    training = TrainingSpec(seq_len=64, global_batch=8, dtype="fp32")
    return Plan(
        model=ModelEntry(model.name, model.source, model_config(model)),
        cluster=ClusterEntry("cpu-gloo", "", gpus_per_node=2, nodes=2),
        training={k: getattr(training, k) for k in training.__dataclass_fields__},
        parallel=ParallelPlan(2, 2, 1, 2, 1, 1, 4, "none"),
        stages=(StagePlan(0, (0, 1)), StagePlan(1, (2, 3))),
        experts=(ExpertPlacement(1, (0, 0, 0, 0, 1, 1, 1, 1)),),
        ranks=(),
        predicted=Predicted(step_s, 0.1, 0.01, 256 / step_s, 0.2, mem, 3.5, (("a2a_node", a2a_s),)),
        solver=SolveReport("none", "OPTIMAL", 0.0, 0.0, 0.0),
    )


def metrics_lines(steps) -> list[dict]:
    """steps: (step_time_s, dispatch_s, combine_s, [(stage, peak_bytes, disp, comb) per rank])."""
    out = []
    for i, (t, disp, comb, ranks) in enumerate(steps):
        per_rank = [
            {
                "rank": r,
                "stage": st,
                "step_time_s": t,
                "peak_memory_bytes": pb,
                "dispatch_s": d,
                "combine_s": c,
            }
            for r, (st, pb, d, c) in enumerate(ranks)
        ]
        out.append(
            {
                "step": i,
                "loss": 5.0,
                "step_time_s": t,
                "tokens_per_s": 256 / t,
                "peak_memory_bytes": max(r[1] for r in ranks),
                "dispatch_s": disp,
                "combine_s": comb,
                "bytes_intra_node": 0,
                "bytes_inter_node": 0,
                "per_rank": per_rank,
            }
        )
    return out


RANKS = [
    (0, 1.2 * GIB, 0.2, 0.2),
    (0, 1.1 * GIB, 0.1, 0.1),
    (1, 1.4 * GIB, 0.15, 0.1),
    (1, 1.6 * GIB, 0.1, 0.1),
]


def test_components_by_hand():
    # warm-up step 0 is dropped; medians of steps 1..3: step 2.5, a2a 0.2 + 0.2 = 0.4
    rows = metrics_lines(
        [
            (9.0, 1.0, 1.0, RANKS),
            (2.4, 0.2, 0.2, RANKS),
            (2.5, 0.25, 0.15, RANKS),
            (2.6, 0.2, 0.2, RANKS),
        ]
    )
    cal = calibrate(tiny_plan(), rows, skip_steps=1)
    assert cal.steps_used == 3
    assert cal.get("step_time_s").measured == pytest.approx(2.5)
    assert cal.get("step_time_s").error == pytest.approx((2.0 - 2.5) / 2.5)
    assert cal.get("a2a_s").measured == pytest.approx(0.4)
    assert cal.get("a2a_s").error == pytest.approx(0.25)
    assert cal.get("rest_s").measured == pytest.approx(2.1)
    assert cal.get("rest_s").predicted == pytest.approx(1.5)
    # stage memory: the stage's largest rank; stage a2a: its slowest rank
    assert cal.get("memory_gib", 0).measured == pytest.approx(1.2)
    assert cal.get("memory_gib", 1).measured == pytest.approx(1.6)
    assert cal.get("memory_gib", 1).error == pytest.approx((1.5 - 1.6) / 1.6)
    assert cal.get("a2a_s", 0).measured == pytest.approx(0.4)
    assert cal.get("a2a_s", 1).measured == pytest.approx(0.25)
    assert cal.per_stage_source == "resource model"


def test_steps_a_resume_carried_over_from_another_layout_are_left_out():
    """A run resumed from another layout's checkpoint: the carried-over steps (marked
    EARLIER_LAYOUT by the runtime) measure that layout; the warm-up is dropped after them."""
    from planner.calibrate.metrics import EARLIER_LAYOUT

    earlier = [{**r, EARLIER_LAYOUT: True} for r in metrics_lines([(1.0, 0.1, 0.1, RANKS)] * 4)]
    mine = metrics_lines(
        [(9.0, 1.0, 1.0, RANKS), (2.4, 0.2, 0.2, RANKS), (2.5, 0.25, 0.15, RANKS),
         (2.6, 0.2, 0.2, RANKS)]
    )  # fmt: skip
    cal = calibrate(tiny_plan(), earlier + mine, skip_steps=1)
    assert cal.steps_used == 3
    assert cal.get("step_time_s").measured == pytest.approx(2.5)


def test_stage_a2a_prediction_is_the_resource_model_times_microbatches():
    plan = tiny_plan()
    est = estimate_plan(plan)
    cal = calibrate(plan, metrics_lines([(2.0, 0.1, 0.1, RANKS)] * 2))
    for k, st in enumerate(est.stages):
        want = 4 * sum(s for n, s in st.time_s if n.startswith("a2a"))
        assert cal.get("a2a_s", k).predicted == pytest.approx(want)


def test_fit_moves_the_prediction_to_a_run_twice_as_slow():
    plan = tiny_plan()
    model, cluster, training, parallel = plan_inputs(plan)
    est = estimate(model, cluster, training, parallel, [(0, 1), (2, 3)])
    a2a = sum(s for n, s in est.comm_s if n.startswith("a2a"))
    plan = tiny_plan(step_s=est.step_time_s, a2a_s=a2a, mem=est.memory_gib_per_stage)
    ranks = [(st, 0.6 * GIB, a2a, a2a) for st in (0, 0, 1, 1)]
    measured = 2 * est.step_time_s
    cal = calibrate(plan, metrics_lines([(measured, a2a, a2a, ranks)] * 3))
    fitted = cluster_from_dict(fit_profile(cal, cluster, plan))
    assert fitted.gemm_efficiency < cluster.gemm_efficiency
    assert fitted.framework_overhead_gib > cluster.framework_overhead_gib
    again = estimate(model, fitted, training, parallel, [(0, 1), (2, 3)])
    assert abs(again.step_time_s - measured) / measured < 0.25
    assert abs(again.step_time_s - measured) < abs(est.step_time_s - measured)


def test_cli_writes_table_csv_plot_and_fit(tmp_path, capsys):
    (tmp_path / "plan.json").write_text(tiny_plan().to_json())
    rows = metrics_lines([(2.4, 0.2, 0.2, RANKS), (2.5, 0.2, 0.2, RANKS)])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fit = tmp_path / "fit" / "cal.yaml"
    code = main(
        [
            "calibrate",
            str(tmp_path / "plan.json"),
            str(tmp_path / "metrics.jsonl"),
            "--out",
            str(tmp_path / "cal"),
            "--write-profile",
            str(fit),
        ]
    )
    assert code == 0
    assert "| step_time_s | all |" in capsys.readouterr().out
    table = list(csv.DictReader(io.StringIO((tmp_path / "cal" / "calibration.csv").read_text())))
    step = next(r for r in table if r["component"] == "step_time_s")
    assert float(step["measured"]) == pytest.approx(2.5)
    assert float(step["error_pct"]) == pytest.approx(-20.0)
    assert (tmp_path / "cal" / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    assert load_cluster(str(fit)).name == "cpu-gloo-calibrated"


def test_csv_is_deterministic():
    rows = metrics_lines([(2.4, 0.2, 0.2, RANKS)])
    a = calibration_csv(calibrate(tiny_plan(), rows))
    assert a == calibration_csv(calibrate(tiny_plan(), rows))


def test_bad_metrics_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"step": 0, "step_time_s": 1.0}\n')
    with pytest.raises(SpecError, match="line 1: missing 'dispatch_s'"):
        load_metrics(bad)
    (tmp_path / "plan.json").write_text(tiny_plan().to_json())
    assert main(["calibrate", str(tmp_path / "plan.json"), str(bad)]) == 2
    assert "missing 'dispatch_s'" in capsys.readouterr().err
    with pytest.raises(SpecError, match="no such metrics file"):
        load_metrics(tmp_path / "absent.jsonl")
