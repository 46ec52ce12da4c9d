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
import math

from published_runs import spearman
from results_md import ROOT, recorded

from planner.calibrate.runs import accounted_split, estimate_run, predicted_value, run_of
from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.parallel import ParallelConfig
from planner.resources.cost import estimate
from planner.resources.memory import rank_tokens
from planner.specs import SpecError, TrainingSpec
from planner.targets import TARGETS, with_conventions

RUNS = ROOT / "profiles" / "runs" / "published_runs.csv"
CLUSTERS = {"H100": "h100", "GB200": "gb200-nvl72"}
SCALE_IDS = ("4", "33", "23")  # Qwen3-235B H100, DeepSeek-V3 H100, Qwen3-235B GB200
GPUS = (128, 256, 512, 1024)
# MoE Parallel Folding (Liu et al. 2025, arXiv 2504.14960), Table 3 (appendix 6.4): one model
# on the same H100s (DGX H100, Eos), software and batch (global batch 256, seq 4096, BF16, token
# dropping at capacity factor 1), each method at its best layout, measured MFU. Rows: (model,
# GPUs, method, tp, pp, vp, ep, etp, MFU %). mbs 1 and no recompute are the authors' configs
# (yanring/Megatron-MoE-ModelZoo runtime_configs/benchmarking/runtime.conf lines 5-13:
# Mixtral-8x22B TP2 PP8 EP8, Qwen2-57B-A14B TP2 PP4 EP4 VPP7), the same for the method's other
# PP row; "TP+EP+DP" has no PP, expert TP = TP (Megatron's default). Mixtral's vp: VPP1 in that
# file @78fd4d6 (2025-04-03), VPP7 (one layer per chunk, the only other split of 7 layers per
# rank) @7f59386; the paper's own tables decide (identify_vp): the same layout measured at
# global batch 256 (Table 3) and 1,024 (Table 4) gains 6-7%, which the model prices at vp 7
# (+3%) and not at vp 1 (+16%: a 7 / 39 bubble shrinking to 7 / 135); Qwen2, whose vp 7 is
# known, is the control (+2-3% measured and priced).
FOLDING = (
    ("mixtral-8x22b", 128, "TP+EP+DP", 4, 1, 1, 8, 4, 36.6),
    ("mixtral-8x22b", 128, "MCore", 2, 8, 7, 4, 2, 46.3),
    ("mixtral-8x22b", 128, "w/ Folding", 2, 8, 7, 8, 1, 49.3),
    ("qwen2-57b-a14b", 64, "TP+EP+DP", 4, 1, 1, 4, 4, 23.1),
    ("qwen2-57b-a14b", 64, "MCore", 2, 4, 7, 4, 2, 35.3),
    ("qwen2-57b-a14b", 64, "w/ Folding", 2, 4, 7, 4, 1, 39.0),
)
# Table 4 of the same paper (strong scaling: each method's Table 3 layout, global batch 1,024,
# data parallelism grows with the GPUs): measured MFU % per GPU count.
STRONG = (
    ("mixtral-8x22b", "MCore", {128: 49.4, 256: 48.0, 512: 45.5, 1024: 42.3}),
    ("mixtral-8x22b", "w/ Folding", {128: 52.2, 256: 50.7, 512: 48.9, 1024: 44.9}),
    ("qwen2-57b-a14b", "MCore", {64: 36.2, 128: 36.0, 256: 34.8, 512: 32.5, 1024: 29.8}),
    ("qwen2-57b-a14b", "w/ Folding", {64: 39.9, 128: 39.7, 256: 38.1, 512: 36.6, 1024: 33.4}),
)
# calibration rows with the Folding Qwen2 layout's expert shapes (1,024 tokens per local
# expert, 16 local experts, d and f near 3k): GPT-OSS-120B on 64 H100s
SHAPE_IDS = ("1", "2")
GROUPS = {
    "qwen3-235b-a22b H100 256, seq 4096 gbs 2048 (ids 3-7)": ("3", "4", "5", "6", "7"),
}
# Public runs of one model and layout at several data-parallel sizes (checks, not fitted).
SCALE_CHECKS = (
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @067f987: every MoE row "
    "(DeepSeekV3, GPT OSS 120B, Qwen3 30B / 235B on DGX-H100 and DGX-GB200) is one GPU count "
    "per model and release (16, 64, 256 or 1,024), so no layout there is measured at two "
    "data-parallel sizes",
    "NVIDIA/Megatron-LM README.md:120-124 @d98e8a64dd (strong scaling, dense GPT-3 175B, fixed "
    "global batch 1,152, 96 -> 4,608 H100s): MFU 47% -> 42%, 'communication becomes more "
    "exposed at larger scale'; a fixed-global-batch check (micro-batches per replica fall), "
    "not the fixed-work case; dense, so not priced here",
    "NVIDIA/Megatron-LM README.md:114-116 (weak scaling, dense GPT 2B-462B to 6,144 H100s, "
    "with --overlap-grad-reduce and --overlap-param-gather): MFU 41% -> 47-48% as the model "
    "grows; the model size changes with the GPU count, so not the fixed-layout case",
)
SOURCES = (
    "NVIDIA/Megatron-LM @d98e8a64dd megatron/core/distributed/distributed_data_parallel.py:"
    "131-137 (bucket_size default max(40M, 1M x dp); no buckets without overlap_grad_reduce), "
    ":160-171 (no bucketing on pipeline ranks > 0), :591-600 (no_sync: only the last "
    "micro-batch registers gradients)",
    "NVIDIA/Megatron-LM megatron/core/distributed/param_and_grad_buffer.py:866-883 "
    "(register_grad_ready: a bucket group's reduction starts when all its grads are ready), "
    ":600-700 (start_grad_sync: reduce-scatter with the distributed optimizer, else all-reduce)",
    "NVIDIA/Megatron-LM megatron/core/distributed/distributed_data_parallel_config.py:15-66 "
    "(overlap_grad_reduce, overlap_param_gather, bucket_size, num_buckets)",
    "NVIDIA/Megatron-LM megatron/core/pipeline_parallel/schedules.py:1419-1456 (grad sync per "
    "model chunk after its last backward, aligned across pipeline ranks), :1335-1356 (param "
    "sync of the next chunk during the forward)",
    "NVIDIA/Megatron-LM megatron/training/training.py:2505-2510 (bucketing off for chunks > 0), "
    ":4350-4363 (grad_sync_func / param_sync_func per chunk with align_grad_reduce)",
    "NVIDIA/Megatron-LM megatron/core/parallel_state.py:870-895 (the expert mesh: its own "
    "RankGenerator, tp = expert_tensor_parallel_size, default = tensor_model_parallel_size)",
    "NVIDIA/Megatron-LM megatron/core/transformer/moe/token_dispatcher.py:84-91 (expert TP "
    "group), :736-750 (all-gather of the received tokens over expert TP after the all-to-all), "
    ":824-830 (reduce-scatter before the combine)",
    "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md:182-197 (keep EP x TP inside "
    "NVLink; PP across nodes), :324-352 (folding: 'Use ETP=1 for MoE (better GEMM efficiency, "
    "less communication)')",
    "NVIDIA/NeMo docs/source/features/optimizations/communication_overlap.rst (DP overlap "
    "'exposes only one DP communication chunk'; with PP, a chunk = the layers of a virtual "
    "pipeline stage)",
    "Liu et al. 2025, MoE Parallel Folding, arXiv 2504.14960: section 4.1 (DGX H100, PyTorch "
    "2.5, CUDA 12.6), 4.2 (token dropping at capacity factor 1; 'a large TP also introduces "
    "significant activation communication overhead'), Table 3 (appendix 6.4) and Table 4, "
    "read in a PDF-to-text copy",
    "yanring/Megatron-MoE-ModelZoo @78fd4d6 runtime_configs/benchmarking/runtime.conf:5-13 "
    "(vp, mbs; Mixtral-8x22B VPP1 there, VPP7 @7f59386), "
    "model_configs/benchmarking/Mixtral-8x22B.yaml and Qwen2-57B-A14B.yaml "
    "(ETP 1, distributed optimizer with --overlap-grad-reduce --overlap-param-gather; "
    "--tp-comm-overlap for Mixtral's dense blocks only, README.md:167-173)",
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


def _fixed_batch(row: dict[str, str], gpus: int) -> dict[str, str]:
    """The row at `gpus` with `piper estimate`'s default global batch (1,024) held fixed."""
    return {**row, "gpus": str(gpus), "gbs": "1024"}


def fixed_batch(rows: dict[str, dict[str, str]]) -> None:
    """The same layouts with the global batch fixed instead: fewer micro-batches per replica
    as dp grows, so the pipeline bubble and the unpaired warm-up grow."""
    print("\nfixed global batch 1,024 (micro-batches per replica = 1024 / dp), dp scaled")
    for rid in SCALE_IDS[:1]:
        row = rows[rid]
        cluster = load_cluster(CLUSTERS[row["hardware"]])
        base = None
        for gpus in GPUS[1:]:
            run = run_of(_fixed_batch(row, gpus), f"id {rid} at {gpus} GPUs")
            est = estimate_run(run, cluster)
            tps = est.tokens_per_s / run.parallel.world
            base = base or tps
            print(
                f"  id {rid} {gpus:5d} GPUs m{run.parallel.num_microbatches:<4d} {tps:8.1f} "
                f"tok/s/GPU ({tps / base - 1:+6.1%}) bubble {est.bubble_fraction:.1%}"
            )


def folding_estimate(name: str, gpus: int, tp: int, pp: int, vp: int, ep: int, etp: int,
                     gbs: int = 256):  # fmt: skip
    """The resource model's estimate of one Folding layout on the h100 preset (Megatron's
    conventions, distributed optimizer with overlap, mbs 1, seq 4096, no recompute)."""
    model = load_model(name)
    dp = gpus // (tp * pp)
    par = ParallelConfig(pp=pp, dp=dp, tp=tp, ep=ep, etp=etp, vp=vp, micro_batch=1,
                         num_microbatches=gbs // dp, recompute="none")  # fmt: skip
    tr = with_conventions(TrainingSpec(seq_len=4096, global_batch=gbs, zero=True),
                          TARGETS["megatron"])  # fmt: skip
    split = accounted_split(model.num_layers, pp) if vp == 1 else None
    return estimate(model, load_cluster("h100"), tr, par, stage_layers=split)


def identify_vp() -> dict[tuple[str, str], int]:
    """Each pipelined Table 3 layout's MFU at global batch 1,024 (Table 4, same GPUs) over
    its MFU at 256, measured and priced at vp 1 and at one layer per chunk (the two splits of
    7 layers per rank): the bubble the step holds at 32 micro-batches shows in this gain. The
    vp whose priced gain is nearest the measured one (in log) is the identified vp; FOLDING's
    rows must carry it (marked '!' where they do not, and folding() stops)."""
    print("\n  vp from the paper's tables: MFU at global batch 1,024 (Table 4) / 256 (Table 3), "
          "same layout and GPUs")  # fmt: skip
    found = {}
    for name, label, measured in STRONG:
        _, gpus, _, tp, pp, vp, ep, etp, mfu = next(
            r for r in FOLDING if r[0] == name and r[2] == label
        )
        gain = measured[gpus] / mfu
        priced = {}
        for v in (1, pp_layers(name, pp)):
            small = folding_estimate(name, gpus, tp, pp, v, ep, etp).mfu
            big = folding_estimate(name, gpus, tp, pp, v, ep, etp, gbs=1024).mfu
            priced[v] = big / small
        best = min(priced, key=lambda v: abs(math.log(priced[v] / gain)))
        found[(name, label)] = best
        cells = "  ".join(f"vp {v}: {g:.3f}" for v, g in priced.items())
        mark = "" if best == vp else " !"
        print(f"    {name:15s} {label:10s} measured {gain:.3f}  priced {cells}  identified "
              f"vp {best}, row's vp {vp}{mark}")  # fmt: skip
    return found


def pp_layers(name: str, pp: int) -> int:
    """Layers per pipeline rank of `name` split over pp ranks."""
    return load_model(name).num_layers // pp


def folding() -> None:
    print("\nMoE Parallel Folding, Table 3 (arXiv 2504.14960; H100, gbs 256, seq 4096): MFU %")
    for name in dict.fromkeys(row[0] for row in FOLDING):
        rows = [r for r in FOLDING if r[0] == name]
        pred, meas = [], []
        for _, gpus, label, tp, pp, vp, ep, etp, mfu in rows:
            est = folding_estimate(name, gpus, tp, pp, vp, ep, etp)
            st = max(est.stages, key=lambda s: s.total_s)
            parts = dict(st.time_s)
            comm = {k: v for k, v in parts.items() if k.startswith(("a2a_", "etp_", "tp_"))}
            comm_txt = " ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(comm.items()))
            pred.append(est.mfu * 100)
            meas.append(mfu)
            print(
                f"  {name:15s} {gpus:4d} {label:10s} tp{tp} pp{pp} vp{vp} ep{ep} etp{etp}: "
                f"measured {mfu:5.1f} predicted {est.mfu * 100:5.1f} ratio "
                f"{est.mfu * 100 / mfu:.2f} fits {'yes' if est.fits else 'NO'}; ms per "
                f"micro-batch: experts {parts.get('experts', 0) * 1e3:.1f} {comm_txt}"
            )
        first = max(range(len(pred)), key=pred.__getitem__)
        best = max(range(len(meas)), key=meas.__getitem__)
        print(f"    Spearman {spearman(pred, meas):+.2f}; ranked first: {rows[first][2]}, "
              f"measured fastest: {rows[best][2]}")  # fmt: skip
        for _, gpus, label, tp, pp, vp, ep, etp, mfu in rows:
            if pp > 1 and vp > 1 and name == "mixtral-8x22b":  # runtime.conf @78fd4d6's VPP1
                alt = folding_estimate(name, gpus, tp, pp, 1, ep, etp).mfu * 100
                print(f"    {label} at vp 1 (runtime.conf @78fd4d6): predicted "
                      f"{alt:5.1f} ratio {alt / mfu:.2f}")  # fmt: skip
    found = identify_vp()
    wrong = [f"{n} {lab}" for n, _, lab, _, _, vp, *_ in FOLDING if found.get((n, lab), vp) != vp]
    if wrong:  # FOLDING's vp is the identified one; a model change that moves it says so
        raise SystemExit(f"scaleout_check: FOLDING rows at another vp than identified: {wrong}")
    print("\n  Table 4 (strong scaling, gbs 1,024, dp grows): MFU % measured / predicted, and "
          "each size's MFU over the smallest's")  # fmt: skip
    layouts = {(r[0], r[2]): r[3:8] for r in FOLDING}
    for name, label, measured in STRONG:
        tp, pp, vp, ep, etp = layouts[(name, label)]
        cells, base = [], None
        for gpus, mfu in measured.items():
            est = folding_estimate(name, gpus, tp, pp, vp, ep, etp, gbs=1024)
            pred = est.mfu * 100
            base = base or (mfu, pred)
            cells.append(f"{gpus}: {mfu:.1f}/{pred:.1f} ({mfu / base[0]:.2f} vs "
                         f"{pred / base[1]:.2f})")  # fmt: skip
        print(f"  {name:15s} {label:10s} " + "  ".join(cells))


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


def expert_rows(model_name: str, par: ParallelConfig, seq: int) -> tuple[int, float]:
    """(local experts, tokens per local expert) of a layout: E / ep experts, each receiving
    ep T k / E rows with T = mbs seq / (tp cp) (memory.rank_tokens; balanced routing)."""
    moe = load_model(model_name).first_moe
    tokens = rank_tokens(TrainingSpec(seq_len=seq), par)
    return moe.num_experts // par.ep, par.ep * tokens * moe.top_k / moe.num_experts


def same_expert_shapes(rows: dict[str, dict[str, str]]) -> None:
    """Layouts whose routed experts run the same grouped GEMM shapes (width, tokens per local
    expert, local experts) side by side: the grouped-GEMM efficiency depends on those alone,
    so a gap between their ratios is not a grouped-GEMM term."""
    h100 = load_cluster("h100")
    print("\nsame expert GEMM shapes, different ratios (h100 preset, grouped_gemm_half_rows "
          f"{h100.grouped_gemm_half_rows:g})")  # fmt: skip
    print(f"  {'run':34} {'d':>5} {'f':>5} {'local':>5} {'rows':>6} {'rows/(rows+half)':>16} "
          f"{'experts share':>13} {'ratio':>6}")  # fmt: skip
    cases = []
    for rid in SHAPE_IDS:
        run = run_of(rows[rid], f"id {rid}")
        est = estimate_run(run, h100)
        ratio = predicted_value(run, est) / run.measured
        cases.append((f"id {rid} {run.model.name}", run.model.name, run.parallel,
                      run.training.seq_len, est, ratio))  # fmt: skip
    for name, gpus, label, tp, pp, vp, ep, etp, mfu in FOLDING:
        if name == "qwen2-57b-a14b" and label == "w/ Folding":
            est = folding_estimate(name, gpus, tp, pp, vp, ep, etp)
            par = ParallelConfig(pp=pp, dp=gpus // (tp * pp), tp=tp, ep=ep, etp=etp, vp=vp,
                                 micro_batch=1, num_microbatches=pp)  # fmt: skip
            cases.append((f"Folding {name} {label}", name, par, 4096, est, est.mfu * 100 / mfu))
    for label, name, par, seq, est, ratio in cases:
        model = load_model(name)
        local, per_expert = expert_rows(name, par, seq)
        st = max(est.stages, key=lambda x: x.total_s)
        parts = dict(st.time_s)
        share = parts.get("experts", 0.0) / sum(parts.values())
        eff = per_expert / (per_expert + h100.grouped_gemm_half_rows)
        print(f"  {label:34} {model.hidden_size:5d} {model.first_moe.expert_ffn:5d} "
              f"{local:5d} {per_expert:6.0f} {eff:16.2f} {share:13.2f} {ratio:6.2f}")  # fmt: skip
    ids = [c[5] for c in cases if c[0].startswith("id ")]
    fold = [c[5] for c in cases if c[0].startswith("Folding")]
    print(f"  (ratio: predicted / measured, tokens/s for the ids, MFU for Folding; one knee "
          f"makes both expert GEMMs equally slow, yet the ids are priced {min(ids):.2f}-"
          f"{max(ids):.2f} and Folding {min(fold):.2f})")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    with recorded(ROOT / "results" / "scaleout_check.md", "Scale-out check", not args.no_results):
        rows = _rows()
        print("fixed work per GPU (micro-batches per replica fixed), dp scaled")
        scale_out(rows)
        fixed_batch(rows)
        layout_groups(rows)
        folding()
        same_expert_shapes(rows)
        print("\npublic runs of one layout at several data-parallel sizes (checks):")
        for line in SCALE_CHECKS:
            print(f"  - {line}")
        print("\nsources read:")
        for line in SOURCES:
            print(f"  - {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
