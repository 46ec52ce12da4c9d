"""Public MoE runs of other stacks on H100 through the committed h100 preset: a check, no fitting.

Reads profiles/runs/other_stacks.csv: NeMo AutoModel and torchtitan runs (PyTorch FSDP2 + torch
pipelining + EP with DeepEP or torchtitan's all-to-all) and Megatron-Core long-context runs of
a release outside the calibration tables (sources and assumptions in profiles/runs/README.md,
"Other stacks"). Every row becomes its exact layout (planner/calibrate/runs.py) and goes through
`planner.calibrate.runs.estimate_run` on the h100 preset as committed; nothing is fitted here.

runs.py prices every row with Megatron-Core's conventions (planner/targets.py "megatron"):
18 B of state per parameter (bf16 weight, fp32 main gradient, fp32 master + two fp32 moments;
FSDP shards all of it, as Megatron-FSDP does), one pipeline flush per step, recompute on every
layer, force-balanced routing, Megatron's FLOP count. The FSDP2 stacks differ, and the printed
notes say what each difference does to the comparison.

Printed:
- per row: stack, measured and predicted tokens/s/GPU (TFLOPS/GPU where the row gives only
  that), predicted / measured, the same with the row's extra pipeline flushes (AutoModel's
  gradient accumulation drains the pipeline GA times per step; the model prices one), whether
  it fits, the predicted peak GiB against the device's and the measured peak where given;
- geomean of predicted / measured and the shares within +-15% and +-20%: all rows, the FSDP2
  stacks' rows, each stack;
- torchtitan's DeepEP / all-to-all speed-up, measured and predicted;
- where each predicted step goes: the slowest stage's largest time components;
- per FSDP2 row with pipelining, by hand from the model's stage times: the prediction with
  FSDP2's gathers and gradient reductions once per pipeline flush (fsdp2_pp_tokens_per_gpu);
- the stage memory of every row predicted not to fit, component by component;
- per FSDP2 row, by hand from the model's stage components: the peak with the stack's own
  state bytes and, under pipelining, the parameters and gradients FSDP2 keeps unsharded
  between micro-batches (which the model does not price) in place of its gathered units.

    OMP_NUM_THREADS=1 python3 benchmarks/other_stacks.py [--no-results]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from holdout_runs import layout
from results_md import ROOT, recorded

from planner.calibrate.runs import Run, estimate_run, load_runs, predicted_value
from planner.inputs.clusters import load_cluster
from planner.resources.cost import Estimate
from planner.resources.memory import layer_param_split
from planner.specs import GIB, ClusterSpec

RUNS = ROOT / "profiles" / "runs" / "other_stacks.csv"
PRESET = "h100"
TOLERANCES = (0.15, 0.20)
FSDP2_STACKS = ("automodel", "torchtitan")
# State bytes per parameter each stack keeps, sharded by FSDP2: AutoModel builds its MoE models
# in bf16 (components/models/deepseek_v3/model.py:282-299 @89e3a9f: initialize_weights ends in
# self.to(bfloat16)), so weights, gradients and torch.optim.Adam's moments are bf16 (2+2+4);
# torchtitan keeps fp32 weights (bf16 only as FSDP2's gathered param_dtype), fp32 gradients
# and fp32 moments (4+4+8).
STACK_STATE_BYTES = {"automodel": 8, "torchtitan": 16}
STATE = ("weights", "grads", "optimizer")


@dataclass(frozen=True)
class Point:
    """One row's prediction beside its measurement (metric per Run.metric)."""

    label: str
    stack: str
    measured: float
    predicted: float
    predicted_flushed: float  # with the row's pipeline flushes per step

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured

    @property
    def ratio_flushed(self) -> float:
        return self.predicted_flushed / self.measured


@dataclass(frozen=True)
class Summary:
    """Errors of a set of ratios (predicted / measured): count, geomean and the share of ratios
    within each of TOLERANCES (|ratio - 1| <= tolerance), in TOLERANCES' order."""

    n: int
    geomean: float
    within: tuple[float, ...]


def summarize(ratios: Sequence[float], tolerances: Sequence[float] = TOLERANCES) -> Summary:
    """Summary of `ratios` (at least one, each > 0)."""
    logs = [math.log(r) for r in ratios]
    shares = (sum(abs(r - 1) <= t + 1e-12 for r in ratios) / len(ratios) for t in tolerances)
    return Summary(n=len(ratios), geomean=math.exp(sum(logs) / len(logs)), within=tuple(shares))


def flushed_tokens_per_gpu(run: Run, est: Estimate, flushes: int) -> float:
    """Tokens/s/GPU when the pipeline drains `flushes` times per step instead of once.

    The model's step is (m + (pp - 1) / vp) x slot + fixed terms for one flush of m micro-batches;
    `flushes` flushes of m / flushes each pay the fill and drain `flushes` times, so the step
    grows by (flushes - 1) x (pp - 1) / vp x slot (the other fixed terms kept once).
    """
    p = run.parallel
    extra_s = (flushes - 1) * (p.pp - 1) / p.vp * est.slot_s
    return est.tokens_per_s * est.step_time_s / (est.step_time_s + extra_s) / p.world


def fsdp2_pp_tokens_per_gpu(run: Run, est: Estimate, flushes: int) -> float:
    """Tokens/s/GPU with FSDP2's communication as it runs under torch pipelining, by hand from
    the model's stage times, and `flushes` pipeline flushes per step.

    The model prices FSDP as Megatron-FSDP: a gather and a reduce-scatter per unit and micro-
    batch (its `fsdp_*` stage-time components, the exposed part). Under pipelining FSDP2 keeps
    parameters unsharded between micro-batches and reduces gradients after the last one
    (fsdp2_held_gib), so the gathers and reductions happen once per flush. Here the slot loses
    each stage's fsdp seconds (p2p kept: slot - slowest stage) and each flush pays the largest
    stage's fsdp seconds once, fully exposed:
        step' = step - (m + (pp - 1) / vp) slot + (m + F (pp - 1) / vp) slot' + F fsdp_max.
    """
    p = run.parallel
    fsdp = [sum(v for k, v in s.time_s if k.startswith("fsdp_")) for s in est.stages]
    p2p_s = est.slot_s - max(s.total_s for s in est.stages)
    slot_s = max(s.total_s - f for s, f in zip(est.stages, fsdp, strict=True)) + p2p_s
    fill = (p.pp - 1) / p.vp
    m = p.num_microbatches
    step_s = (est.step_time_s - (m + fill) * est.slot_s + (m + flushes * fill) * slot_s
              + flushes * max(fsdp))  # fmt: skip
    return est.tokens_per_s * est.step_time_s / step_s / p.world


def speedup(points: dict[str, Point], faster: str, slower: str) -> tuple[float, float]:
    """(measured, predicted) ratio of row `faster` over row `slower`."""
    a, b = points[faster], points[slower]
    return a.measured / b.measured, a.predicted / b.predicted


def fsdp2_held_gib(run: Run, stage_layers: Sequence[int], stack: str) -> tuple[float, float]:
    """(bf16 parameters GiB, gradients GiB) that FSDP2 under torch pipelining keeps unsharded on
    one rank of a stage for the whole step, which the model does not price.

    With pipelining both stacks set reshard_after_forward off (AutoModel parallelizer.py:132
    @89e3a9f, torchtitan models/llama4/infra/parallelize.py:351-359 @8783dba), and the pipeline
    stage turns the gradient reduce-scatter off until the last micro-batch (torch 2.13
    distributed/pipelining/stage.py:844-847, 1173-1177), accumulating unsharded gradients in the
    fp32 reduce dtype (fsdp/_fully_shard/_fsdp_param.py:802-813). Counted: the stage's layers'
    FSDP-managed parameters on this rank (embedding and head left out); routed experts only
    where FSDP shards them (edp > 1); AutoModel shards its experts without a mixed-precision
    policy (parallelizer.py:143-150), so their gradients stay bf16.
    """
    model, p = run.model, run.parallel
    dense = expert = 0.0
    for i in stage_layers:
        d, e = layer_param_split(model, model.layers[i], p)
        dense += d
        expert += e if p.edp > 1 else 0.0
    expert_grad_bytes = 2 if stack == "automodel" else 4
    return 2 * (dense + expert) / GIB, (4 * dense + expert_grad_bytes * expert) / GIB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    with recorded(ROOT / "results" / "other_stacks.md", "Other stacks", not args.no_results):
        report(load_runs(RUNS))
    return 0


def _flushes(run: Run) -> int:
    return int(run.field("pipeline_flushes") or 1)


def report(runs: list[Run]) -> None:
    """Print every section of the module docstring."""
    t0 = time.perf_counter()
    cluster = load_cluster(PRESET)
    print(f"{len(runs)} runs of other stacks from {RUNS.relative_to(ROOT)}; preset {PRESET} as "
          f"committed ({cluster.device.memory_gib:.1f} GiB device, "
          f"{cluster.framework_overhead_gib:.1f} GiB framework overhead)")  # fmt: skip
    print(f"\n{'id':>4} {'stack':<10} {'model':<17} {'gpus':>4} {'metric':<12} {'measured':>8} "
          f"{'predicted':>9} {'ratio':>5} {'flush':>5} {'ratio':>5} {'fits':<4} {'peak GiB':>8} "
          f"{'meas.':>5}  layout")  # fmt: skip
    points, estimates = {}, {}
    for run in runs:
        est = estimate_run(run, cluster)
        estimates[run.label] = est
        stack, flushes = run.field("stack"), _flushes(run)
        predicted = predicted_value(run, est)
        flushed = predicted
        if run.metric == "tokens/s/GPU" and flushes > 1:
            flushed = flushed_tokens_per_gpu(run, est, flushes)
        point = Point(run.label.removeprefix("id "), stack, run.measured, predicted, flushed)
        points[point.label] = point
        peak = f"{run.measured_peak_gib:.1f}" if run.measured_peak_gib else "-"
        print(f"{point.label:>4} {stack:<10} {run.field('model'):<17} {run.parallel.world:>4} "
              f"{run.metric:<12} {run.measured:>8.1f} {predicted:>9.1f} {point.ratio:>5.2f} "
              f"{flushes:>5} {point.ratio_flushed:>5.2f} {'yes' if est.fits else 'NO':<4} "
              f"{max(est.memory_gib_per_stage):>8.1f} {peak:>5}  {layout(run)}")  # fmt: skip
    _summaries(list(points.values()))
    _deepep(points)
    _time(runs, estimates)
    _fsdp2_pipeline(runs, estimates, points)
    _memory(runs, estimates)
    _held(runs, estimates, cluster)
    _conventions()
    print(f"\n(benchmark time {time.perf_counter() - t0:.0f} s)")


def _summaries(points: list[Point]) -> None:
    print("\npredicted / measured: geomean, share within +-15% and +-20% "
          "(flushed: with the rows' pipeline flushes)")  # fmt: skip
    groups = {"all": points, "FSDP2 stacks": [p for p in points if p.stack in FSDP2_STACKS]}
    for stack in dict.fromkeys(p.stack for p in points):
        groups[stack] = [p for p in points if p.stack == stack]
    for name, members in groups.items():
        for kind, ratios in (("", [p.ratio for p in members]),
                             ("flushed", [p.ratio_flushed for p in members])):  # fmt: skip
            s = summarize(ratios)
            shares = "  ".join(
                f"+-{t:.0%} {w:>4.0%}" for t, w in zip(TOLERANCES, s.within, strict=True)
            )
            print(f"  {name:<13} {kind:<7} {s.n:>2} rows  geomean {s.geomean:.3f}  within {shares}")


def _deepep(points: dict[str, Point]) -> None:
    measured, predicted = speedup(points, "406", "407")
    print(f"\ntorchtitan DeepSeek-V3 on 512 H100s, DeepEP (id 406) over the standard all-to-all "
          f"(id 407): measured {measured:.2f}x, predicted {predicted:.2f}x")  # fmt: skip


def _time(runs: list[Run], estimates: dict[str, Estimate]) -> None:
    print("\nwhere the predicted step goes: slowest stage, seconds per micro-batch (forward + "
          "backward), the five largest components; bubble share; communication hidden per "
          "micro-batch")  # fmt: skip
    for run in runs:
        est = estimates[run.label]
        stage = max(est.stages, key=lambda s: s.total_s)
        top = sorted(stage.time_s, key=lambda kv: -kv[1])[:5]
        hidden = sum(v for _, v in stage.hidden_s)
        print(f"  {run.label.removeprefix('id '):>4} step {est.step_time_s:6.2f} s, slot "
              f"{est.slot_s:.3f}, bubble {est.bubble_fraction:4.1%}: "
              + ", ".join(f"{k} {v:.3f}" for k, v in top)
              + f"; hidden {hidden:.3f}")  # fmt: skip


def _fsdp2_pipeline(
    runs: list[Run], estimates: dict[str, Estimate], points: dict[str, Point]
) -> None:
    print("\nFSDP2 under pipelining, by hand from the model's stage times (not a model output): "
          "predicted / measured as priced, with the row's pipeline flushes, and with FSDP2's "
          "gathers and reductions once per flush instead of per micro-batch")  # fmt: skip
    for run in runs:
        if run.field("stack") not in FSDP2_STACKS or run.parallel.pp == 1:
            continue
        point = points[run.label.removeprefix("id ")]
        once = fsdp2_pp_tokens_per_gpu(run, estimates[run.label], _flushes(run))
        print(f"  {point.label:>4} {point.ratio:.2f} -> flushes {point.ratio_flushed:.2f} -> "
              f"FSDP2 once per flush {once / run.measured:.2f}")  # fmt: skip


def _memory(runs: list[Run], estimates: dict[str, Estimate]) -> None:
    print("\nstage memory (GiB) of the rows predicted not to fit, largest stage")
    for run in runs:
        est = estimates[run.label]
        if est.fits:
            continue
        stage = max(est.stages, key=lambda s: s.total_gib)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in stage.memory_gib)
        print(f"  {run.label} ({run.field('model')}), stage {stage.stage} of {run.parallel.pp}, "
              f"{len(stage.layers)} layers, {stage.in_flight} chunk-micro-batches in flight: "
              f"{stage.total_gib:.1f} of {est.usable_memory_gib:.1f}\n    {parts}")  # fmt: skip


def stack_peak_gib(memory_gib: dict[str, float], state_bytes: int, held_gib: float) -> float:
    """The model's stage peak with the stack's state and FSDP2's held set in place of its own.

    memory_gib: the model's stage components (GiB); its `weights` are 2 B per parameter the rank
    keeps after sharding, so the stack's state is state_bytes / 2 x weights. held_gib > 0 (the
    unsharded set under pipelining, fsdp2_held_gib) replaces the model's transient gathered
    units; 0 keeps them.
    """
    state = sum(memory_gib.get(k, 0.0) for k in STATE)
    gathered = memory_gib.get("fsdp_gathered", 0.0) if held_gib > 0 else 0.0
    stack_state = state_bytes / 2 * memory_gib.get("weights", 0.0)
    return sum(memory_gib.values()) - state - gathered + stack_state + held_gib


def _held(runs: list[Run], estimates: dict[str, Estimate], cluster: ClusterSpec) -> None:
    print("\nmemory as the FSDP2 stacks keep it, largest stage, GiB (by hand from the model's "
          "components; not a model output):\n  model: the model's peak and its state (the "
          "row's state columns: AutoModel 8 B/param, else Megatron's 18, sharded); stack: the "
          "stack's state (AutoModel 8, torchtitan 16 B/param sharded);\n"
          "  held: with pipelining, the bf16 parameters FSDP2 keeps unsharded between "
          "micro-batches + their unsharded gradients, in place of the model's gathered "
          "units")  # fmt: skip
    print(f"  {'id':>4} {'model':>6} {'state':>6} {'stack':>6} {'gathered':>8} {'held':>11} "
          f"{'as run':>6} {'measured':>8} {'device':>6}")  # fmt: skip
    for run in runs:
        stack = run.field("stack")
        if stack not in FSDP2_STACKS:
            continue
        est = estimates[run.label]
        stage = max(est.stages, key=lambda s: s.total_gib)
        memory = dict(stage.memory_gib)
        params_gib = grads_gib = 0.0
        if run.parallel.pp > 1:
            params_gib, grads_gib = fsdp2_held_gib(run, stage.layers, stack)
        state_bytes = STACK_STATE_BYTES[stack]
        as_run = stack_peak_gib(memory, state_bytes, params_gib + grads_gib)
        held = f"{params_gib:.1f}+{grads_gib:.1f}" if params_gib else "-"
        measured = f"{run.measured_peak_gib:.2f}" if run.measured_peak_gib else "-"
        print(f"  {run.label.removeprefix('id '):>4} {stage.total_gib:>6.1f} "
              f"{sum(memory.get(k, 0.0) for k in STATE):>6.1f} "
              f"{state_bytes / 2 * memory.get('weights', 0.0):>6.1f} "
              f"{memory.get('fsdp_gathered', 0.0):>8.1f} {held:>11} {as_run:>6.1f} "
              f"{measured:>8} {cluster.device.memory_gib:>6.1f}")  # fmt: skip
    print("  (torchtitan's measured figure is its peak reserved memory; the PR's 56.75 GiB = "
          "71.74% puts the device at 79.1 GiB as torch reports it)")  # fmt: skip


CONVENTIONS = """
conventions: what the model prices (runs.py, Megatron-Core's) against what these stacks run
- state: AutoModel's rows are priced as they run, bf16 weights, gradients and Adam moments
  without fp32 master weights (8 B/param; the CSV's optimizer_dtype, grad_dtype bf16 and
  master_weights 0); torchtitan keeps fp32 weights, gradients and moments (16 B/param), priced
  at Megatron's 18; both sharded by FSDP2. The unsharded sets above under pipelining are not
  priced. Memory, not speed.
- pipeline: one flush of gbs / (mbs x dp) micro-batches per step; AutoModel drains the pipeline
  once per gradient-accumulation step (GA 4 for id 401, 2 for id 403): the 'flush' columns.
- recompute: full activation checkpointing in ids 401-404, 406, 407 is priced as Megatron's
  full recompute of every layer (one more forward per layer).
- routing: every FSDP2 row forces balanced routing (AutoModel fake_balanced_gate, torchtitan
  --debug.moe_force_load_balance), as the model assumes; ids 408, 409 are the forced-balance
  figures.
- FLOPs: torchtitan counts attention non-causally and AutoModel uses its own calculators, so
  the FSDP2 rows compare tokens/s. Ids 408, 409 give only TFLOPS, in the count of a Megatron
  release the source does not name; the model counts causal attention (planner/resources/
  flops.py). At 64k-128k attention is most of the count: a release that counted it
  non-causally would report more TFLOPS for the same run, and the true gap would be larger.
- kernels the model has no term for: torch.compile (torchtitan), TE attention/linear
  (AutoModel), torchtitan's host sync per MoE layer on its default all-to-all path."""


def _conventions() -> None:
    print(CONVENTIONS)


if __name__ == "__main__":
    raise SystemExit(main())
