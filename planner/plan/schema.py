"""plan.json: the versioned result type shared by the planner, the runtime and the exports.

One Plan type serves automatic and hand-written plans. `Plan.to_json()` writes sorted,
indented JSON with floats rounded, so equal plans are byte-identical files; `load_plan`
validates on read and names the field and the fix when something is wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from planner.plan.check import check_plan_dict
from planner.specs import ClusterSpec, ModelSpec, SpecError

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: tuple[int, ...]  # transformer layer indices, contiguous
    recompute_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ExpertPlacement:
    layer: int  # transformer layer index of an MoE layer
    rank_of_expert: tuple[int, ...]  # EP rank per expert (length E)


@dataclass(frozen=True)
class RankPlan:
    rank: int
    node: int
    local_rank: int
    stage: int
    dp: int
    tp: int
    ep: int


@dataclass(frozen=True)
class SolverReport:
    backend: str  # "cpsat" | "cbc" | "none"
    status: str  # "OPTIMAL" | "FEASIBLE" | "INFEASIBLE" | "NOT_SOLVED"
    objective: float
    bound: float
    gap: float


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    mfu: float
    tflops_per_gpu: float
    tokens_per_s: float
    bubble_fraction: float
    memory_gib_per_stage: tuple[float, ...]
    usable_memory_gib: float
    comm_s: tuple[tuple[str, float], ...] = ()  # (name, seconds), e.g. ("a2a_node", 0.12)


@dataclass(frozen=True)
class ParallelPlan:
    pp: int
    dp: int
    tp: int
    ep: int
    edp: int
    micro_batch: int
    num_microbatches: int
    recompute: str


@dataclass(frozen=True)
class Plan:
    model: dict[str, Any]  # {"name": ..., "source": ..., "config": {...normalized HF keys}}
    cluster: dict[str, Any]  # {"name": ..., "source": ..., "gpus_per_node": ..., "nodes": ...}
    training: dict[str, Any]  # TrainingSpec fields
    parallel: ParallelPlan
    stages: tuple[StagePlan, ...]
    experts: tuple[ExpertPlacement, ...]
    ranks: tuple[RankPlan, ...]
    predicted: Predicted
    solver: SolverReport
    inputs_sha256: str = ""
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["predicted"]["comm_s"] = {k: v for k, v in self.predicted.comm_s}
        return _round_floats(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def model_spec(self, where: str = "plan.json") -> ModelSpec:
        """The model the plan was made for: its embedded config, else the preset or file it
        names. The one place plan.json's model becomes a ModelSpec."""
        from planner.inputs.models import load_model, model_from_config

        entry = self.model
        name = str(entry.get("name") or "model")
        if isinstance(entry.get("config"), dict) and entry["config"]:
            return model_from_config(entry["config"], name, str(entry.get("source") or where))
        if entry.get("source") or entry.get("name"):
            return load_model(str(entry.get("source") or name))
        raise SpecError(f"{where}: 'model' has neither 'config' nor 'name'; regenerate the plan")

    def cluster_spec(self, where: str = "plan.json") -> ClusterSpec:
        """The cluster the plan was made for: the embedded profile (`piper plan` writes the
        whole of it), else the preset or file a hand-written plan names."""
        from planner.inputs.clusters import cluster_from_dict, load_cluster

        entry = self.cluster
        if "levels" in entry:
            return cluster_from_dict(dict(entry), source=f"{where} cluster")
        src = str(entry.get("source") or "")
        if src and Path(src).is_file():
            return load_cluster(src)
        if entry.get("name") or src:
            return load_cluster(str(entry.get("name") or src))
        raise SpecError(f"{where}: 'cluster' has neither 'levels' nor 'name'; regenerate the plan")


def _round_floats(obj: Any, digits: int = 9) -> Any:
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: _round_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_round_floats(v, digits) for v in obj]
    return obj


def _need(d: dict[str, Any], key: str, where: str, path: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise SpecError(f"{path}: missing '{where}{key}'; regenerate it with 'piper plan'")
    return d[key]


def plan_from_dict(d: dict[str, Any], path: str = "plan.json") -> Plan:
    """Build a Plan from parsed JSON, validating schema version and required fields."""
    check_plan_dict(d, path)  # types, sizes and consistency (planner/plan/check.py)
    version = _need(d, "schema_version", "", path)
    if version != SCHEMA_VERSION:
        raise SpecError(
            f"{path}: schema_version {version} is not supported (this Piper reads "
            f"{SCHEMA_VERSION}); re-run 'piper plan' to regenerate it"
        )
    try:
        par = _need(d, "parallel", "", path)
        parallel = ParallelPlan(**{k: par[k] for k in ParallelPlan.__dataclass_fields__})
        stages = tuple(
            StagePlan(s["stage"], tuple(s["layers"]), tuple(s.get("recompute_layers", ())))
            for s in _need(d, "stages", "", path)
        )
        experts = tuple(
            ExpertPlacement(e["layer"], tuple(e["rank_of_expert"]))
            for e in _need(d, "experts", "", path)
        )
        ranks = tuple(
            RankPlan(**{k: r[k] for k in RankPlan.__dataclass_fields__})
            for r in _need(d, "ranks", "", path)
        )
        pred = dict(_need(d, "predicted", "", path))
        pred["memory_gib_per_stage"] = tuple(pred["memory_gib_per_stage"])
        pred["comm_s"] = tuple(sorted(pred.get("comm_s", {}).items()))
        predicted = Predicted(**{k: pred[k] for k in Predicted.__dataclass_fields__})
        sol = _need(d, "solver", "", path)
        solver = SolverReport(**{k: sol[k] for k in SolverReport.__dataclass_fields__})
    except (KeyError, TypeError) as exc:
        raise SpecError(f"{path}: malformed field {exc}; regenerate it with 'piper plan'") from None
    return Plan(
        model=_need(d, "model", "", path),
        cluster=_need(d, "cluster", "", path),
        training=_need(d, "training", "", path),
        parallel=parallel,
        stages=stages,
        experts=experts,
        ranks=ranks,
        predicted=predicted,
        solver=solver,
        inputs_sha256=d.get("inputs_sha256", ""),
        schema_version=version,
        extra=d.get("extra", {}),
    )


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan.json file."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise SpecError(f"{p}: no such plan file; create one with 'piper plan --out DIR'") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return plan_from_dict(d, str(p))
