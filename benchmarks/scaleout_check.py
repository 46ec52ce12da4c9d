"""Data-parallel scale-out at fixed work per GPU: where the predicted throughput goes.

Takes published layouts (profiles/runs/published_runs.csv) and prices each with the same
tp/pp/vp/cp/ep/etp, micro-batch size and micro-batches per data-parallel replica at data-
parallel sizes giving 128, 256, 512 and 1,024 GPUs (global batch grows with dp), on the
committed presets. Prints tokens/s/GPU, its change from the smallest size, and the step
broken into the pipeline slots, the exposed gradient reduction, the optimizer step and the
unpaired warm-up, plus the per-step communication of the bottleneck stage by kind and
level. Then the layout groups of one stack side by side (predicted and measured rank).

Published runs of one layout at several data-parallel sizes, and the sources read to
build and check the terms, are listed at the end (the checks are never fitted on).

    OMP_NUM_THREADS=1 python3 benchmarks/scaleout_check.py [--no-results]
"""

from __future__ import annotations

import argparse
import csv

from results_md import ROOT, recorded

from planner.calibrate.runs import estimate_run, predicted_value, run_of
from planner.inputs.clusters import load_cluster
from planner.specs import SpecError

RUNS = ROOT / "profiles" / "runs" / "published_runs.csv"
CLUSTERS = {"H100": "h100", "GB200": "gb200-nvl72"}
SCALE_IDS = ("4", "33", "23")  # Qwen3-235B H100, DeepSeek-V3 H100, Qwen3-235B GB200
GPUS = (128, 256, 512, 1024)
GROUPS = {
    "qwen3-235b-a22b H100 256, seq 4096 gbs 2048 (ids 3-7)": ("3", "4", "5", "6", "7"),
}
# Public runs of one model and layout at several data-parallel sizes (checks, not fitted).
SCALE_CHECKS = (
    (
        "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @067f987 [25.09, "
        "DGX-H100]: DeepSeekV3 FP8 tp2 pp8 vp4 ep64 mbs1, 1,024 GPUs gbs 8192 (1297 tok/s/GPU, "
        "calibration id 33); no second size of this layout is published in that table"
    ),
)
SOURCES = (
    "NVIDIA/Megatron-LM megatron/core/distributed/distributed_data_parallel.py "
    "(bucketing, overlap_grad_reduce, overlap_param_gather, expert-data-parallel buffers)",
    "NVIDIA/Megatron-LM megatron/core/distributed/param_and_grad_buffer.py "
    "(bucket_size, start_grad_sync when a bucket's grads are ready, finish_grad_sync)",
    "NVIDIA/Megatron-LM megatron/core/distributed/distributed_data_parallel_config.py "
    "(bucket_size default max(40M, 1M x dp))",
    "NVIDIA/Megatron-LM megatron/core/parallel_state.py (expert groups under folding)",
    "Liu et al. 2025, MoE Parallel Folding, arXiv 2504.14960",
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @067f987",
    "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md @e865051",
)


def _rows() -> dict[str, dict[str, str]]:
    with RUNS.open(encoding="utf-8") as f:
        return {r["id"]: r for r in csv.DictReader(f)}


def _at_gpus(row: dict[str, str], gpus: int) -> dict[str, str] | None:
    """The row with dp scaled to `gpus` and the global batch scaled with it (micro-batches
    per replica fixed); None when the layout does not divide."""
    old = int(row["gpus"])
    if (int(row["gbs"]) * gpus) % old:
        return None
    return {**row, "gpus": str(gpus), "gbs": str(int(row["gbs"]) * gpus // old)}


def _breakdown(est) -> str:
    slots = est.step_time_s - est.dp_exposed_s - est.optimizer_s - est.unpaired_s
    return (
        f"step {est.step_time_s:7.2f} = slots {slots:6.2f} + grad {est.dp_exposed_s:5.2f} "
        f"+ opt {est.optimizer_s:4.2f} + unpaired {est.unpaired_s:4.2f}"
    )


def scale_out(rows: dict[str, dict[str, str]]) -> None:
    for rid in SCALE_IDS:
        row = rows[rid]
        cluster = load_cluster(CLUSTERS[row["hardware"]])
        print(
            f"\nid {rid} {row['model']} {row['hardware']} {row['precision']} tp{row['tp']} "
            f"pp{row['pp']} vp{row['vp']} ep{row['ep']} mbs{row['mbs']} "
            f"(measured {row['measured_tokens_per_s_per_gpu']} tok/s/GPU at {row['gpus']})"
        )
        base = None
        for gpus in GPUS:
            scaled = _at_gpus(row, gpus)
            try:
                run = run_of(scaled, f"id {rid} at {gpus} GPUs") if scaled else None
                est = estimate_run(run, cluster) if run else None
            except SpecError as err:
                print(f"  {gpus:5d} GPUs: not priced ({str(err).split(': ')[-1]})")
                continue
            tps = est.tokens_per_s / run.parallel.world
            base = base or tps
            comm = {k: v for k, v in est.comm_s if k.startswith(("dp_", "edp_", "a2a_"))}
            comm_txt = " ".join(f"{k} {v:.2f}" for k, v in sorted(comm.items()))
            print(
                f"  {gpus:5d} GPUs dp{run.parallel.dp:<3d} {tps:8.1f} tok/s/GPU "
                f"({tps / base - 1:+6.1%})  {_breakdown(est)}  | {comm_txt}"
            )


def layout_groups(rows: dict[str, dict[str, str]]) -> None:
    print("\nlayouts of one stack, predicted vs measured (tokens/s/GPU)")
    for name, ids in GROUPS.items():
        print(f"  {name}")
        for rid in ids:
            row = rows[rid]
            run = run_of(row, f"id {rid}")
            est = estimate_run(run, load_cluster(CLUSTERS[row["hardware"]]))
            pred = predicted_value(run, est)
            print(
                f"    id {rid}: measured {run.measured:8.1f} predicted {pred:8.1f} "
                f"ratio {pred / run.measured:.2f}  {_breakdown(est)}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    with recorded(ROOT / "results" / "scaleout_check.md", "Scale-out check", not args.no_results):
        rows = _rows()
        print("fixed work per GPU (micro-batches per replica fixed), dp scaled")
        scale_out(rows)
        layout_groups(rows)
        print("\npublic runs of one layout at several data-parallel sizes (checks):")
        for line in SCALE_CHECKS:
            print(f"  - {line}")
        print("\nsources read:")
        for line in SOURCES:
            print(f"  - {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
