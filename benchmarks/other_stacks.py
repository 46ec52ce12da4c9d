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
- the stage memory of every row predicted not to fit, component by component.
The FSDP2 rows with pipelining are priced with `fsdp_hold_unsharded` (each unit gathered once
per step and held unsharded with its fp32 gradients through the micro-batches, as torch
pipelining runs FSDP2) and AutoModel's with its bf16 state (`master_weights` 0).

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

RUNS = ROOT / "profiles" / "runs" / "other_stacks.csv"
PRESET = "h100"
TOLERANCES = (0.15, 0.20)
FSDP2_STACKS = ("automodel", "torchtitan")


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


def speedup(points: dict[str, Point], faster: str, slower: str) -> tuple[float, float]:
    """(measured, predicted) ratio of row `faster` over row `slower`."""
    a, b = points[faster], points[slower]
    return a.measured / b.measured, a.predicted / b.predicted


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
    _memory(runs, estimates)
    _conventions()
    print(f"\n(benchmark time {time.perf_counter() - t0:.0f} s)")


def _summaries(points: list[Point]) -> None:
    print("\nOUT-OF-SAMPLE (no row fitted on; the megatron rows share ModelZoo's stack with "
          "calibration ids 3-9), predicted / measured: geomean, share within +-15% and +-20% "
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


CONVENTIONS = """
conventions: what the model prices (runs.py, Megatron-Core's) against what these stacks run
- state: AutoModel's rows are priced as they run, bf16 weights, gradients and Adam moments
  without fp32 master weights (8 B/param; the CSV's optimizer_dtype, grad_dtype bf16 and
  master_weights 0); torchtitan keeps fp32 weights, gradients and moments (16 B/param), priced
  at Megatron's 18; both sharded by FSDP2. With pipelining both hold every unit unsharded, bf16
  weights and fp32 gradients, through the step (fsdp_hold_unsharded 1: the torchtitan rows'
  measured peaks 56.8 and 60.2 GiB against the model's above), and gather and reduce once per
  step. Both reduce-scatter gradients in fp32 (FSDP2's MixedPrecisionPolicy reduce_dtype:
  torchtitan configs.py:102, AutoModel components/distributed/config.py:306-313 @36044ad;
  the CSV's fsdp_reduce_dtype fp32).
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
