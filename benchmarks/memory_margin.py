"""Memory margin: the resource model's peak memory against published runs that reported theirs,
and the default `--memory-margin` those errors ask for.

Reads profiles/runs/memory_runs.csv (public training runs that report per-GPU peak memory
beside their layout; each row's `source` cites repository, path and commit, its `note` the
settings and what was assumed; `exact` 0 marks a row with an assumed or approximated
setting). Each row becomes its layout exactly as benchmarks/published_runs.py makes its rows
(planner/calibrate/runs.py `run_of`: Megatron's conventions, 18 B per parameter, the
distributed optimizer, the router weights inside the expert activation), with three per-row
settings that file does not need:

- `engine` torchtitan: FSDP2 (the note says "FSDP on"), 16 B per parameter (fp32 sharded
  parameters and gradients, fp32 Adam moments; the bf16 copies are the gathered working set)
  and the router weights applied after the experts (`gate_in_activation` off);
- `split` even: the layers split evenly over the pipeline stages (Megatron's default without
  --account-for-embedding/loss-in-pipeline-split), else the calibration rows' accounted split;
- `config_overrides`: HF config keys replaced in the preset (a model without a preset, e.g.
  Llama 3 70B as llama3-8b with the 70B sizes), written to a temporary config.json.

The prediction compared is the stage the source measured (`peak_rank`: the maximum over
stages, rank 0's stage, or the last stage) and what it measured (`peak_kind`): nvidia-smi's
used memory against the stage total, which includes the preset's framework overhead (CUDA
context, NCCL, allocator slack); PyTorch's max reserved or max allocated against the total
without that overhead, which PyTorch does not count.

Printed: per row predicted, measured, error = predicted - measured in GiB, in % of the row's
device memory (the presets' convention: 80 GB = 74.5 GiB) and in % of the measurement; the
errors by group; then the default margin: the smallest whole percentage of device memory that
covers every under-prediction (measured above predicted) of the default set: rows on engine
versions Piper prices (`current`) whose shortfall no named missing model term explains
(`gap`: those are model fixes); then the cost side, the layouts that ran
(profiles/runs/memory_ran.csv with each stack's optimizer settings, as benchmarks/memory_ran.py
prices them) and how many each margin would reject; the sources consulted.

    OMP_NUM_THREADS=1 python3 benchmarks/memory_margin.py [--no-results]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from results_md import ROOT, recorded

from planner.calibrate.runs import Run, estimate_run, run_of
from planner.inputs.clusters import load_cluster
from planner.resources.cost import Estimate, even_split
from planner.specs import SpecError

RUNS = ROOT / "profiles" / "runs" / "memory_runs.csv"
MODELS = ROOT / "profiles" / "models"
CLUSTERS = {"H100": "h100", "H200": "h200", "GB200": "gb200-nvl72", "MI250X": "frontier"}
ENGINES = ("megatron", "torchtitan")
PEAK_KINDS = ("nvidia_smi_used", "max_reserved", "max_allocated")
PEAK_RANKS = ("max", "rank0", "last")
STEP_PCT = 1.0  # the default margin is rounded up to a whole percent of device memory


@dataclass(frozen=True)
class Point:
    """One row's predicted and measured peak (GiB) on a device of `device_gib`."""

    label: str
    predicted: float
    measured: float
    device_gib: float
    exact: bool = True
    moe: bool = False
    current: bool = True  # an engine version Piper prices (Megatron-Core of 2025-26, torchtitan)
    gap: str = ""  # a named term the model lacks that explains the row's shortfall
    logits_gib: float = 0.0  # one fp32 copy of the compared stage's logits (the model counts 1)

    @property
    def error_gib(self) -> float:
        """predicted - measured: negative is an under-prediction."""
        return self.predicted - self.measured

    @property
    def error_pct_device(self) -> float:
        return 100 * self.error_gib / self.device_gib

    @property
    def error_pct_measured(self) -> float:
        return 100 * self.error_gib / self.measured

    @property
    def shortfall_pct(self) -> float:
        """How far the measurement lies above the prediction, % of device memory (0 if not)."""
        return max(0.0, -self.error_pct_device)


def covering_margin(points: list[Point], coverage: float = 1.0, step: float = STEP_PCT) -> float:
    """The smallest margin, in % of device memory and a multiple of `step`, with which the
    prediction plus the margin reaches the measurement on at least `coverage` of the points:
    the nearest-rank `coverage` quantile of the shortfalls (0 for over-predictions), rounded
    up to `step`. 0 when nothing is under-predicted; coverage 1.0 = the worst shortfall."""
    if not points:
        raise ValueError("no points to derive a margin from")
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    shortfalls = sorted(p.shortfall_pct for p in points)
    rank = max(1, math.ceil(coverage * len(shortfalls)))
    need = shortfalls[rank - 1]
    # a tiny tolerance keeps 3.0000000001 % (float noise) at 3 %
    return step * math.ceil(need / step - 1e-9) if need > 0 else 0.0


def default_set(points: list[Point]) -> list[Point]:
    """The rows the default margin is derived from: engines Piper prices (`current`) and no
    named missing model term (`gap`; those are model fixes, and their rows join the set once
    the model counts the term)."""
    return [p for p in points if p.current and not p.gap]


def default_margin(points: list[Point], step: float = STEP_PCT) -> float:
    """The default --memory-margin, % of device memory: every under-prediction of the default
    set covered (coverage 1: with a dozen rows the 90th percentile is the worst row or the one
    before it, and a margin that lets a published run OOM is no margin), rounded up to `step`."""
    chosen = default_set(points)
    if not chosen:
        raise ValueError("no current row without a named gap to derive the margin from")
    return covering_margin(chosen, 1.0, step)


def covered(points: list[Point], margin_pct: float) -> int:
    """How many points the margin covers: prediction + margin >= measurement."""
    return sum(p.shortfall_pct <= margin_pct + 1e-9 for p in points)


# --- rows -> runs ----------------------------------------------------------------------------


def _override_model(name: str, overrides: str, tmp: Path, where: str) -> str:
    """The preset's config.json with `key=value;...` replaced, as a temporary file path."""
    if not overrides:
        return name
    config = json.loads((MODELS / f"{name}.json").read_text())
    for item in overrides.split(";"):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in config:
            raise SpecError(f"{where}: config_overrides item {item!r} is not key=value of a "
                            f"key in {name}.json")  # fmt: skip
        config[key.strip()] = json.loads(value)
    config.pop("_piper", None)
    path = tmp / f"{name}-{abs(hash(overrides))}.json"
    path.write_text(json.dumps(config))
    return str(path)


def load_rows(path: Path, tmp: Path) -> list[tuple[dict[str, str], Run]]:
    """Every row of memory_runs.csv with its run, priced by the row's engine conventions."""
    out = []
    with open(path, newline="") as f:
        for n, row in enumerate(csv.DictReader(f), start=2):
            where = f"{path.name} line {n} (id {row.get('id', '?')})"
            for column, choices in (("engine", ENGINES), ("peak_kind", PEAK_KINDS),
                                    ("peak_rank", PEAK_RANKS)):  # fmt: skip
                if row[column] not in choices:
                    raise SpecError(f"{where}: column '{column}' is {row[column]!r}; use one "
                                    f"of {', '.join(choices)}")  # fmt: skip
            fields = dict(row, model=_override_model(row["model"], row["config_overrides"], tmp,
                                                     where))  # fmt: skip
            run = run_of(fields, where)
            if row["engine"] == "torchtitan":
                if not run.training.fsdp:
                    raise SpecError(f"{where}: a torchtitan row needs 'FSDP on' in its note")
                run = replace(run, training=replace(run.training, bytes_per_param=16,
                                                    gate_in_activation=False))  # fmt: skip
            if row["split"] == "even":
                run = replace(run, stage_layers=even_split(run.model.num_layers, run.parallel.pp))
            elif row["split"] != "accounted":
                raise SpecError(f"{where}: column 'split' is {row['split']!r}; even or accounted")
            out.append((row, run))
    return out


def compared_gib(row: dict[str, str], est: Estimate, overhead_gib: float) -> tuple[float, int]:
    """The prediction for what the row measured, and the stage it is read from."""
    totals = est.memory_gib_per_stage
    stage = {"rank0": 0, "last": len(totals) - 1}.get(
        row["peak_rank"], max(range(len(totals)), key=lambda i: totals[i])
    )
    value = totals[stage]
    if row["peak_kind"] != "nvidia_smi_used":
        value -= overhead_gib  # PyTorch's counters hold no CUDA context or NCCL buffers
    return value, stage


def logits_gib(run: Run, stage: int) -> float:
    """One fp32 copy of the logits the stage holds (GiB): on the last stage, the micro-batch's
    tokens (the whole sequence over cp; sequence parallelism gathers it before the head) x the
    vocabulary over tp x 4 B; 0 on the other stages."""
    p = run.parallel
    if stage != p.pp - 1:
        return 0.0
    tokens = p.micro_batch * run.training.seq_len / p.cp
    return tokens * run.model.vocab_size / p.tp * 4 / 2**30


# --- report ----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    with recorded(ROOT / "results" / "memory_margin.md", "Memory margin", not args.no_results):
        report(RUNS)
    return 0


def report(path: Path) -> None:
    """Print every section of the module docstring."""
    t0 = time.perf_counter()
    presets = {hw: load_cluster(name) for hw, name in CLUSTERS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        rows = load_rows(path, Path(tmp))
    print(f"{len(rows)} runs from {path.relative_to(ROOT)}; presets "
          + ", ".join(f"{name} ({hw})" for hw, name in CLUSTERS.items()))  # fmt: skip
    print(f"\n{'id':>4} {'engine':<10} {'model':<16} {'hw':<5} {'gpus':>4} {'prec':<5} "
          f"{'kind':<9} {'stage':>5} {'pred':>6} {'meas':>6} {'err GiB':>8} {'% dev':>6} "
          f"{'% meas':>7} {'logits':>6} {'exact':<5} {'cur':<3} {'gap':<28}  layout")  # fmt: skip
    points = []
    for row, run in rows:
        cluster = presets[run.hardware]
        est = estimate_run(run, cluster)
        predicted, stage = compared_gib(row, est, cluster.framework_overhead_gib)
        model = row["model"] + ("*" if row["config_overrides"] else "")
        point = Point(row["id"], predicted, float(row["measured_peak_gib"]),
                      float(row["device_gib"]), row["exact"] == "1",
                      run.model.num_experts > 0, row["current"] == "1",
                      row["gap"], logits_gib(run, stage))  # fmt: skip
        points.append(point)
        logits = point.logits_gib
        kind = {"nvidia_smi_used": "smi-used", "max_reserved": "reserved",
                "max_allocated": "allocated"}[row["peak_kind"]]  # fmt: skip
        print(f"{point.label:>4} {row['engine']:<10} {model:<16} {run.hardware:<5} "
              f"{run.parallel.world:>4} {row['precision']:<5} {kind:<9} "
              f"{stage:>2}/{run.parallel.pp:<2} {predicted:>6.1f} {point.measured:>6.1f} "
              f"{point.error_gib:>+8.1f} {point.error_pct_device:>+6.1f} "
              f"{point.error_pct_measured:>+7.1f} {logits:>6.1f} "
              f"{'yes' if point.exact else 'no':<5} "
              f"{'yes' if point.current else 'no':<3} {point.gap or '-':<28}  "
              f"{_layout(run)}")  # fmt: skip
    print("(pred: the compared stage's total, less the preset's framework overhead where the "
          "measurement is PyTorch's; * = preset with config_overrides; % dev: of the row's "
          "device_gib; logits: one fp32 copy of the stage's logits, GiB, which the model counts "
          "once)")  # fmt: skip
    _components(rows, presets)
    _summary(points)
    _margin(points, presets)
    _cost(presets, default_margin(points))
    _sources()
    print(f"\n(benchmark time {time.perf_counter() - t0:.0f} s)")


def _layout(run: Run) -> str:
    p, t = run.parallel, run.training
    rc = p.recompute if p.recompute != "selective" else f"sel({','.join(p.selective_modules)})"
    shard = "fsdp" if t.fsdp else "distopt"
    return (f"tp{p.tp} pp{p.pp} vp{p.vp} cp{p.cp} ep{p.ep} etp{p.etp} dp{p.dp} "
            f"mbs{p.micro_batch} m{p.num_microbatches} s{t.seq_len} {rc} {shard} "
            f"{t.bytes_per_param}B")  # fmt: skip


def _components(rows, presets) -> None:
    print("\npredicted GiB by component on the compared stage (>= 0.1 GiB)")
    for row, run in rows:
        cluster = presets[run.hardware]
        est = estimate_run(run, cluster)
        _, stage = compared_gib(row, est, cluster.framework_overhead_gib)
        parts = ", ".join(f"{n} {v:.1f}" for n, v in est.stages[stage].memory_gib if v >= 0.1)
        print(f"  {row['id']:>4}: {parts}")


def _summary(points: list[Point]) -> None:
    print("\nerror = predicted - measured (negative: under-predicted)")
    groups = {
        "all": points,
        "exact": [p for p in points if p.exact],
        "MoE": [p for p in points if p.moe],
        "dense": [p for p in points if not p.moe],
        "current": [p for p in points if p.current],
        "default set": default_set(points),
    }
    for name, members in groups.items():
        if not members:
            print(f"  {name:<11}   0 rows")
            continue
        errs = [p.error_pct_device for p in members]
        worst = min(members, key=lambda p: p.error_pct_device)
        under = sum(p.error_gib < 0 for p in members)
        mean = sum(errs) / len(errs)
        print(f"  {name:<11} {len(members):>3} rows  mean {mean:+5.1f}% of device, "
              f"mean |err| {sum(map(abs, errs)) / len(errs):4.1f}%, under-predicted "
              f"{under}, worst under id {worst.label} {worst.error_gib:+.1f} GiB "
              f"({worst.error_pct_device:+.1f}%)")  # fmt: skip


def _margin(points: list[Point], presets) -> None:
    print("\nmargin: the smallest whole % of device memory with which prediction + margin >= "
          "measured, by row set and coverage")  # fmt: skip
    sets = (("all rows", points), ("exact rows", [p for p in points if p.exact]),
            ("MoE rows", [p for p in points if p.moe]),
            ("current engines", [p for p in points if p.current]),
            ("no named gap", [p for p in points if not p.gap]),
            ("default set", default_set(points)))  # fmt: skip
    for name, members in sets:
        if not members:
            continue
        cells = []
        for coverage in (1.0, 0.9):
            m = covering_margin(members, coverage)
            cells.append(f"{coverage:>4.0%}: {m:>4.0f}% ({covered(members, m)} of {len(members)})")
        worst = max(members, key=lambda p: p.shortfall_pct)
        print(f"  {name:<16} " + "   ".join(cells) + f"   worst id {worst.label} "
              f"{worst.shortfall_pct:.1f}%")  # fmt: skip
    gaps: dict[str, list[Point]] = {}
    for p in points:
        if p.gap:
            gaps.setdefault(p.gap, []).append(p)
    print("\nnamed gaps (model fixes; their rows leave the default set until the model counts "
          "them)")  # fmt: skip
    for gap, members in gaps.items():
        shown = ", ".join(
            f"{p.label} {p.error_gib:+.1f} GiB"
            + (
                f" ({-p.error_gib / p.logits_gib:.1f} x the fp32 logits)"
                if p.gap == "loss_logits_copies" and p.logits_gib
                else ""
            )
            for p in members
        )
        print(f"  {gap:<30} {shown}")
    default = default_margin(points)
    chosen = default_set(points)
    print(f"\nDEFAULT --memory-margin = {default:.0f}% of device memory: every under-prediction "
          f"of the {len(chosen)} rows of the default set covered (current engines, no named "
          f"gap), rounded up to a whole %; it covers {covered(points, default)} of all "
          f"{len(points)} rows")  # fmt: skip
    print("  on the presets: " + ", ".join(
        f"{c.name} {default / 100 * c.device.memory_gib:.1f} GiB of {c.device.memory_gib:.1f}"
        for c in presets.values()))  # fmt: skip
    print("  (the presets' device memory is the decimal capacity in GiB, 80 GB = 74.5 GiB; the "
          "runtime sees more: id 211's log reads 73.32 GiB = 92.70%, a 79.1 GiB H100, so the "
          "h100 preset already holds 4.6 GiB, 6%, back beside the margin and the framework "
          "overhead)")  # fmt: skip


def rejected(rooms_pct: list[float], margin_pct: float) -> int:
    """How many layouts that ran a margin would reject: predicted room below the margin."""
    return sum(r < margin_pct - 1e-9 for r in rooms_pct)


def _cost(presets, default: float) -> None:
    """The other side: the layouts that ran (benchmarks/memory_ran.py's evidence, with the
    optimizer settings each stack used), and which margins would reject them."""
    from memory_ran import EVIDENCE, estimate_ran, load_evidence

    rooms = []
    for fields, run in load_evidence(EVIDENCE):
        cluster = presets[run.hardware]
        peak = max(estimate_ran(run, cluster).memory_gib_per_stage)
        room = 100 * (cluster.device.memory_gib - peak) / cluster.device.memory_gib
        rooms.append((room, fields["id"], run.hardware, fields["model"], peak,
                      cluster.device.memory_gib))  # fmt: skip
    rooms.sort()
    print(f"\ncost: predicted room (device - predicted peak, % of device) of the {len(rooms)} "
          f"layouts that ran ({EVIDENCE.name}, as benchmarks/memory_ran.py prices them), "
          "tightest first")  # fmt: skip
    for room, rid, hw, model, peak, device in rooms[:6]:
        print(f"  id {rid:>4} {hw:<5} {model:<18} peak {peak:6.1f} of {device:6.1f} GiB: "
              f"room {room:+5.1f}%")  # fmt: skip
    pct = [r[0] for r in rooms]
    print("  rejected by a margin of " + ", ".join(
        f"{m:.0f}%: {rejected(pct, m)}" for m in sorted({default, 2.0, 4.0, 5.0, 10.0, 20.0})
    ) + f" (of {len(pct)}; a negative room is rejected at any margin)")  # fmt: skip


SOURCES = (
    ("used", "FlagOpen/FlagPerf @1b5a030398ab719e406f77877eb34c9599b17fd2: training/nvidia/"
     "{mixtral_8x7B,llama3_8B,llama3_70B}-megatron/README.md (mem = nvidia-smi used, "
     "training/nvidia/nvidia_monitor.py), launch scripts training/benchmarks/*/megatron/"
     "(ids 201-207)"),
    ("used", "NVIDIA/Megatron-LM @d98e8a64ddf34856e74b24714e3bedb2f5a39553: tests/"
     "functional_tests/test_cases/mixtral/{mixtral_8x7b_tp1pp4ep8vpp8_release,"
     "mixtral_8x7b_alltoall_tp2pp4ep4_release,mixtral_8x22b_tp2pp8ep8vpp1_release}/"
     "{model_config.yaml,golden_values_dev_dgx_h100.json} (mem-max-allocated-bytes; ids "
     "231-233; GPU counts are not in the repository: inferred)"),
    ("used", "pytorch/torchtitan issue #1789 and PR #1792 (82a9530f6), deepseek_v3_16b.toml "
     "@0cfbd0b3c (id 211)"),
    ("used", "pytorch/torchtitan @b5bcd76c: benchmarks/llama3_h100_202412_torchtitan.md "
     "(Tables 1-3; ids 221-226), benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md "
     "(ids 227-228)"),
    ("no row", "pytorch/torchtitan benchmarks/llama3_h100_202412 Tables 4-6 (Llama 3.1 70B / "
     "405B with async TP and PP: no preset, and the 405B rows need torchtitan's PP schedules)"),
    ("no row", "pytorch/torchtitan torchtitan/components/quantization/nvfp4.md (Llama 3 8B, "
     "Qwen3 8B on B200: no B200 preset; reserved at 95-98% of the device, the allocator full)"),
    ("no row", "pytorch/torchtitan PR #1373 (DeepSeek-V3 FSDP 8 EP 2, 65.53 GiB: a debug flavor, "
     "0.4 GFLOP per token), PR #2389 (B200), PR #1993 (DeepSeek-V3 16B notes on B200, no "
     "figures per layout), PR #3618 (graph_trainer, '~36 -> ~61 GiB', approximate), PR #1690 "
     "(Qwen3 32B dense, no preset), issue #1558 (DeepSeek-V3 671B, OOM logs only on Drive)"),
    ("no row", "yanring/Megatron-MoE-ModelZoo @e8650517: best_practice/qwen3/readme.md has a "
     "'Mem' column, empty in every row; DeepSeek-V3 readmes: none"),
    ("no row", "NVIDIA/Megatron-LM docs/discussions/deepseek-v3-gb200-optimization/"
     "deepseek-v3-gb200-optimization.md: memory savings described, no per-GPU peaks"),
    ("no row", "NVIDIA/Megatron-LM moe/ and mixtral/deepseekv3_proxy_* functional tests: "
     "golden values carry mem-max-allocated-bytes too, but on toy or proxy models without "
     "presets (not attempted)"),
    ("no row", "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary*.md: throughput only; "
     "arXiv 2603.07685 (Megatron Core MoE report): excerpts held no per-layout peak table"),
    ("no row", "huggingface/trl PR #6869 (Qwen3-30B-A3B, GLM on H100 'Peak GPU memory' in GB: "
     "HF transformers expert parallel, sharding of the dense part and optimizer not stated); "
     "FlagPerf qwen1.5_MoE (A800, not a listed device)"),
)  # fmt: skip


def _sources() -> None:
    print("\nsources consulted")
    for status, text in SOURCES:
        print(f"  [{status}] {text}")


if __name__ == "__main__":
    raise SystemExit(main())
