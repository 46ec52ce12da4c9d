"""Published MoE training runs through the resource model: predicted vs measured, and fit.

Reads profiles/runs/published_runs.csv (18 Megatron-Core runs on H100 and GB200, sources in
profiles/runs/README.md) and runs each row's exact layout through `planner.resources.cost.
estimate` on the h100 or gb200-nvl72 preset. Nothing is fitted to the rows. Per row: predicted
vs measured tokens/s/GPU (TFLOPS/GPU where the row has no tokens/s) and their ratio, whether it
fits and its peak GiB against the device; per group of rows with the same model, hardware and
GPU count, the Spearman rank correlation of predicted vs measured; one summary line.

How a row becomes a layout (decisions where a source is silent are marked "assumed"):
- dp = gpus / (tp pp cp); num_microbatches = gbs / (mbs dp); etp, ep, vp, cp as given;
- recompute: none, full, or selective with the row's modules (`norm` = layernorm,
  `act` = moe_act, Megatron-Core's short forms);
- sharding: FSDP where the note says "FSDP on", else Megatron's distributed optimizer (both
  sources run it); 18 B per parameter (fp32 main gradients), fp32 Adam moments;
- dispatcher: "deepep" where the note names DeepEP or HybridEP, else "flat" (NCCL
  all-to-all; assumed where the note names none); the all-to-all overlap where the note says
  "A2A overlap";
- precision: BF16 -> bf16, FP8 -> fp8 (per-tensor current scaling), MXFP8 -> mxfp8; MTP as
  the row's model config (deepseek-v3 has 1 layer, deepseek-v3-nomtp none);
- routing force-balanced (skew 1), flash attention; the router weights applied in the expert
  activation, as Megatron-Core's experts do (`gate_in_activation`);
- the layer split counts the embedding and the loss as one pipeline layer each (Megatron's
  --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split, which the
  Qwen3 ModelZoo configs set; assumed for the others), earlier ranks taking the extra layer.

    OMP_NUM_THREADS=1 python3 benchmarks/published_runs.py [--no-results]
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass

from results_md import ROOT, recorded

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.parallel import ParallelConfig
from planner.resources.cost import Estimate, estimate
from planner.specs import SpecError, TrainingSpec

RUNS = ROOT / "profiles" / "runs" / "published_runs.csv"
CLUSTERS = {"H100": "h100", "GB200": "gb200-nvl72"}
DTYPES = {"BF16": "bf16", "FP8": "fp8", "MXFP8": "mxfp8"}
SHORT_MODULES = {"norm": "layernorm", "act": "moe_act"}
WITHIN = 0.15  # "within +-15%"


@dataclass(frozen=True)
class Run:
    """One row as a layout and training setup, with its measured figure."""

    row: dict[str, str]
    parallel: ParallelConfig
    training: TrainingSpec
    dispatcher: str
    stage_layers: tuple[tuple[int, ...], ...]
    metric: str  # "tokens/s/GPU" or "TFLOPS/GPU"
    measured: float


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


def _recompute(text: str) -> tuple[str, tuple[str, ...]]:
    text = text.strip()
    if text in ("none", "full"):
        return text, ()
    inner = text.removeprefix("selective(").removesuffix(")")
    names = tuple(SHORT_MODULES.get(n.strip(), n.strip()) for n in inner.split(","))
    return "selective", names


def run_of(row: dict[str, str]) -> Run:
    """The row's exact layout, training setup and dispatcher (module docstring)."""
    gpus, tp, pp, cp = (int(row[k]) for k in ("gpus", "tp", "pp", "cp"))
    mbs, gbs = int(row["mbs"]), int(row["gbs"])
    dp = gpus // (tp * pp * cp)
    note = row["note"]
    recompute, modules = _recompute(row["recompute"])
    parallel = ParallelConfig(
        pp=pp, dp=dp, tp=tp, ep=int(row["ep"]), micro_batch=mbs,
        num_microbatches=gbs // (mbs * dp), recompute=recompute, vp=int(row["vp"]), cp=cp,
        etp=int(row["etp"]), recompute_modules=modules,
    )  # fmt: skip
    fsdp = "FSDP on" in note
    training = TrainingSpec(
        seq_len=int(row["seq"]), global_batch=gbs, dtype=DTYPES[row["precision"]],
        bytes_per_param=18, zero=not fsdp, fsdp=fsdp, recompute=recompute,
        a2a_overlap="A2A overlap" in note, gate_in_activation=True,
    )  # fmt: skip
    lowered = note.lower()
    dispatcher = "deepep" if "deepep" in lowered or "hybridep" in lowered else "flat"
    tokens = row["measured_tokens_per_s_per_gpu"]
    metric, measured = (
        ("tokens/s/GPU", float(tokens))
        if tokens
        else ("TFLOPS/GPU", float(row["measured_tflops_per_gpu"]))
    )
    split = accounted_split(load_model(row["model"]).num_layers, pp)
    return Run(row, parallel, training, dispatcher, split, metric, measured)


def predicted_value(run: Run, est: Estimate) -> float:
    """The prediction in the row's metric."""
    if run.metric == "tokens/s/GPU":
        return est.tokens_per_s / run.parallel.world
    return est.tflops_per_gpu


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties); nan for fewer than 2 points."""
    if len(xs) < 2:
        return math.nan

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else math.nan


def _layout(run: Run) -> str:
    p, t = run.parallel, run.training
    rc = p.recompute if p.recompute != "selective" else f"sel({','.join(p.selective_modules)})"
    knobs = [run.dispatcher, t.dtype, "fsdp" if t.fsdp else "distopt"]
    if t.a2a_overlap:
        knobs.append("a2a-ovl")
    return (
        f"tp{p.tp} pp{p.pp} vp{p.vp} cp{p.cp} ep{p.ep} etp{p.etp} edp{p.edp} dp{p.dp} "
        f"mbs{p.micro_batch} m{p.num_microbatches} {rc} {' '.join(knobs)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    with open(RUNS, newline="") as f:
        rows = list(csv.DictReader(f))
    with recorded(ROOT / "results" / "published_runs.md", "Published runs", not args.no_results):
        report(rows)
    return 0


def report(rows: list[dict[str, str]]) -> None:
    """Print the per-row table, the per-group rank correlations and the summary line."""
    print(
        f"{len(rows)} runs from {RUNS.relative_to(ROOT)}; clusters h100 (H100), gb200-nvl72 (GB200)"
    )
    print(f"{'id':>3} {'model':<18} {'hw':<5} {'gpus':>4} {'metric':<12} {'measured':>9} "
          f"{'predicted':>9} {'ratio':>6} {'fits':<4} {'peak GiB':>8} {'of':>6}  "
          "layout")  # fmt: skip
    results: list[tuple[Run, Estimate]] = []
    for row in rows:
        run = run_of(row)
        cluster = load_cluster(CLUSTERS[row["hardware"]])
        try:
            est = estimate(
                load_model(row["model"]), cluster, run.training, run.parallel,
                stage_layers=run.stage_layers, dispatcher=run.dispatcher,
            )  # fmt: skip
        except SpecError as err:
            print(f"{row['id']:>3} {row['model']:<18} not expressible: {err}")
            continue
        pred = predicted_value(run, est)
        results.append((run, est))
        print(
            f"{row['id']:>3} {row['model']:<18} {row['hardware']:<5} {row['gpus']:>4} "
            f"{run.metric:<12} {run.measured:>9.1f} {pred:>9.1f} {pred / run.measured:>6.2f} "
            f"{'yes' if est.fits else 'NO':<4} {max(est.memory_gib_per_stage):>8.1f} "
            f"{cluster.device.memory_gib:>6.1f}  {_layout(run)}"
        )
    print("(TFLOPS rows: Piper's model FLOPs against the source's own count)")
    for run, est in results:
        if not est.fits:
            worst = max(est.stages, key=lambda st: st.total_gib)
            parts = ", ".join(f"{n} {v:.1f}" for n, v in worst.memory_gib if v >= 0.05)
            print(f"row {run.row['id']} does not fit: {est.reason}; GiB by component: {parts}")
    _groups(results)
    ratios = [predicted_value(run, est) / run.measured for run, est in results]
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else math.nan
    within = sum(abs(r - 1) <= WITHIN for r in ratios)
    fits = sum(est.fits for _, est in results)
    print(
        f"\nsummary: {len(results)} of {len(rows)} rows expressed; geomean predicted/measured "
        f"{geomean:.2f}; {within} of {len(results)} within +-{WITHIN:.0%}; "
        f"{fits} of {len(results)} predicted to fit"
    )


def _groups(results: list[tuple[Run, Estimate]]) -> None:
    """Spearman per (model, hardware, GPUs) group: on tokens/s/GPU when every row of the
    group has it, else on TFLOPS/GPU (every row has that)."""
    groups: dict[tuple[str, str, str], list[tuple[Run, Estimate]]] = {}
    for run, est in results:
        key = (run.row["model"], run.row["hardware"], run.row["gpus"])
        groups.setdefault(key, []).append((run, est))
    print("\nrank correlation per group (model, hardware, GPUs)")
    for (model, hw, gpus), members in groups.items():
        ids = ",".join(r.row["id"] for r, _ in members)
        if len(members) < 2:
            print(f"  {model:<18} {hw:<5} {gpus:>4}  rows {ids:<18} one row, no ranking")
            continue
        tokens = all(r.metric == "tokens/s/GPU" for r, _ in members)
        if tokens:
            measured = [r.measured for r, _ in members]
            predicted = [e.tokens_per_s / r.parallel.world for r, e in members]
        else:
            measured = [float(r.row["measured_tflops_per_gpu"]) for r, _ in members]
            predicted = [e.tflops_per_gpu for _, e in members]
        rho = spearman(predicted, measured)
        metric = "tokens/s/GPU" if tokens else "TFLOPS/GPU"
        print(f"  {model:<18} {hw:<5} {gpus:>4}  rows {ids:<18} Spearman {rho:+.2f} ({metric})")


if __name__ == "__main__":
    raise SystemExit(main())
