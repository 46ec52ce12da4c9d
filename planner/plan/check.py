"""Validation of a parsed plan.json before it becomes a Plan: version, types, sizes, consistency.

`check_plan_dict(d, path)` raises SpecError with one line naming the file, the field (as a
dotted path, e.g. `stages[1].layers`) and the fix. It checks the schema_version and what the
runtime and the exports rely on: positive integer sizes, pp*dp*tp ranks numbered 0..N-1, ep
dividing dp*tp, one contiguous block of layers per stage, EP ranks in range, the types of the
model and cluster entries, the keys and types of the model's optional `numerics`
(planner.inputs.numerics.check_numerics) and `settings` (planner.plan.settings). `ranks` may
be empty (a hand-written plan without placement; `piper place` refuses such a plan); when
present it must cover every rank and give each node's ranks distinct local ranks below the
cluster's `gpus_per_node` (where the plan records it). Predicted figures, their intervals
included, are finite numbers in [0, 1e30]. Values from a fixed set (training's literal fields,
`activation_offload_modules`, `extra.dispatcher`, `extra.target`) are checked against it, and
a value quoted in an error is cut to about 80 characters (planner.inputs.shown), so every
error stays one short line. A cluster entry holding a whole profile (`levels`) is parsed as
`piper plan` wrote it (planner.inputs.clusters.cluster_from_dict); its `env` passes the Slurm
job's allow-list (planner.plan.env_names.check_env). The field lists come from
planner.plan.schema's dataclasses, so a new field is checked where it is declared. It does not
re-parse the model config (planner.inputs.models does when a command needs the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from planner.inputs.clusters import cluster_from_dict
from planner.inputs.numerics import check_numerics
from planner.inputs.shown import shown, shown_text
from planner.plan.env_names import check_env
from planner.plan.schema import (
    SCHEMA_VERSION,
    ClusterEntry,
    ModelEntry,
    ParallelPlan,
    Plan,
    Predicted,
    RankPlan,
    SolveReport,
    json_fields,
)
from planner.plan.settings import settings_from_dict
from planner.resources.layer_comm import DISPATCHERS
from planner.specs import ACTIVATION_OFFLOAD_MODULES, SpecError, TrainingSpec
from planner.targets import TARGETS

_FIX = "regenerate it with 'piper plan'"
# No plan has a size, a count or a shape above these; bounding them keeps every consumer's
# arithmetic (divisors, products, arrays) finite for any file.
MAX_SIZE = 1 << 24  # a parallel degree, micro-batches, the world
MAX_COUNT = 1 << 40  # a training integer (sequence length, batch)
MAX_VALUE = 1e30  # a predicted quantity


def _json_kind(hint: Any) -> type | tuple[type, ...]:
    """The JSON value types (as parsed by `json`) of a field annotated `hint`."""
    if get_origin(hint) in (Union, type(int | None)):
        (hint,) = [h for h in get_args(hint) if h is not type(None)]
    if hint is float:
        return (int, float)
    if hint is str or get_origin(hint) is Literal:
        return str
    if get_origin(hint) in (Mapping, dict):
        return dict
    return hint


def _hints(cls: type) -> dict[str, Any]:
    """Field name -> annotation of dataclass `cls`, in field order, for the plan.json fields."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in json_fields(cls)}


_SECTIONS = tuple(  # the objects a plan must hold: model, cluster, training, ..., solver
    f.name
    for f in fields(Plan)
    if f.default is MISSING
    and f.default_factory is MISSING
    and get_origin(get_type_hints(Plan)[f.name]) is not tuple
)
_SIZES = tuple(k for k, t in _hints(ParallelPlan).items() if t is int)
_SIZE_DEFAULTS = {f.name: f.default for f in fields(ParallelPlan) if f.default is not MISSING}
_RECOMPUTE = get_args(_hints(ParallelPlan)["recompute"])
_MODULES = get_args(get_args(_hints(ParallelPlan)["recompute_modules"])[0])
_RANK_FIELDS = tuple(_hints(RankPlan))
_RANK_DEFAULTS = {f.name: f.default for f in fields(RankPlan) if f.default is not MISSING}
_PREDICTED = tuple(k for k, t in _hints(Predicted).items() if t is float)
_EXTRA_CHOICES = {"dispatcher": DISPATCHERS, "target": tuple(TARGETS)}
_SOLVER = {k: _json_kind(t) for k, t in _hints(SolveReport).items()}
_ENTRIES = {
    "model": {k: _json_kind(t) for k, t in _hints(ModelEntry).items() if k != "settings"},
    "cluster": {k: _json_kind(t) for k, t in _hints(ClusterEntry).items() if k != "profile"},
}


class _Checker:
    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, field: str, problem: str, fix: str = _FIX) -> SpecError:
        return SpecError(f"{self.path}: field '{field}' {problem}; {fix}")

    def get(self, d: dict[str, Any], key: str, where: str, typ: type | tuple[type, ...]) -> Any:
        field = f"{where}{key}"
        if key not in d:
            raise self.fail(field, "is missing")
        value = d[key]
        if isinstance(value, bool) and typ is not bool or not isinstance(value, typ):
            raise self.fail(field, f"has the wrong type ({type(value).__name__} {shown(value)})")
        return value

    def int_at_least(
        self, d: dict[str, Any], key: str, where: str, minimum: int, maximum: int = MAX_SIZE
    ) -> int:
        value = self.get(d, key, where, int)
        if value < minimum:
            raise self.fail(f"{where}{key}", f"must be >= {minimum}, got {value}")
        if value > maximum:
            raise self.fail(f"{where}{key}", f"is {value}, above {maximum} (no cluster has that)")
        return value

    def number(self, d: dict[str, Any], key: str, where: str) -> float:
        return self.nonnegative(self.get(d, key, where, (int, float)), f"{where}{key}")

    def nonnegative(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(field, f"has the wrong type ({type(value).__name__} {shown(value)})")
        if not 0 <= value <= MAX_VALUE:  # NaN and infinities fail too
            raise self.fail(field, f"must be a number in [0, {MAX_VALUE:g}], got {str(value)[:40]}")
        return float(value)

    def items(self, d: dict[str, Any], key: str) -> list[dict[str, Any]]:
        """A list of JSON objects, e.g. `stages`."""
        values = self.get(d, key, "", list)
        for i, v in enumerate(values):
            if not isinstance(v, dict):
                raise self.fail(f"{key}[{i}]", f"must be an object, got {type(v).__name__}")
        return values

    def int_list(self, d: dict[str, Any], key: str, where: str, lo: int, hi: int) -> list[int]:
        values = self.get(d, key, where, list)
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
                raise self.fail(f"{where}{key}", f"holds {shown(v)}; every entry is an integer in "
                                f"[{lo}, {hi})")  # fmt: skip
        return values


def check_plan_dict(d: Any, path: str = "plan.json") -> None:
    """Validate a parsed plan.json (what is checked: see the module docstring).

    Args:
        d: the parsed JSON document.
        path: the file it came from, named in every error.
    Raises:
        SpecError: one line naming `path`, the field and the fix.
    """
    if not isinstance(d, dict):
        raise SpecError(f"{path}: a plan must be a JSON object, got a {type(d).__name__}; {_FIX}")
    if "schema_version" not in d:
        raise SpecError(f"{path}: missing 'schema_version'; {_FIX}")
    if d["schema_version"] != SCHEMA_VERSION:
        raise SpecError(
            f"{path}: schema_version {shown(d['schema_version'])} is not supported (this Piper "
            f"reads {SCHEMA_VERSION}); re-run 'piper plan' to regenerate it"
        )
    c = _Checker(path)
    for key in _SECTIONS:
        c.get(d, key, "", dict)
    for key, kind in (("inputs_sha256", str), ("extra", dict)):  # optional
        if key in d:
            c.get(d, key, "", kind)
    for key, allowed in _EXTRA_CHOICES.items():  # optional; the exports and the runtime read them
        if key in d.get("extra", {}) and d["extra"][key] not in allowed:
            raise c.fail(f"extra.{key}", f"is {shown(d['extra'][key])}, not one of {allowed}")
    par = d["parallel"]
    sizes = {  # a knob a plan leaves out has its default (vp, cp, etp = 1)
        k: c.int_at_least(par, k, "parallel.", 1) if k in par or k not in _SIZE_DEFAULTS
        else _SIZE_DEFAULTS[k]
        for k in _SIZES
    }  # fmt: skip
    if c.get(par, "recompute", "parallel.", str) not in _RECOMPUTE:
        raise c.fail("parallel.recompute", f"is {shown(par['recompute'])}, not one of {_RECOMPUTE}")
    if "recompute_modules" in par:
        for m in c.get(par, "recompute_modules", "parallel.", list):
            if m not in _MODULES:
                named = ", ".join(x for x in _MODULES if not str(x).startswith("budget:"))
                raise c.fail(
                    "parallel.recompute_modules",
                    f"holds {shown(m)}, not one of {named} or budget:<b> (b in 0, 0.05, ..., 1)",
                )
    _check_sizes(c, sizes)
    _check_training(c, d["training"])
    _check_stages(c, c.items(d, "stages"), sizes["pp"])
    _check_experts(c, c.items(d, "experts"), sizes["ep"])
    for section, kinds in _ENTRIES.items():
        _check_entry(c, d[section], section, kinds)
    _check_ranks(c, c.items(d, "ranks"), sizes, d["cluster"].get("gpus_per_node"))
    _check_predicted(c, d["predicted"], sizes["pp"])
    for key, kind in _SOLVER.items():
        c.get(d["solver"], key, "solver.", kind)
    if "numerics" in d["model"]:
        check_numerics(d["model"]["numerics"], f"{path}: model.numerics")
    if "settings" in d["model"]:
        settings_from_dict(d["model"]["settings"], path)
    if "env" in d["cluster"]:  # the variables the Slurm export sets in the job
        check_env(d["cluster"]["env"])
    if "levels" in d["cluster"]:  # the whole profile, as Plan.cluster_spec reads it
        cluster_from_dict(d["cluster"], source=f"{path} cluster")


_TRAINING = {f.name: t for f, t in zip(fields(TrainingSpec), get_type_hints(TrainingSpec).values(),
                                       strict=True)}  # fmt: skip


def _check_training(c: _Checker, training: dict[str, Any]) -> None:
    """The TrainingSpec fields the plan holds: JSON types, bounds, then TrainingSpec's rules."""
    kw: dict[str, Any] = {}
    for key, hint in _TRAINING.items():
        if key not in training or (training[key] is None and type(None) in get_args(hint)):
            continue
        field, value = f"training.{key}", training[key]
        if key == "extra":
            pairs = c.get(training, key, "training.", list)
            if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                       for p in pairs):  # fmt: skip
                raise c.fail(field, "must be a list of [name, value] string pairs")
            kw[key] = tuple(tuple(p) for p in pairs)
            continue
        kind = _json_kind(hint)
        value = c.get(training, key, "training.", kind)
        allowed = _literal_values(hint)
        if allowed and value not in allowed:
            raise c.fail(field, f"is {shown(value)}, not one of {allowed}")
        if key == "activation_offload_modules":
            unknown = [n for n in value.split(",") if n and n not in ACTIVATION_OFFLOAD_MODULES]
            if unknown:
                raise c.fail(field, f"names {shown(unknown[0])}, not one of "
                             f"{ACTIVATION_OFFLOAD_MODULES}")  # fmt: skip
        if kind is int and not -MAX_COUNT <= value <= MAX_COUNT:
            raise c.fail(field, f"is {str(value)[:40]}, beyond any training run")
        if kind == (int, float):
            c.nonnegative(value, field)
        kw[key] = value
    try:
        TrainingSpec(**kw)
    except SpecError as exc:
        raise SpecError(f"{c.path}: {one_line(str(exc))}; fix the plan or {_FIX}") from None


def _literal_values(hint: Any) -> tuple[Any, ...]:
    """The values a Literal annotation (optionally `| None`) allows; () for any other."""
    if get_origin(hint) in (Union, type(int | None)):
        (hint,) = [h for h in get_args(hint) if h is not type(None)]
    return get_args(hint) if get_origin(hint) is Literal else ()


def one_line(text: str) -> str:
    """`text` with each control character (a newline, a tab, ...) escaped as repr writes it,
    so a message quoting untrusted text stays one line; printable text is unchanged."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _check_entry(c: _Checker, entry: dict[str, Any], section: str, kinds: dict[str, Any]) -> None:
    """The typed fields of the model or cluster entry, where present (all are optional)."""
    for key, kind in kinds.items():
        if key in entry:
            value = c.get(entry, key, f"{section}.", kind)
            if kind is int and value < 1:
                raise c.fail(f"{section}.{key}", f"must be >= 1, got {value}")


def _check_sizes(c: _Checker, s: dict[str, int]) -> None:
    world = s["pp"] * s["dp"] * s["tp"] * s["cp"]
    if world > MAX_SIZE:
        raise c.fail("parallel", f"spans pp*dp*tp*cp = {world} ranks, above {MAX_SIZE}")
    group, experts = s["tp"] * s["cp"] * s["dp"], s["etp"] * s["ep"]
    if group % experts:
        raise c.fail("parallel.ep", f"times etp is {experts} and must divide tp*cp*dp = {group}")
    if s["edp"] != group // experts:
        raise c.fail(
            "parallel.edp", f"is {s['edp']} and must be tp*cp*dp/(etp*ep) = {group // experts}"
        )


def _check_stages(c: _Checker, stages: list[dict[str, Any]], pp: int) -> None:
    if len(stages) != pp:
        raise c.fail("stages", f"has {len(stages)} entries but parallel.pp = {pp}")
    next_layer = None
    for i, st in enumerate(stages):
        where = f"stages[{i}]."
        if c.int_at_least(st, "stage", where, 0) != i:
            raise c.fail(f"{where}stage", f"is {st['stage']}, expected {i} (stages in order)")
        layers = c.int_list(st, "layers", where, 0, 1 << 31)
        if not layers or layers != list(range(layers[0], layers[0] + len(layers))):
            raise c.fail(f"{where}layers", "must be a non-empty run of consecutive layers")
        if next_layer is not None and layers[0] != next_layer:
            raise c.fail(f"{where}layers", f"starts at {layers[0]}, expected {next_layer}")
        next_layer = layers[-1] + 1
        if "recompute_layers" in st:
            recompute = c.int_list(st, "recompute_layers", where, 0, 1 << 31)
            if not set(recompute) <= set(layers):
                raise c.fail(f"{where}recompute_layers", "must be layers of that stage")


def _check_experts(c: _Checker, experts: list[dict[str, Any]], ep: int) -> None:
    for i, e in enumerate(experts):
        where = f"experts[{i}]."
        c.int_at_least(e, "layer", where, 0)
        rank_of_expert = c.int_list(e, "rank_of_expert", where, 0, ep)
        if "slots" in e:
            _check_slots(c, c.get(e, "slots", where, list), rank_of_expert, ep, f"{where}slots")


def _check_slots(c: _Checker, slots: list[Any], rank_of_expert: list[int], ep: int, field: str):
    """`slots`: ep ascending lists of expert ids that hold every expert, rank_of_expert[e]
    being the lowest rank that holds e (planner.plan.schema.ExpertPlacement)."""
    num_e = len(rank_of_expert)
    if len(slots) != ep:
        raise c.fail(field, f"has {len(slots)} ranks but parallel.ep = {ep}")
    lowest: dict[int, int] = {}
    for r, held in enumerate(slots):
        where = f"{field}[{r}]"
        if not isinstance(held, list) or any(
            isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < num_e for x in held
        ):
            raise c.fail(where, f"must be a list of expert ids in [0, {num_e})")
        if held != sorted(set(held)):
            raise c.fail(where, "must list distinct expert ids in ascending order")
        for x in held:
            lowest.setdefault(x, r)
    for x in range(num_e):
        if x not in lowest:
            raise c.fail(field, f"holds no slot for expert {x}; every expert needs one")
        if lowest[x] != rank_of_expert[x]:
            raise c.fail(
                field, f"puts expert {x} first on rank {lowest[x]} but rank_of_expert says "
                f"{rank_of_expert[x]}; rank_of_expert is the lowest rank holding the expert"
            )  # fmt: skip


def _check_ranks(
    c: _Checker, ranks: list[dict[str, Any]], s: dict[str, int], gpus_per_node: int | None
) -> None:
    """Every rank once; on each node distinct local ranks, below `gpus_per_node` (the
    cluster entry's, when the plan records it). Node ids are the cluster's (or allocation's)
    node indices: they need not be consecutive."""
    world = s["pp"] * s["dp"] * s["tp"] * s["cp"]
    if not ranks:  # a hand-written plan may leave rank placement out (calibrate, export)
        return
    if len(ranks) != world:
        raise c.fail("ranks", f"has {len(ranks)} entries but pp*dp*tp*cp = {world}")
    bounds = {"stage": s["pp"], "dp": s["dp"], "tp": s["tp"], "ep": s["ep"], "cp": s["cp"]}
    bounds["rank"] = world
    if gpus_per_node is not None:
        bounds["local_rank"] = gpus_per_node
    for i, r in enumerate(ranks):
        for key in _RANK_FIELDS:
            if key not in r and key in _RANK_DEFAULTS:
                continue
            value = c.int_at_least(r, key, f"ranks[{i}].", 0)
            if key in bounds and value >= bounds[key]:
                where = "cluster.gpus_per_node" if key == "local_rank" else "the plan's size"
                raise c.fail(
                    f"ranks[{i}].{key}", f"is {value}; it must be < {bounds[key]} ({where})"
                )
    if sorted(r["rank"] for r in ranks) != list(range(world)):
        raise c.fail("ranks", f"must number the ranks 0..{world - 1} once each")
    holder: dict[tuple[int, int], int] = {}  # (node, local rank) -> index in ranks
    for i, r in enumerate(ranks):
        first = holder.setdefault((r["node"], r["local_rank"]), i)
        if first != i:
            raise c.fail(
                f"ranks[{i}].local_rank",
                f"is {r['local_rank']} on node {r['node']}, as ranks[{first}]'s; each node's "
                "ranks need distinct local ranks",
            )


def _check_predicted(c: _Checker, pred: dict[str, Any], pp: int) -> None:
    for key in _PREDICTED:
        c.number(pred, key, "predicted.")
    memory = c.get(pred, "memory_gib_per_stage", "predicted.", list)
    if len(memory) != pp:
        raise c.fail("predicted.memory_gib_per_stage", f"has {len(memory)} values, pp = {pp}")
    for i, gib in enumerate(memory):
        c.nonnegative(gib, f"predicted.memory_gib_per_stage[{i}]")
    if "comm_s" in pred:
        for name, seconds in c.get(pred, "comm_s", "predicted.", dict).items():
            c.nonnegative(seconds, f"predicted.comm_s.{shown_text(one_line(name))}")
    if isinstance(pred.get("intervals"), dict):  # its shape: planner.plan.io._intervals
        _check_interval_numbers(c, pred["intervals"], "predicted.intervals")


def _check_interval_numbers(c: _Checker, value: Any, field: str) -> None:
    """Every number in predicted.intervals finite and in [0, MAX_VALUE]; `source` one line."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_interval_numbers(c, item, f"{field}.{shown_text(one_line(key))}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_interval_numbers(c, item, f"{field}[{i}]")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        c.nonnegative(value, field)
    elif isinstance(value, str) and not value.isprintable():
        raise c.fail(field, f"holds a control character ({shown(value)})")
