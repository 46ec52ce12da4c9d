"""Measured runs as layouts to predict: rows of a RUNS.csv, or a `piper run` plan + metrics.

RUNS.csv has the columns of profiles/runs/published_runs.csv, one row per measured run:
required `model` (a preset name or a config.json path), `hardware` (e.g. H100, GB200),
`gpus`, `precision` (BF16, FP16, FP8, MXFP8), `seq`, `gbs`, `mbs`, `tp`, `pp`, `vp`, `cp`,
`ep`, `etp`, `recompute` (none, full, selective or selective(module,...)) and at least one of
`measured_tokens_per_s_per_gpu` / `measured_tflops_per_gpu` (a row uses its tokens/s when
given, else its TFLOPS; a value given in either must be a positive finite number); optional
`id` (distinct across rows), `source`, `note`, `measured_peak_gib`, and the software settings
`dispatcher` (flat, halo, halo-dedup, deepep; HybridEP is deepep), `a2a_overlap` (1 / 0),
`cuda_graphs` (none, partial, full), `grad_overlap`, `optimizer_dtype`, `grad_dtype`,
`master_weights`, `fsdp_hold_unsharded` and `fsdp_reduce_dtype`; where a settings column is
absent or empty the note decides as below. `stack` and `pipeline_flushes` are read by the
benchmarks only (profiles/runs/other_stacks.csv). Any other column is refused, with the
closest known name; so is a column given twice, and a control character (a newline, ...) in
any field but `note` and `source`.

How a row becomes a layout (decisions where a source is silent are marked "assumed"):
- dp = gpus / (tp pp cp); num_microbatches = gbs / (mbs dp); etp, ep, vp, cp as given;
- recompute: none, full, or selective with the row's modules (`norm` = layernorm,
  `act` = moe_act, Megatron-Core's short forms; `selective` alone = core attention);
- sharding: FSDP where the note says "FSDP on", else Megatron's distributed optimizer;
  the megatron target's conventions (planner/targets.py): 18 B per parameter (fp32 main
  gradients), fp32 Adam moments, recompute on every layer;
- dispatcher: "deepep" where the note names DeepEP or HybridEP, else "flat" (NCCL
  all-to-all; assumed where the note names none); the all-to-all overlap where the note says
  "A2A overlap"; partial CUDA graphs where the note says "CUDA graphs" (else the cluster's
  setting);
- precision: BF16 -> bf16, FP8 -> fp8 (per-tensor current scaling), MXFP8 -> mxfp8,
  FP8-BLOCKWISE -> fp8_blockwise, NVFP4 -> nvfp4, MXFP4 -> mxfp4; MTP as
  the row's model config;
- routing force-balanced (skew 1), flash attention; the router weights applied in the expert
  activation, as Megatron-Core's experts do (`gate_in_activation`);
- the layer split counts the embedding and the loss as one pipeline layer each (Megatron's
  --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split; assumed
  where the source is silent), earlier ranks taking the extra layer.

A `piper run` becomes a run from its plan.json (model, training, layout, layer split,
recompute layers, dispatcher) and metrics.jsonl (the median tokens/s and peak memory over
the steps after the warm-up, per GPU).
"""

from __future__ import annotations

import csv
import difflib
import io
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from planner.inputs.models import load_model
from planner.inputs.safe_read import read_input_bytes
from planner.inputs.shown import shown, shown_text
from planner.parallel import RECOMPUTE_MODULES, ParallelConfig, check_layout
from planner.resources.cost import Estimate, estimate
from planner.resources.layer_comm import DISPATCHERS
from planner.specs import CUDA_GRAPHS, GIB, ClusterSpec, ModelSpec, SpecError, TrainingSpec
from planner.targets import TARGETS, with_conventions

Metric = Literal["tokens/s/GPU", "TFLOPS/GPU"]
TOKENS, TFLOPS = "measured_tokens_per_s_per_gpu", "measured_tflops_per_gpu"
SIZES = ("gpus", "seq", "gbs", "mbs", "tp", "pp", "vp", "cp", "ep", "etp")
REQUIRED = ("model", "hardware", "gpus", "precision", "seq", "gbs", "mbs", "tp", "pp", "vp",
            "cp", "ep", "etp", "recompute")  # fmt: skip
OPTIONAL = ("id", "source", "note", "measured_peak_gib", "dispatcher", "a2a_overlap",
            "cuda_graphs", "grad_overlap", "optimizer_dtype", "grad_dtype",
            "master_weights", "fsdp_hold_unsharded", "fsdp_reduce_dtype")  # fmt: skip
# columns only the benchmarks read (Run.field)
INFO = ("stack", "pipeline_flushes")
COLUMNS = (*REQUIRED, TOKENS, TFLOPS, *OPTIONAL, *INFO)
FREE_TEXT = ("note", "source")  # the columns that may hold several lines
# the optimizer_dtype, grad_dtype and fsdp_reduce_dtype columns' values
STATE_DTYPES = ("fp32", "bf16")
FLAGS = {"1": True, "yes": True, "true": True, "0": False, "no": False, "false": False}
DTYPES = {"BF16": "bf16", "FP16": "fp16", "FP8": "fp8", "MXFP8": "mxfp8",
          "FP8-BLOCKWISE": "fp8_blockwise", "NVFP4": "nvfp4", "MXFP4": "mxfp4"}  # fmt: skip
SHORT_MODULES = {"norm": "layernorm", "act": "moe_act"}
EXAMPLE = "profiles/runs/published_runs.csv"


@dataclass(frozen=True)
class Run:
    """One measured run as a layout and training setup, with its measured figures.

    `label` names the run in tables ("id 4", or the metrics file); `where` names it in errors
    (the file and line). `cuda_graphs` (none, partial, full) is also in `training`; None
    keeps the cluster's setting.
    """

    label: str
    where: str
    model: ModelSpec
    hardware: str
    parallel: ParallelConfig
    training: TrainingSpec
    dispatcher: str
    stage_layers: tuple[tuple[int, ...], ...]
    metric: Metric
    measured: float
    measured_peak_gib: float | None = None
    cuda_graphs: str | None = None
    recompute_layers: tuple[tuple[int, ...], ...] | None = None
    row: Mapping[str, str] | None = None  # the CSV fields as read (None for a piper run)

    def field(self, name: str) -> str:
        """A CSV column of the run's row ('' when absent or not from a CSV)."""
        return (self.row or {}).get(name, "") or ""


def accounted_split(num_layers: int, pp: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous split of num_layers + 2 units (embedding, layers, loss) over pp ranks,
    earlier ranks taking the extra unit; the first rank's embedding and the last rank's loss
    take one unit each. With pp = 1 every layer."""
    if pp == 1:
        return (tuple(range(num_layers)),)
    base, extra = divmod(num_layers + 2, pp)
    sizes = [base + (1 if i < extra else 0) for i in range(pp)]
    sizes[0] -= 1
    sizes[-1] -= 1
    out, start = [], 0
    for n in sizes:
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


def estimate_run(run: Run, cluster: ClusterSpec) -> Estimate:
    """The resource model's prediction of the run's layout on `cluster` (the run's CUDA
    graphs setting is in its training); a SpecError names the run."""
    try:
        return estimate(
            run.model, cluster, run.training, run.parallel, stage_layers=run.stage_layers,
            recompute_layers=run.recompute_layers, dispatcher=run.dispatcher,  # type: ignore[arg-type]
        )  # fmt: skip
    except SpecError as err:
        raise SpecError(f"{run.where}: the resource model cannot price the layout: {err}") from None


def predicted_value(run: Run, est: Estimate) -> float:
    """The prediction in the run's metric (tokens/s/GPU or TFLOPS/GPU)."""
    if run.metric == "tokens/s/GPU":
        return est.tokens_per_s / run.parallel.world
    return est.tflops_per_gpu


def hardware_matches(hardware: str, cluster: ClusterSpec) -> bool:
    """A row's `hardware` (e.g. H100) names the cluster's device or the cluster itself."""
    key = hardware.strip().upper()
    return bool(key) and (key in cluster.device.name.upper() or key in cluster.name.upper())


# --- RUNS.csv --------------------------------------------------------------------------------


def load_runs(path: str | Path, allow_empty: bool = False) -> list[Run]:
    """Read and validate a RUNS.csv (module docstring); every fault is one SpecError naming
    the file, the line and the column. A header without rows is an error unless
    `allow_empty` (the runs come from elsewhere too)."""
    p = Path(path)
    if not p.exists():
        raise SpecError(f"{p}: no such runs file; give a CSV with the columns of {EXAMPLE}")
    try:  # a regular file of at most MAX_TEXT_BYTES (planner/inputs/safe_read.py)
        text = read_input_bytes(p, "runs").decode("utf-8-sig")
    except UnicodeDecodeError:
        raise SpecError(f"{p}: not a text file; RUNS.csv is comma-separated text") from None
    return parse_runs(text, str(p), allow_empty)


def parse_runs(text: str, source: str = "RUNS.csv", allow_empty: bool = False) -> list[Run]:
    """RUNS.csv text as runs, in file order (see load_runs)."""
    try:
        reader = csv.DictReader(io.StringIO(text))
        header = reader.fieldnames
        if not header:
            raise SpecError(f"{source}: empty; add the header of {EXAMPLE} and one row per run")
        _check_header(header, source)
        runs = []
        id_lines: dict[str, int] = {}  # id -> the line that gave it first
        for row in reader:
            where = f"{source} line {reader.line_num}"
            run_id = (row.get("id") or "").strip()
            if run_id:
                where += f" (id {_shown(run_id)})"
            runs.append(run_of(row, where))  # the row's own faults first
            first = id_lines.setdefault(run_id, reader.line_num) if run_id else reader.line_num
            if first != reader.line_num:
                raise SpecError(
                    f"{where}: column 'id' repeats the id of line {first}; give each run its own id"
                )
    except csv.Error as err:
        raise SpecError(f"{source}: not valid CSV ({err}); fix the quoting") from None
    if not runs and not allow_empty:
        raise SpecError(f"{source}: a header but no runs; add one row per measured run")
    return runs


def _check_header(header: list[str], source: str) -> None:
    """Every required column, a measured one, no column twice and no unknown column."""
    twice = next((c for i, c in enumerate(header) if c in header[:i]), None)
    if twice is not None:
        raise SpecError(f"{source}: column {_shown(twice, True)} is given twice; keep one")
    unknown = next((c for c in header if c not in COLUMNS), None)
    if unknown is not None:
        close = difflib.get_close_matches(unknown.strip(), COLUMNS, n=1, cutoff=0.6)
        fix = f"did you mean '{close[0]}'?" if close else f"use the columns of {EXAMPLE}"
        raise SpecError(f"{source}: unknown column {_shown(unknown, True)}; {fix}")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise SpecError(
            f"{source}: no column '{missing[0]}'; the header needs {', '.join(REQUIRED)} "
            f"(see {EXAMPLE})"
        )
    if TOKENS not in header and TFLOPS not in header:
        raise SpecError(f"{source}: no measured column; add {TOKENS} or {TFLOPS}")


def run_of(row: Mapping[str, str | None], where: str = "row") -> Run:
    """One RUNS.csv row as its exact layout, training setup and dispatcher (module
    docstring); raises SpecError naming `where` and the column at fault."""
    if None in row:
        raise SpecError(
            f"{where}: more fields than the header has columns; quote fields that hold "
            "commas (recompute, note)"
        )
    blank = next((c for c in REQUIRED if row.get(c) is None), None)
    if blank:
        raise SpecError(f"{where}: fewer fields than the header (no '{blank}'); fill the row")
    fields = {k: (v or "").strip() for k, v in row.items()}
    for column, text in fields.items():
        if column not in FREE_TEXT and not text.isprintable():
            raise SpecError(
                f"{where}: column {_shown(column, True)} holds a control character "
                f"({shown(text)}); write the field on one line"
            )
    size = {c: _positive_int(fields, c, where) for c in SIZES}
    model = _model(fields["model"], where)
    dp, mbs, gbs = _data_parallel(size, where), size["mbs"], size["gbs"]
    note = fields.get("note", "")
    recompute, modules = _recompute(fields["recompute"], where)
    parallel = _layout(where, pp=size["pp"], dp=dp, tp=size["tp"], ep=size["ep"],
                       micro_batch=mbs, num_microbatches=gbs // (mbs * dp),
                       recompute=recompute, vp=size["vp"], cp=size["cp"], etp=size["etp"],
                       recompute_modules=modules)  # fmt: skip
    fsdp = "FSDP on" in note
    lowered = note.lower()
    dispatcher = _choice(fields, "dispatcher", DISPATCHERS, where) or (
        "deepep" if "deepep" in lowered or "hybridep" in lowered else "flat"
    )
    overlap = _flag(fields, "a2a_overlap", where)
    grad_overlap = _flag(fields, "grad_overlap", where)
    master = _flag(fields, "master_weights", where)
    hold = _flag(fields, "fsdp_hold_unsharded", where)
    moments = _choice(fields, "optimizer_dtype", STATE_DTYPES, where) or "fp32"
    grads = _choice(fields, "grad_dtype", STATE_DTYPES, where)
    fsdp_reduce = _choice(fields, "fsdp_reduce_dtype", STATE_DTYPES, where)
    graphs = _choice(fields, "cuda_graphs", CUDA_GRAPHS, where)
    if graphs is None and "cuda graphs" in lowered:
        graphs = "partial"  # the notes name Megatron's per-module cuda_graph_scope
    try:
        training = with_conventions(TrainingSpec(
            seq_len=size["seq"], global_batch=gbs, dtype=_dtype(fields["precision"], where),
            zero=not fsdp, fsdp=fsdp, recompute=recompute,
            a2a_overlap=("A2A overlap" in note) if overlap is None else overlap,
            cuda_graphs=graphs,  # type: ignore[arg-type]
            grad_overlap=True if grad_overlap is None else grad_overlap,
            master_weights=True if master is None else master,
            optimizer_dtype=moments, grad_dtype=grads,  # type: ignore[arg-type]
        ), TARGETS["megatron"])  # fmt: skip
        if hold:  # FSDP2 under torch pipelining (torchtitan, NeMo AutoModel)
            training = replace(training, fsdp_hold_unsharded=True)
        if fsdp_reduce:  # FSDP2's MixedPrecisionPolicy reduce_dtype
            training = replace(training, fsdp_reduce_dtype=fsdp_reduce)
        check_layout(parallel, model, training)
    except SpecError as err:
        raise SpecError(f"{where}: {err}") from None
    split = accounted_split(model.num_layers, size["pp"])
    if any(not s for s in split):
        raise SpecError(
            f"{where}: column 'pp'={size['pp']} leaves a pipeline rank without layers "
            f"({model.num_layers} layers + embedding + loss); lower pp"
        )
    metric, measured = _measured(fields, where)
    return Run(
        label=f"id {fields['id']}" if fields.get("id") else where.rsplit(" ", 1)[-1],
        where=where, model=model, hardware=fields["hardware"], parallel=parallel,
        training=training, dispatcher=dispatcher, stage_layers=split, metric=metric,
        measured=measured,
        measured_peak_gib=_optional_positive(fields, "measured_peak_gib", where),
        cuda_graphs=graphs, row=fields,
    )  # fmt: skip


def _choice(
    fields: Mapping[str, str], column: str, choices: tuple[str, ...], where: str
) -> str | None:
    """An optional column holding one of `choices` (None when absent or empty)."""
    text = fields.get(column, "").strip().lower()
    if not text:
        return None
    if text not in choices:
        raise SpecError(
            f"{where}: column '{column}'={shown(text)} is not one of {', '.join(choices)}"
        )
    return text


def _flag(fields: Mapping[str, str], column: str, where: str) -> bool | None:
    """An optional yes/no column (1/0, yes/no, true/false; None when absent or empty)."""
    text = fields.get(column, "").strip().lower()
    if not text:
        return None
    if text not in FLAGS:
        raise SpecError(f"{where}: column '{column}'={shown(text)} must be 1 or 0 (yes or no)")
    return FLAGS[text]


def _positive_int(fields: Mapping[str, str], column: str, where: str) -> int:
    text = fields[column]
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise SpecError(f"{where}: column '{column}' must be a positive integer, got {shown(text)}")
    return value


def _number(fields: Mapping[str, str], column: str, where: str) -> float:
    text = fields[column]
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise SpecError(f"{where}: column '{column}' must be a positive number, got {shown(text)}")
    return value


def _optional_positive(fields: Mapping[str, str], column: str, where: str) -> float | None:
    return _number(fields, column, where) if fields.get(column) else None


def _measured(fields: Mapping[str, str], where: str) -> tuple[Metric, float]:
    """The row's tokens/s/GPU when given, else its TFLOPS/GPU; each one given must be a
    positive finite number, the one not used too."""
    tokens = _optional_positive(fields, TOKENS, where)
    tflops = _optional_positive(fields, TFLOPS, where)
    if tokens is not None:
        return "tokens/s/GPU", tokens
    if tflops is not None:
        return "TFLOPS/GPU", tflops
    raise SpecError(f"{where}: columns '{TOKENS}' and '{TFLOPS}' are both empty; give one")


def _shown(text: str, quoted: bool = False) -> str:
    """`text` for an error line, cut to about 80 characters (planner.inputs.shown): as is
    (in quotes when `quoted`) when printable, else its repr, so the line stays one line."""
    if not text.isprintable():
        return shown(text)
    return f"'{shown_text(text, 80)}'" if quoted else shown_text(text, 80)


def _model(name: str, where: str) -> ModelSpec:
    if not name:
        raise SpecError(f"{where}: column 'model' is empty; give a preset name or config path")
    try:
        return load_model(name)
    except SpecError as err:
        raise SpecError(f"{where}: column 'model': {err}") from None
    except OSError as exc:  # a name past the file system's limit (ENAMETOOLONG)
        raise SpecError(
            f"{where}: column 'model' {shown(name)} cannot be read ({exc.strerror}); give a "
            "preset name or config path"
        ) from None


def _dtype(text: str, where: str) -> str:
    dtype = DTYPES.get(text.upper())
    if dtype is None:
        raise SpecError(
            f"{where}: column 'precision' is {shown(text)}; use one of {', '.join(DTYPES)}"
        )
    return dtype


def _data_parallel(size: Mapping[str, int], where: str) -> int:
    dense = size["tp"] * size["pp"] * size["cp"]
    if size["gpus"] % dense:
        raise SpecError(
            f"{where}: column 'gpus'={size['gpus']} is not a multiple of tp*pp*cp={dense}; "
            "fix the layout"
        )
    dp = size["gpus"] // dense
    if size["gbs"] % (size["mbs"] * dp):
        raise SpecError(
            f"{where}: column 'gbs'={size['gbs']} is not a multiple of mbs*dp="
            f"{size['mbs'] * dp}; fix the batch or the layout"
        )
    return dp


def _recompute(text: str, where: str) -> tuple[str, tuple[str, ...]]:
    if text in ("none", "full", "selective"):
        return text, ()
    if not (text.startswith("selective(") and text.endswith(")")):
        raise SpecError(
            f"{where}: column 'recompute' is {shown(text)}; use none, full, selective or "
            "selective(module,...)"
        )
    inner = text.removeprefix("selective(").removesuffix(")")
    names = tuple(SHORT_MODULES.get(n.strip(), n.strip()) for n in inner.split(","))
    unknown = [n for n in names if n not in RECOMPUTE_MODULES]
    if unknown:
        raise SpecError(
            f"{where}: column 'recompute' names module {shown(unknown[0])}; choose from "
            f"{', '.join(RECOMPUTE_MODULES)} (or norm, act)"
        )
    return "selective", names


def _layout(where: str, **knobs) -> ParallelConfig:
    try:
        return ParallelConfig(**knobs)
    except SpecError as err:
        raise SpecError(f"{where}: {err}") from None


# --- piper run -------------------------------------------------------------------------------


def run_of_metrics(plan_path: str | Path, metrics_path: str | Path, skip_steps: int = 1) -> Run:
    """A `piper run` as a run: the plan's layout (and the dispatcher the run's run.json
    records, when it differs), the measured median tokens/s per GPU and peak memory over the
    steps after `skip_steps` warm-up steps (all kept when fewer)."""
    from planner.calibrate.compare import plan_inputs
    from planner.calibrate.metrics import load_metrics, this_layout
    from planner.calibrate.run_settings import load_run_info, repricing, run_differences
    from planner.plan import load_plan
    from planner.resources.layer_comm import runtime_dispatcher

    plan = load_plan(plan_path)
    steps = load_metrics(metrics_path)
    steps = this_layout(steps)  # without steps a resume carried over from another layout
    steps = steps[skip_steps:] if len(steps) > skip_steps else steps
    model, cluster, training, parallel = plan_inputs(plan)
    tokens = statistics.median(d["tokens_per_s"] for d in steps)
    if tokens <= 0:
        raise SpecError(f"{metrics_path}: tokens_per_s is 0 in every step; re-run 'piper run'")
    extra = plan.extra if isinstance(plan.extra, dict) else {}
    dispatcher = runtime_dispatcher(extra.get("dispatcher", "flat"))
    # a run whose run.json records another dispatcher is priced as it ran (run_settings)
    reprice = repricing(plan, run_differences(plan, load_run_info(metrics_path)))
    if reprice is not None:
        dispatcher = reprice.dispatcher
        training = replace(training, a2a_overlap=reprice.a2a_overlap)
    return Run(
        label=str(metrics_path),
        where=f"{plan_path}:{metrics_path}", model=model, hardware=cluster.name,
        parallel=parallel, training=training,
        dispatcher=dispatcher if dispatcher in DISPATCHERS else "flat",
        stage_layers=tuple(tuple(s.layers) for s in plan.stages),
        recompute_layers=tuple(tuple(s.recompute_layers) for s in plan.stages),
        metric="tokens/s/GPU", measured=tokens / parallel.world,
        measured_peak_gib=statistics.median(d["peak_memory_bytes"] for d in steps) / GIB,
    )  # fmt: skip
