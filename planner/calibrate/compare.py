"""Predicted vs measured: compare a plan's prediction with a run's metrics.jsonl, and fit.

Predicted numbers come from plan.json (`predicted`) and, per stage, from the resource model
(`planner.resources.cost.estimate`) re-run on the plan's model, cluster, training, layout and
layer split. Measured numbers come from `piper run`'s metrics.jsonl (read by metrics.py:
one object per step with step_time_s, tokens_per_s, peak_memory_bytes, dispatch_s,
combine_s and per_rank records with rank, stage and the same keys). The first
`skip_steps` steps (warm-up) are dropped and every number is the median over the rest.

Components (error = (predicted - measured) / measured):
- step_time_s, tokens_per_s: the whole step;
- a2a_s: dispatch + combine, forward and backward, of the slowest rank (predicted: the
  `a2a_*` entries of comm_s, which cover the four all-to-alls per MoE layer per micro-batch);
- rest_s: step time minus a2a_s (compute, pipeline bubble, p2p, gradient sync, optimizer);
- per stage: memory_gib (largest rank of the stage) and a2a_s (predicted: the stage's
  all-to-all time per micro-batch, exposed and hidden behind compute, times the micro-batches).

Given a Repricing (the run used another all-to-all than the plan priced), every prediction
comes from the resource model re-run for the run's dispatcher instead of plan.json, and
`note` says so (planner.calibrate.run_settings writes both).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, fields, replace
from typing import Any

from planner.calibrate.metrics import this_layout
from planner.calibrate.run_settings import Repricing
from planner.plan.schema import Plan
from planner.resources.layer_comm import runtime_dispatcher
from planner.specs import GIB, ClusterSpec, SpecError, TrainingSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Component:
    """One predicted-vs-measured pair."""

    name: str  # "step_time_s", "a2a_s", "memory_gib", ...
    stage: int | None  # None: the whole step
    predicted: float
    measured: float
    unit: str

    @property
    def error(self) -> float:
        """(predicted - measured) / measured; 0 when both are 0."""
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Calibration:
    components: tuple[Component, ...]
    steps_used: int
    per_stage_source: str  # "resource model" or "plan.json only (<why>)"
    note: str = ""  # one line: how the run differs from what the plan priced ('' = it does not)

    def get(self, name: str, stage: int | None = None) -> Component | None:
        for c in self.components:
            if c.name == name and c.stage == stage:
                return c
        return None


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _stage_measured(steps: list[dict], stage: int) -> tuple[float, float] | None:
    """(memory GiB, a2a s) of a stage's largest rank, median over steps; None if no per_rank."""
    mem, a2a = [], []
    for d in steps:
        ranks = [r for r in d.get("per_rank", []) if r.get("stage") == stage]
        if not ranks:
            return None
        mem.append(max(r["peak_memory_bytes"] for r in ranks) / GIB)
        a2a.append(max(r["dispatch_s"] + r["combine_s"] for r in ranks))
    return _median(mem), _median(a2a)


def calibrate(
    plan: Plan,
    metrics: list[dict[str, Any]],
    skip_steps: int = 1,
    cluster: ClusterSpec | None = None,
    reprice: Repricing | None = None,
    note: str = "",
) -> Calibration:
    """Compare `plan`'s prediction with measured `metrics` (see the module docstring).

    Args:
        plan: the plan the run executed.
        metrics: metrics.jsonl objects (planner.calibrate.metrics.load_metrics).
        skip_steps: warm-up steps dropped (all are kept when fewer remain).
        cluster: re-estimate per stage on this cluster instead of the plan's.
        reprice: price the run's dispatcher instead of the plan's (the run used another);
            None keeps plan.json's prediction.
        note: the line saying how the run differs from the plan, kept in the result.
    """
    metrics = this_layout(metrics)
    steps = metrics[skip_steps:] if len(metrics) > skip_steps else metrics
    est, source = _re_estimate(plan, cluster, reprice)
    pred = plan.predicted if reprice is None or est is None else est
    step_m = _median([d["step_time_s"] for d in steps])
    a2a_m = _median([d["dispatch_s"] + d["combine_s"] for d in steps])
    a2a_p = sum(s for name, s in pred.comm_s if name.startswith("a2a"))
    tokens_m = _median([d.get("tokens_per_s", 0.0) for d in steps])
    comps = [
        Component("step_time_s", None, pred.step_time_s, step_m, "s"),
        Component("tokens_per_s", None, pred.tokens_per_s, tokens_m, "tokens/s"),
        Component("a2a_s", None, a2a_p, a2a_m, "s"),
        Component("rest_s", None, pred.step_time_s - a2a_p, step_m - a2a_m, "s"),
    ]
    stage_a2a = None if est is None else _stage_a2a(est, plan.parallel.num_microbatches)
    for k, mem_p in enumerate(pred.memory_gib_per_stage):
        measured = _stage_measured(steps, k)
        if measured is None:
            continue
        comps.append(Component("memory_gib", k, mem_p, measured[0], "GiB"))
        if stage_a2a is not None:
            comps.append(Component("a2a_s", k, stage_a2a[k], measured[1], "s"))
    return Calibration(tuple(comps), len(steps), source, note)


def _re_estimate(plan: Plan, cluster: ClusterSpec | None, reprice: Repricing | None):
    """The resource model's Estimate of the plan (None when it fails: a cluster preset the
    plan names is gone, the model cannot price a hand-written layout), and the source line. A
    model config embedded in plan.json that does not load is bad input: its SpecError goes
    up (an embedded cluster profile is checked when the plan loads)."""
    if plan.model.config:
        plan.model_spec()
    try:
        est = estimate_plan(plan, cluster, reprice)
    except (SpecError, KeyError, TypeError, ValueError, ImportError) as exc:
        log.warning("per-stage re-estimate failed: %s", exc)
        return None, f"plan.json only (re-estimate failed: {exc})"
    return est, "resource model"


def _stage_a2a(est: Any, num_microbatches: int) -> list[float]:
    """All-to-all seconds per step of each stage: exposed (time_s) and hidden behind compute
    (hidden_s) per micro-batch, as the runtime's dispatch_s + combine_s times both."""
    return [
        num_microbatches * sum(s for n, s in (*st.time_s, *st.hidden_s) if n.startswith("a2a"))
        for st in est.stages
    ]


def plan_inputs(plan: Plan, cluster: ClusterSpec | None = None):
    """(model, cluster, training, parallel) the plan was made for, rebuilt from plan.json."""

    model = plan.model_spec()
    if cluster is None:
        cluster = plan.cluster_spec()
    known = {f.name for f in fields(TrainingSpec)}
    tr = {k: v for k, v in plan.training.items() if k in known}
    if "extra" in tr:
        tr["extra"] = tuple(tuple(x) for x in tr["extra"])
    return model, cluster, TrainingSpec(**tr), plan.parallel.config()


def estimate_plan(plan: Plan, cluster: ClusterSpec | None = None, reprice: Repricing | None = None):
    """The resource model's Estimate for the plan's layout and layer split, priced as the
    plan was or as `reprice` says."""
    from planner.resources.cost import estimate

    model, cl, training, parallel = plan_inputs(plan, cluster)
    extra = plan.extra if isinstance(plan.extra, dict) else {}
    dispatcher = extra.get("dispatcher", "flat")
    if reprice is not None:
        dispatcher = reprice.dispatcher
        training = replace(training, a2a_overlap=reprice.a2a_overlap)
    return estimate(
        model,
        cl,
        training,
        parallel,
        stage_layers=[s.layers for s in plan.stages],
        recompute_layers=[s.recompute_layers for s in plan.stages],
        dispatcher=runtime_dispatcher(dispatcher),
    )


def fit_profile(cal: Calibration, cluster: ClusterSpec, plan: Plan) -> dict[str, Any]:
    """A cluster profile (YAML structure) whose constants reproduce the measurements.

    Compute: `gemm_efficiency`, `attention_efficiency` and the gemm/attention tables scale by
    predicted / measured rest_s (time ~ 1 / efficiency; rest_s also holds bubble, p2p and
    optimizer time, so this is a first-order correction). All-to-all: the `bw_gbps` of the
    levels the plan's all-to-alls cross, and their `a2a_<level>` tables, scale by predicted /
    measured a2a_s. Memory: `framework_overhead_gib` moves by the largest stage's
    measured - predicted memory. The factors are recorded under `calibration`.
    """
    from planner.inputs.clusters import cluster_from_dict, cluster_to_dict

    def factor(name: str) -> float:
        c = cal.get(name)
        return c.predicted / c.measured if c and c.measured > 0 and c.predicted > 0 else 1.0

    f_compute, f_a2a = factor("rest_s"), factor("a2a_s")
    mem = [c for c in cal.components if c.name == "memory_gib"]
    offset = max((c.measured - c.predicted for c in mem), default=0.0)
    a2a_levels = {n[len("a2a_") :] for n, _ in plan.predicted.comm_s if n.startswith("a2a_")}
    out = cluster_to_dict(cluster)
    for key in ("gemm_efficiency", "attention_efficiency"):
        out[key] = min(out[key] * f_compute, 1.0)
    out["framework_overhead_gib"] = max(out["framework_overhead_gib"] + offset, 0.0)
    for lv in out["levels"]:
        if lv["name"] in a2a_levels:
            lv["bw_gbps"] = lv["bw_gbps"] * f_a2a
    for t in out.get("tables", []):
        if t["name"].startswith(("gemm_", "attention_")):
            t["y"] = [y * f_compute for y in t["y"]]
        elif t["name"].startswith("a2a_") and t["name"][4:] in a2a_levels:
            t["y"] = [y * f_a2a for y in t["y"]]
    out["name"] = f"{cluster.name}-calibrated"
    out["source"] = f"piper calibrate of {cluster.name} against a measured run"
    out["calibration"] = {
        "compute_factor": f_compute,
        "a2a_factor": f_a2a,
        "memory_offset_gib": offset,
        "steps_used": cal.steps_used,
    }
    cluster_from_dict(out, source="calibrated profile")  # must load back
    return out
