"""size_sweep(): plan every candidate size on every cluster and price the run at each.

For each cluster and size the planner itself (planner.search.make_plan) chooses the layout, with
the model and cluster read once per process, one evaluator per process (its caches shared by the
sizes it plans) and short IP time limits; sizes may be planned in parallel processes. Each
row carries tokens/s with its interval (planner.calibrate: the profile's error model), the days
to train the tokens without and with failures (planner.size.goodput), GPU-hours, cost and
energy with their intervals, and its flags. Then the Pareto set of days vs cost (GPU-hours
where some row has no price) and, per cluster, the smallest size that meets the deadline.
planner/SIZING.md describes every figure.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from planner.calibrate.error_bars import plan_intervals_of
from planner.inputs.clusters import check_dtype, load_cluster, with_nodes
from planner.inputs.models import load_model
from planner.ip.solvers import SolverOptions
from planner.plan.schema import Interval, Plan
from planner.search.advice import memory_floor_message
from planner.search.evaluator import Evaluator
from planner.search.make_plan import make_plan
from planner.search.model_evaluator import default_evaluator
from planner.search.rows import describe
from planner.size.goodput import Goodput, checkpoint_cost, goodput, state_bytes
from planner.size.request import (
    DEFAULT_SIZES,
    MAX_DEFAULT_GPUS,
    TARGET_CHECKPOINT_MODE,
    SizeRequest,
    batch_at,
    device_power_w,
    list_price,
)
from planner.size.rows import SizeRow, flags_of, pareto, scaled
from planner.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec
from planner.targets import (
    DEFAULT_MEMORY_MARGIN,
    Target,
    default_target,
    get_target,
    memory_margin_gib,
    with_conventions,
)


@dataclass(frozen=True)
class ClusterNote:
    """Per cluster: its price per GPU-hour and power (with sources, or None), the target and
    save mode priced, and the smallest size that meets the deadline at the estimate and at the
    upper end of its days band (None: none does, or no deadline)."""

    cluster: str
    price_usd: float | None
    price_source: str
    power_w: float | None
    power_source: str
    target: str
    checkpoint_mode: str
    meets_deadline: int | None
    meets_deadline_hi: int | None


@dataclass(frozen=True)
class SizeReport:
    """Everything `piper size` writes: the request, one row per cluster and size (clusters in
    the order given, sizes ascending), one note per cluster, the model's checkpoint bytes."""

    request: SizeRequest
    model: str
    rows: tuple[SizeRow, ...]
    clusters: tuple[ClusterNote, ...]
    state_bytes: float


def size_sweep(
    request: SizeRequest, progress: Callable[[str], None] | None = None, jobs: int = 1
) -> SizeReport:
    """Plan and price every (cluster, size) of `request`.

    Args:
        request: the question (every cluster is read and checked before any size is planned).
        progress: told "CLUSTER: N GPUs" as each size is done.
        jobs: sizes planned at once, each in its own process (1: in this process, one evaluator
            shared by every size). The rows do not depend on it.
    Returns:
        SizeReport: rows per cluster in the order given, sizes ascending.
    """
    model = load_model(request.model)
    tasks: list[_Task] = []
    for name in request.clusters:
        base = load_cluster(name)
        check_dtype(base, request.dtype, name)
        target = get_target(request.target or default_target(base))
        sizes = request.gpus or default_sizes(model, base, _training(request, base, 1), target)
        mode = request.failures.mode or TARGET_CHECKPOINT_MODE[target.name]
        tasks += [_Task(name, target.name, gpus, sizes[0], mode) for gpus in sizes]
    found = _run(request, tasks, jobs, progress)
    rows: list[SizeRow] = []
    notes = []
    state = 0.0
    for name in request.clusters:
        base, target = (
            load_cluster(name),
            get_target(next(t.target for t in tasks if t.cluster == name)),
        )
        mine = flags_of([r for r, t in zip(found, tasks, strict=True) if t.cluster == name],
                        request.min_mfu)  # fmt: skip
        rows.extend(mine)
        training = with_conventions(_training(request, base, 1), target)
        state = max(state, state_bytes(model, training))
        mode = next(t.mode for t in tasks if t.cluster == name)
        notes.append(_note(request, base, target, mode, mine))
    return SizeReport(request, model.name, tuple(pareto(rows)), tuple(notes), state)


@dataclass(frozen=True)
class _Task:
    """One size of one cluster to plan (what a worker process is sent)."""

    cluster: str
    target: str
    gpus: int
    smallest: int
    mode: str


def _run(
    request: SizeRequest, tasks: Sequence[_Task], jobs: int, progress: Callable[[str], None] | None
) -> list[SizeRow]:
    """The row of every task, in order: here, or over `jobs` spawned processes (spawn, not fork:
    the solvers' threads do not survive a fork)."""
    done = progress or (lambda _text: None)
    if jobs <= 1 or len(tasks) <= 1:
        out = []
        for task in tasks:
            out.append(plan_task(request, task))
            done(f"{task.cluster}: {task.gpus} GPUs")
        return out
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=context) as pool:
        futures = [pool.submit(plan_task, request, task) for task in tasks]
        try:
            for future, task in zip(futures, tasks, strict=True):
                future.result()
                done(f"{task.cluster}: {task.gpus} GPUs")
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return [f.result() for f in futures]


@functools.cache
def _loaded(model: str, cluster: str) -> tuple[ModelSpec, ClusterSpec, Evaluator]:
    """The model, the cluster and one evaluator, read once per process."""
    return load_model(model), load_cluster(cluster), default_evaluator()


def plan_task(request: SizeRequest, task: _Task) -> SizeRow:
    """The row of one size of one cluster: its plan, priced (no flags, not yet on the Pareto
    set)."""
    model, base, evaluator = _loaded(request.model, task.cluster)
    target = get_target(task.target)
    return _size_row(request, model, base, target, task.gpus, task.smallest, task.mode, evaluator)


def default_sizes(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, target: Target
) -> tuple[int, ...]:
    """DEFAULT_SIZES powers of two from the first at least twice the fewest GPUs that hold the
    model's state fully sharded (activations and replicas need about as much again) and at
    least one node, up to MAX_DEFAULT_GPUS."""
    training = with_conventions(training, target)
    least = cluster.gpus_per_node
    for k in range(0, 24):
        if not memory_floor_message(model, cluster, training, 2**k):
            least = max(least, 2 * 2**k)
            break
    lo = 2 ** math.ceil(math.log2(least))
    sizes = [lo * 2**k for k in range(DEFAULT_SIZES) if lo * 2**k <= MAX_DEFAULT_GPUS]
    return tuple(sizes) or (MAX_DEFAULT_GPUS,)


def _training(request: SizeRequest, cluster: ClusterSpec, batch: int) -> TrainingSpec:
    margin = memory_margin_gib(
        request.memory_margin or DEFAULT_MEMORY_MARGIN,
        cluster.device.memory_gib,
        cluster.framework_overhead_gib,
    )
    return TrainingSpec(
        seq_len=request.seq_len,
        global_batch=batch,
        dtype=request.dtype,  # type: ignore[arg-type]
        memory_margin_gib=margin,
    )


def _cluster_of(base: ClusterSpec, gpus: int) -> ClusterSpec:
    """The preset, grown to whole nodes holding `gpus` when it is smaller (as --nodes)."""
    if gpus <= base.total_gpus:
        return base
    return with_nodes(base, -(-gpus // base.gpus_per_node))


def _size_row(
    request: SizeRequest,
    model: ModelSpec,
    base: ClusterSpec,
    target: Target,
    gpus: int,
    smallest: int,
    mode: str,
    evaluator: Evaluator,
) -> SizeRow:
    batch, capped = batch_at(request, gpus, smallest)
    cluster = _cluster_of(base, gpus)
    training = _training(request, cluster, batch)
    empty = SizeRow(cluster=base.name, gpus=gpus, global_batch=batch, batch_capped=capped)
    floor = memory_floor_message(model, cluster, with_conventions(training, target), gpus)
    if floor:  # the planner's refusal, without its prefix and the --gpus advice
        return replace(empty, note=_reason(floor))
    options = SolverOptions(request.solver, request.time_limit_s, 1, request.seed)
    try:
        result = make_plan(
            model, cluster, training, gpus, None, options, evaluator=evaluator, target=target
        )
    except SpecError as exc:
        return replace(empty, note=_reason(str(exc)))
    if result.plan is None:
        if result.interrupted:  # Ctrl-C: stop the sweep; nothing is written
            raise KeyboardInterrupt
        return replace(empty, note=_reason(result.message))
    state = state_bytes(model, with_conventions(training, target))
    return _priced(request, cluster, result.plan, empty, mode, state)


def _reason(message: str) -> str:
    """The planner's one-line refusal without its "plan: " prefix and its "try ..." advice
    (sizes are the sweep's to choose)."""
    kept = [
        part for part in message.removeprefix("plan: ").split("; ") if not part.startswith("try ")
    ]
    return "; ".join(kept)


def _priced(
    request: SizeRequest, cluster: ClusterSpec, plan: Plan, row: SizeRow, mode: str, state: float
) -> SizeRow:
    """The row of one plan: its figures, their intervals, and failures priced (a checkpoint of
    `state` bytes saved in `mode`)."""
    tps = plan_intervals_of(plan, cluster).tokens_per_s
    ideal_s = request.tokens / tps.mid
    cost = checkpoint_cost(state, row.gpus, cluster, request.failures, mode)  # type: ignore[arg-type]
    gp: Goodput = goodput(ideal_s, row.gpus, plan.predicted.step_time_s, cost, request.failures)
    ideal_days = _per_tps(request.tokens / 86400.0, tps)
    days = scaled(ideal_days, gp.wall_over_ideal)
    gpu_hours = scaled(days, 24.0 * row.gpus)
    price = request.price_usd if request.price_usd is not None else _price(cluster)
    power = device_power_w(cluster)
    par = plan.parallel
    return replace(
        row,
        layout=describe(par),
        model_parallel=par.pp * par.tp * par.cp,
        dp=par.dp,
        micro_batch=par.micro_batch,
        tokens_per_s=tps,
        mfu=plan.predicted.mfu,
        step_time_s=plan.predicted.step_time_s,
        ideal_days=ideal_days,
        days=days,
        gpu_hours=gpu_hours,
        cost_usd=None if price is None else scaled(gpu_hours, price),
        energy_mwh=None if power is None else scaled(gpu_hours, power[0] / 1e6),
        goodput=gp,
    )


def _per_tps(numerator: float, tps: Interval) -> Interval:
    """numerator / tokens/s as an interval (the ends swap)."""
    return Interval(numerator / tps.hi, numerator / tps.mid, numerator / tps.lo, tps.level)


def _price(cluster: ClusterSpec) -> float | None:
    found = list_price(cluster)
    return None if found is None else found.usd_per_gpu_hour


def _note(
    request: SizeRequest, base: ClusterSpec, target: Target, mode: str, rows: Sequence[SizeRow]
) -> ClusterNote:
    price = list_price(base)
    if request.price_usd is not None:
        usd, source = request.price_usd, "--price-per-gpu-hour"
    elif price is not None:
        usd, source = price.usd_per_gpu_hour, price.source
    else:
        usd, source = None, "no public list price on record: pass --price-per-gpu-hour"
    power = device_power_w(base)
    meets = meets_hi = None
    if request.deadline_s is not None:
        days = request.deadline_s / 86400.0
        planned = [r for r in rows if r.days is not None]
        meets = next((r.gpus for r in planned if r.days.mid <= days), None)  # type: ignore[union-attr]
        meets_hi = next((r.gpus for r in planned if r.days.hi <= days), None)  # type: ignore[union-attr]
    return ClusterNote(
        cluster=base.name,
        price_usd=usd,
        price_source=source,
        power_w=None if power is None else power[0],
        power_source="no board power on record" if power is None else power[1],
        target=target.name,
        checkpoint_mode=mode,
        meets_deadline=meets,
        meets_deadline_hi=meets_hi,
    )
