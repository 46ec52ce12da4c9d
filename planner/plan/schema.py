"""plan.json: the versioned result type shared by the planner, the runtime and the exports.

One Plan type serves automatic and hand-written plans. `Plan.to_json()` writes sorted,
indented JSON with floats rounded, so equal plans are byte-identical files. Reading and
validating a file is planner.plan.io's job (load_plan, plan_from_dict) and
planner.plan.check's (check_plan_dict); this module holds the types only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from planner.parallel import ParallelConfig, RecomputeModule
from planner.plan.settings import ModelSettings, settings_from_dict, settings_to_dict
from planner.specs import ClusterSpec, ModelSpec, Recompute, SpecError

SCHEMA_VERSION = 1

Status = Literal["OPTIMAL", "FEASIBLE", "INFEASIBLE", "NOT_SOLVED"]

# Field metadata of a value that is kept in memory but not written to plan.json.
NOT_IN_PLAN = {"plan_json": False}


def json_fields(cls: type) -> tuple[Field, ...]:
    """The fields of dataclass `cls` that plan.json holds (all but those marked NOT_IN_PLAN)."""
    return tuple(f for f in fields(cls) if f.metadata.get("plan_json", True))


@dataclass(frozen=True)
class ModelEntry:
    """plan.json's `model`: its name, where it was read from, and everything read from it.

    `config`: the shapes, as planner.inputs.models.model_config normalizes them (a dict: it is
    the HF config); a hand-written plan may leave it empty and name a preset or a file.
    `numerics` (optional): the original config.json's keys `piper run` builds the ModelArch
    from (planner.inputs.numerics.NUMERICS_KEYS; without them, the runtime's own numerics).
    `settings` (optional): what the exports carry beyond the shapes (planner.plan.settings).
    """

    name: str = ""
    source: str = ""
    config: Mapping[str, Any] = field(default_factory=dict)
    numerics: Mapping[str, Any] = field(default_factory=dict)
    settings: ModelSettings | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "plan.json") -> ModelEntry:
        """The entry of a parsed `model` object (validated by planner.plan.check)."""
        settings = None if d.get("settings") is None else settings_from_dict(d["settings"], where)
        return cls(d.get("name", ""), d.get("source", ""), dict(d.get("config", {})),
                   dict(d.get("numerics", {})), settings)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The plan.json object; `numerics` and `settings` only when the plan has them."""
        d = {"name": self.name, "source": self.source, "config": dict(self.config)}
        if self.numerics:
            d["numerics"] = dict(self.numerics)
        if self.settings is not None:
            d["settings"] = settings_to_dict(self.settings)
        return d


@dataclass(frozen=True)
class ClusterEntry:
    """plan.json's `cluster`: the cluster profile the plan was made for and the part it uses.

    `piper plan` writes the whole profile (planner.inputs.clusters.cluster_to_dict) plus the
    counts below; a hand-written plan may hold only a name. A count that is None was not
    recorded and is left out of plan.json.
    """

    name: str = ""
    source: str = ""
    gpus_per_node: int | None = None  # devices per node
    nodes: int | None = None  # nodes of the whole cluster
    gpus: int | None = None  # devices the plan uses
    nodes_used: int | None = None  # nodes those devices span
    # Every other key as plan.json holds it: the profile's device, levels, nic_gbps, ...
    # (cluster_to_dict's structure) and an optional `env` for the Slurm export.
    profile: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterEntry:
        """The entry of a parsed `cluster` object (validated by planner.plan.check)."""
        labels = {k: d[k] for k in _CLUSTER_LABELS if k in d}
        return cls(**labels, profile={k: v for k, v in d.items() if k not in labels})

    def to_dict(self) -> dict[str, Any]:
        labels = {k: getattr(self, k) for k in _CLUSTER_LABELS}
        return {**self.profile, **{k: v for k, v in labels.items() if v is not None}}


_CLUSTER_LABELS = tuple(f.name for f in fields(ClusterEntry) if f.name != "profile")


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: tuple[int, ...]  # transformer layer indices, contiguous
    recompute_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ExpertPlacement:
    """plan.json's `experts` entry for one MoE layer: which EP rank holds which expert.

    layer: transformer layer index of an MoE layer.
    rank_of_expert: EP rank per expert (length E); with replicas, the lowest rank holding it.
    slots: the experts in each EP rank's slots (ep tuples of expert ids, each ascending, no
        expert twice on one rank): slot s of rank r is that rank's s-th local expert. Every
        expert sits in at least one slot; an expert in several ranks' slots is replicated and
        its tokens are split evenly over its replicas (in expectation; MIGRATION.md). Ranks
        may hold different numbers of slots: a total of redundant slots that ep does not
        divide goes to some ranks only (DeepSeek-V3: 288 slots for 256 experts on 64 ranks).
        Empty (the default, and what plan.json holds for a layer without replicas): one slot
        per expert, rank r holding the experts e with rank_of_expert[e] == r, ascending.
    """

    layer: int
    rank_of_expert: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of_slots(cls, layer: int, slots: Sequence[Sequence[int]]) -> ExpertPlacement:
        """The entry of per-rank slots; `slots` is left empty when it says what
        rank_of_expert alone says (one slot per expert)."""
        rank_slots = tuple(tuple(sorted(int(e) for e in held)) for held in slots)
        experts = 1 + max(e for held in rank_slots for e in held)
        rank_of_expert = tuple(
            min(r for r, held in enumerate(rank_slots) if e in held) for e in range(experts)
        )
        plain = sum(len(held) for held in rank_slots) == experts
        return cls(layer, rank_of_expert, () if plain else rank_slots)

    def rank_slots(self, ep: int) -> tuple[tuple[int, ...], ...]:
        """Each EP rank's experts, one per slot, ascending (derived when `slots` is empty)."""
        if self.slots:
            return self.slots
        return tuple(
            tuple(e for e, r in enumerate(self.rank_of_expert) if r == rank) for rank in range(ep)
        )

    @property
    def redundant_slots(self) -> int:
        """Slots beyond one per expert, over all EP ranks of the layer."""
        return sum(len(held) for held in self.slots) - len(self.rank_of_expert) if self.slots else 0

    def to_dict(self) -> dict[str, Any]:
        """The plan.json object; `slots` only when the layer has redundant slots."""
        d: dict[str, Any] = {"layer": self.layer, "rank_of_expert": list(self.rank_of_expert)}
        if self.slots:
            d["slots"] = [list(held) for held in self.slots]
        return d


@dataclass(frozen=True)
class RankPlan:
    rank: int
    node: int
    local_rank: int
    stage: int
    dp: int
    tp: int
    ep: int
    cp: int = 0  # context-parallel index (always 0 when cp = 1)


@dataclass(frozen=True)
class SolveReport:
    """Outcome of one solve; plan.json's `solver` holds the fields from backend to gap.

    objective and bound are in the formulation's original units. gap = (objective - bound) /
    max(|objective|, tiny): 0 when proven optimal, inf when there is no solution. Wall time
    goes to timings.json, not plan.json, so equal inputs give byte-identical plans.
    """

    backend: str  # "cpsat" | "cbc" | "dp" | "closed-form" | "none"
    status: Status
    objective: float
    bound: float
    gap: float
    wall_s: float = field(default=0.0, metadata=NOT_IN_PLAN)
    message: str = field(default="", metadata=NOT_IN_PLAN)  # why NOT_SOLVED / INFEASIBLE

    @property
    def has_solution(self) -> bool:
        return self.status in ("OPTIMAL", "FEASIBLE")

    def to_dict(self) -> dict[str, Any]:
        """The plan.json object: backend, status, objective, bound, gap."""
        return {f.name: getattr(self, f.name) for f in json_fields(SolveReport)}


@dataclass(frozen=True)
class Interval:
    """A predicted figure `mid` with the range [lo, hi] that holds the measured value with
    probability `level` under the profile's error model (planner/calibrate/uncertainty.py)."""

    lo: float
    mid: float
    hi: float
    level: float = 0.8

    def contains(self, value: float) -> bool:
        return self.lo <= value <= self.hi


@dataclass(frozen=True)
class Intervals:
    """plan.json's optional `predicted.intervals`: every predicted figure's interval at one
    level, the log-error standard deviations behind them and where they come from.

    In plan.json each figure is its [lo, hi] pair (the mid is the figure in `predicted`):
    {"level", "source", "time_log_sd", "param_log_sd", "memory_log_sd", "tokens_per_s",
    "step_time_s", "tflops_per_gpu", "mfu": [lo, hi], "memory_gib_per_stage": [[lo, hi], ...],
    "memory_may_not_fit_per_stage": [bool, ...] (optional: hi > the device memory)}.
    """

    level: float
    source: str  # one line: what calibration the profile records (describe_source)
    time_log_sd: float  # sd of log(measured / predicted) tokens/s, the constants' part included
    param_log_sd: float  # the fitted constants' part of time_log_sd (0 without a covariance)
    memory_log_sd: float  # sd of log(measured / predicted) peak memory per stage
    tokens_per_s: Interval
    step_time_s: Interval
    tflops_per_gpu: Interval
    mfu: Interval
    memory_gib_per_stage: tuple[Interval, ...]
    # per stage: the memory interval's upper end exceeds the device memory (empty: not judged)
    memory_may_not_fit: tuple[bool, ...] = ()

    FIGURES = ("tokens_per_s", "step_time_s", "tflops_per_gpu", "mfu")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "level": self.level, "source": self.source, "time_log_sd": self.time_log_sd,
            "param_log_sd": self.param_log_sd, "memory_log_sd": self.memory_log_sd,
        }  # fmt: skip
        for name in self.FIGURES:
            iv = getattr(self, name)
            d[name] = [iv.lo, iv.hi]
        d["memory_gib_per_stage"] = [[iv.lo, iv.hi] for iv in self.memory_gib_per_stage]
        if self.memory_may_not_fit:
            d["memory_may_not_fit_per_stage"] = list(self.memory_may_not_fit)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], predicted: Mapping[str, Any]) -> Intervals:
        """The block back, the mids from `predicted` (plan.json's predicted object); the
        reader (planner.plan.io) has checked its types and sizes."""
        level = float(d["level"])

        def pair(lo_hi: Sequence[float], mid: float) -> Interval:
            return Interval(float(lo_hi[0]), float(mid), float(lo_hi[1]), level)

        figures = {n: pair(d[n], predicted[n]) for n in cls.FIGURES}
        memory = tuple(
            pair(lo_hi, mid)
            for lo_hi, mid in zip(d["memory_gib_per_stage"], predicted["memory_gib_per_stage"],
                                  strict=True)
        )  # fmt: skip
        return cls(level, str(d["source"]), float(d["time_log_sd"]), float(d["param_log_sd"]),
                   float(d["memory_log_sd"]), memory_gib_per_stage=memory, **figures,
                   memory_may_not_fit=tuple(d.get("memory_may_not_fit_per_stage", ())))  # fmt: skip


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
    intervals: Intervals | None = field(default=None, metadata=NOT_IN_PLAN)  # written apart

    def to_dict(self) -> dict[str, Any]:
        """plan.json's `predicted`; `intervals` only when the plan has them."""
        d = {f.name: getattr(self, f.name) for f in json_fields(Predicted)}
        d["memory_gib_per_stage"] = list(self.memory_gib_per_stage)
        d["comm_s"] = dict(self.comm_s)
        if self.intervals is not None:
            d["intervals"] = self.intervals.to_dict()
        return d


@dataclass(frozen=True)
class ParallelPlan:
    """plan.json's `parallel`: the layout (planner.parallel.ParallelConfig) and edp."""

    pp: int
    dp: int
    tp: int
    ep: int
    edp: int
    micro_batch: int
    num_microbatches: int
    recompute: Recompute
    vp: int = 1
    cp: int = 1
    etp: int = 1
    recompute_modules: tuple[RecomputeModule, ...] = ()

    @classmethod
    def of(cls, par: ParallelConfig) -> ParallelPlan:
        """The plan.json entry of a layout."""
        return cls(
            par.pp, par.dp, par.tp, par.ep, par.edp, par.micro_batch, par.num_microbatches,
            par.recompute, par.vp, par.cp, par.etp, par.recompute_modules,
        )  # fmt: skip

    def config(self) -> ParallelConfig:
        """The layout as a ParallelConfig (its rules checked again)."""
        return ParallelConfig(
            self.pp, self.dp, self.tp, self.ep, self.micro_batch, self.num_microbatches,
            self.recompute, self.vp, self.cp, self.etp, self.recompute_modules,
        )  # fmt: skip


@dataclass(frozen=True)
class Plan:
    model: ModelEntry
    cluster: ClusterEntry
    training: dict[str, Any]  # TrainingSpec fields
    parallel: ParallelPlan
    stages: tuple[StagePlan, ...]
    experts: tuple[ExpertPlacement, ...]
    ranks: tuple[RankPlan, ...]
    predicted: Predicted
    solver: SolveReport
    inputs_sha256: str = ""
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "training": self.training,
            "parallel": asdict(self.parallel),
            "stages": [asdict(s) for s in self.stages],
            "experts": [e.to_dict() for e in self.experts],
            "ranks": [asdict(r) for r in self.ranks],
            "predicted": self.predicted.to_dict(),
            "solver": self.solver.to_dict(),
            "inputs_sha256": self.inputs_sha256,
            "schema_version": self.schema_version,
            "extra": self.extra,
        }
        return round_floats(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def model_spec(self, where: str = "plan.json") -> ModelSpec:
        """The model the plan was made for: its embedded config, else the preset or file it
        names. The one place plan.json's model becomes a ModelSpec."""
        from planner.inputs.models import load_model, model_from_config

        entry = self.model
        if entry.config:
            name = entry.name or "model"
            return model_from_config(dict(entry.config), name, entry.source or where)
        if entry.source or entry.name:
            return load_model(entry.source or entry.name)
        raise SpecError(f"{where}: 'model' has neither 'config' nor 'name'; regenerate the plan")

    def cluster_spec(self, where: str = "plan.json") -> ClusterSpec:
        """The cluster the plan was made for: the embedded profile (`piper plan` writes the
        whole of it), else the preset or file a hand-written plan names."""
        from planner.inputs.clusters import cluster_from_dict, load_cluster

        entry = self.cluster
        if "levels" in entry.profile:
            return cluster_from_dict(entry.to_dict(), source=f"{where} cluster")
        if entry.source and Path(entry.source).is_file():
            return load_cluster(entry.source)
        if entry.name or entry.source:
            return load_cluster(entry.name or entry.source)
        raise SpecError(f"{where}: 'cluster' has neither 'levels' nor 'name'; regenerate the plan")


def round_floats(obj: Any, digits: int = 9) -> Any:
    """Every float in `obj` (dicts, lists, tuples) to `digits` significant digits, as plan.json
    stores them."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: round_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [round_floats(v, digits) for v in obj]
    return obj
