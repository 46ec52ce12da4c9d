"""Synthetic measured runs: RUNS.csv rows whose measured throughput is the resource model's
prediction on a cluster with known constants (the oracle the fit must recover)."""

from __future__ import annotations

import csv
import io
from dataclasses import replace

from planner.calibrate.fit import derived
from planner.calibrate.runs import estimate_run, parse_runs, predicted_value
from planner.inputs.clusters import load_cluster
from planner.specs import ClusterSpec

COLUMNS = ("id", "model", "hardware", "gpus", "precision", "seq", "gbs", "mbs", "tp", "pp", "vp",
           "cp", "ep", "etp", "recompute", "measured_tokens_per_s_per_gpu")  # fmt: skip
# Qwen3-30B-A3B on 16 H100s: tokens per expert, micro-batches and layers per rank all vary,
# so the GEMM efficiency, the grouped-GEMM knee and the per-layer overhead are told apart.
LAYOUTS = (  # gpus, seq, gbs, mbs, tp, pp, vp, cp, ep, etp, recompute
    (16, 4096, 256, 1, 1, 1, 1, 1, 16, 1, "none"),
    (16, 4096, 256, 4, 1, 1, 1, 1, 8, 1, "full"),
    (16, 2048, 512, 2, 2, 2, 1, 1, 8, 1, "full"),
    (16, 4096, 128, 1, 1, 4, 1, 1, 4, 1, "selective(norm,act)"),
    (16, 8192, 64, 1, 2, 1, 1, 1, 8, 1, "full"),
)
TRUTH = {"gemm_efficiency": 0.55, "grouped_gemm_half_rows": 300.0, "layer_overhead_us": 800.0}


# Prior sds (calibration.prior_sd_<name>) of the derived start: no fitted preset, so its
# constants may sit far from the truth (TRUTH's gemm_efficiency is 2 of these sds away).
WIDE_PRIOR_SD = {"gemm_efficiency": 0.3, "grouped_gemm_half_rows": 1.0,
                 "attention_efficiency": 0.3, "hbm_efficiency": 0.3, "layer_overhead_us": 1.0,
                 "scale_up_efficiency": 0.3, "scale_out_efficiency": 0.3,
                 "overlap_efficiency": 0.5}  # fmt: skip


def derived_cluster(base: str = "h100") -> ClusterSpec:
    """The base preset with every named efficiency at ClusterSpec's default (the analytic
    model as derived, before any fit), with WIDE_PRIOR_SD: a start that does not move when
    presets are refit."""
    cluster = derived(load_cluster(base))
    wide = tuple((f"prior_sd_{n}", str(v)) for n, v in WIDE_PRIOR_SD.items())
    kept = tuple(kv for kv in cluster.calibration if not kv[0].startswith("prior_sd_"))
    return replace(cluster, calibration=kept + wide)


def with_calibration(cluster: ClusterSpec, **items: object) -> ClusterSpec:
    """`cluster` with these calibration entries set (e.g. loo_rms_log, prior_sd_<name>)."""
    kept = tuple(kv for kv in cluster.calibration if kv[0] not in items)
    return replace(cluster, calibration=kept + tuple((k, str(v)) for k, v in items.items()))


def truth_cluster(base: str = "h100", **values: float) -> ClusterSpec:
    """The derived base with the known constants (TRUTH, updated by `values`)."""
    return replace(derived_cluster(base), **{**TRUTH, **values})


def runs_csv(truth: ClusterSpec, layouts=LAYOUTS, model: str = "qwen3-30b-a3b") -> str:
    """RUNS.csv text with one row per layout, measured = predicted on `truth`."""
    rows = [
        {"id": str(i + 1), "model": model, "hardware": "H100", "gpus": g, "precision": "BF16",
         "seq": s, "gbs": b, "mbs": mb, "tp": tp, "pp": pp, "vp": vp, "cp": cp, "ep": ep,
         "etp": etp, "recompute": rc, "measured_tokens_per_s_per_gpu": "1"}
        for i, (g, s, b, mb, tp, pp, vp, cp, ep, etp, rc) in enumerate(layouts)
    ]  # fmt: skip
    runs = parse_runs(_write(rows))
    for row, run in zip(rows, runs, strict=True):
        measured = predicted_value(run, estimate_run(run, truth))
        row["measured_tokens_per_s_per_gpu"] = repr(measured)
    return _write(rows)


def _write(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
