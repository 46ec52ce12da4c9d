"""Memory that ran: is every published layout that trained predicted to fit, and with what room?

Reads profiles/runs/memory_ran.csv: one row per layout that ran on H100 or GB200, either a
reference (`ref`: a row id of profiles/runs/published_runs.csv or holdout_runs.csv, whose layout
columns it takes) or a full row in the RUNS.csv columns (planner/calibrate/runs.py), and for every
row the optimizer settings of the stack that ran it, each cited in `settings_source`:
`grad_dtype` (the gradient buffer: Megatron-Bridge's performance configs reduce in bf16),
`precision_aware_optimizer`, `optimizer_dtype` (Adam moments), `optimizer_offload_fraction` (host
offload), `activation_offload_modules` (fine-grained activation offloading) and
`pipeline_layout` (Megatron's --pipeline-model-parallel-layout; empty: the calibration rows'
accounted split). Rows are checked, not fitted: nothing here sets a constant.

Each layout is priced twice, side by side:
- before: the resource model of commit BEFORE (the model at the start of issue 25's memory work),
  run from a `git archive` of its planner/ in a subprocess, with the row's layout and the
  megatron target's conventions (18 B per parameter: fp32 gradients, fp32 moments), which is what
  benchmarks/published_runs.py and holdout_runs.py price;
- after: this checkout's model with the row's settings.
A layout fits when every stage's predicted total (framework overhead included) is at or below
the device memory, with no margin. Printed per row: the peak stage's GiB before and after, the
device GiB, fits, headroom (device - peak, GiB and % of the device) and the per-stage totals;
then the share that fit and the headroom's spread, and the component breakdown of every row
that does not fit after.

    OMP_NUM_THREADS=1 python3 benchmarks/memory_ran.py [--no-results]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from results_md import ROOT, recorded

from planner.calibrate.runs import Run, run_of
from planner.inputs.clusters import load_cluster, with_nodes
from planner.resources.cost import Estimate, estimate
from planner.specs import ClusterSpec

RUNS = ROOT / "profiles" / "runs"
EVIDENCE = RUNS / "memory_ran.csv"
CLUSTERS = {"H100": "h100", "GB200": "gb200-nvl72"}
BEFORE = "a60abf8"  # HEAD when issue 25's memory work began
SETTINGS = ("grad_dtype", "precision_aware_optimizer", "optimizer_dtype",
            "optimizer_offload_fraction", "activation_offload_modules", "pipeline_layout",
            "settings_source")  # fmt: skip
MEMORY_ONLY = "1"  # run_of needs a measured figure; memory ignores it (rows marked in the note)

# Priced in the subprocess by the BEFORE model: one JSON object per line in, per-stage GiB out.
_BEFORE_SCRIPT = """
import json, sys
from planner.calibrate.runs import run_of
from planner.inputs.clusters import load_cluster, with_nodes
from planner.resources.cost import estimate
for line in sys.stdin:
    job = json.loads(line)
    run = run_of(job["fields"], job["where"])
    cluster = load_cluster(job["cluster"])
    if run.parallel.world > cluster.total_gpus:
        cluster = with_nodes(cluster, -(-run.parallel.world // cluster.gpus_per_node))
    est = estimate(run.model, cluster, run.training, run.parallel,
                   stage_layers=job["stage_layers"], dispatcher=run.dispatcher)
    print(json.dumps(est.memory_gib_per_stage))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    with recorded(ROOT / "results" / "memory_ran.md", "Memory that ran", not args.no_results):
        report(load_evidence(EVIDENCE))
    return 0


def load_evidence(path: Path) -> list[tuple[dict[str, str], Run]]:
    """Each evidence row's merged fields (the referenced row's layout, then its settings) and
    its Run with the settings applied to the training spec."""
    refs = {name: _rows(RUNS / name) for name in ("published_runs.csv", "holdout_runs.csv")}
    out = []
    with path.open(newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            fields = dict(row)
            if row["ref"]:
                fields = {**refs[row["ref"]][row["id"]],
                          **{k: row[k] for k in SETTINGS}}  # fmt: skip
            fields.pop("ref", None)
            if not (fields.get("measured_tokens_per_s_per_gpu") or fields.get(
                    "measured_tflops_per_gpu")):  # fmt: skip
                fields["measured_tflops_per_gpu"] = MEMORY_ONLY
            run = run_of(fields, f"{path.name} line {line} (id {row['id']})")
            out.append((fields, with_settings(run, fields)))
    return out


def _rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return {r["id"]: r for r in csv.DictReader(f)}


def with_settings(run: Run, fields: dict[str, str]) -> Run:
    """The run with the row's optimizer settings and pipeline layout."""
    training = replace(
        run.training,
        grad_dtype=fields["grad_dtype"] or None,
        precision_aware_optimizer=fields["precision_aware_optimizer"] == "1",
        optimizer_dtype=fields["optimizer_dtype"] or "fp32",
        optimizer_offload_fraction=float(fields["optimizer_offload_fraction"] or 0.0),
        activation_offload_modules=fields["activation_offload_modules"],
    )
    split = run.stage_layers
    if fields["pipeline_layout"]:
        counts = layout_layer_counts(fields["pipeline_layout"], run.parallel.pp)
        split = contiguous(counts)
    return replace(run, training=training, stage_layers=split)


def layout_layer_counts(text: str, pp: int) -> list[int]:
    """Transformer layers per pipeline rank of a Megatron --pipeline-model-parallel-layout
    (`E` embedding, `t` layer, `m` MTP, `L` loss, `|` between virtual stages, `(...)*n` and
    `x*n` repeats): virtual stage j lives on rank j mod pp (Megatron's interleaving)."""
    s = text.replace(" ", "")
    while "(" in s:
        s = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"([A-Za-z])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    chunks = s.split("|")
    counts = [0] * pp
    for j, chunk in enumerate(chunks):
        counts[j % pp] += chunk.count("t")
    return counts


def contiguous(counts: list[int]) -> tuple[tuple[int, ...], ...]:
    """Contiguous layer blocks of the given sizes (Piper's stage_layers; with vp > 1 a rank's
    layers are its chunks', priced as one block of that many layers)."""
    out, start = [], 0
    for n in counts:
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


def before_peaks(items: list[tuple[dict[str, str], Run]]) -> list[list[float]]:
    """Per-stage totals (GiB) of every row under the BEFORE model, without the row's settings."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "before.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), BEFORE,
                        "planner", "profiles"], check=True)  # fmt: skip
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        jobs = []
        for fields, run in items:
            base = {k: v for k, v in fields.items() if k not in SETTINGS}
            split = [list(s) for s in run.stage_layers]
            jobs.append(
                json.dumps(
                    {
                        "fields": base,
                        "where": run.where,
                        "cluster": CLUSTERS[run.hardware],
                        "stage_layers": split,
                    }
                )
            )
        done = subprocess.run([sys.executable, "-c", _BEFORE_SCRIPT], cwd=tmp,
                              input="\n".join(jobs), capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"the {BEFORE} model failed: {done.stderr.strip()[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines()]


def report(items: list[tuple[dict[str, str], Run]]) -> None:
    """Print the per-row table, the shares that fit and the breakdown of the rows that do not."""
    t0 = time.perf_counter()
    presets = {hw: load_cluster(name) for hw, name in CLUSTERS.items()}
    before = before_peaks(items)
    after = [estimate_ran(run, presets[run.hardware]) for _, run in items]
    print(f"{len(items)} layouts that ran, from {EVIDENCE.relative_to(ROOT)}; presets "
          f"{', '.join(f'{v} ({k})' for k, v in CLUSTERS.items())}; before = the model at "
          f"{BEFORE} (megatron conventions: fp32 gradients and moments), after = this checkout "
          "with each row's optimizer settings\n")  # fmt: skip
    print(f"  {'id':>4} {'model':<18} {'hw':<5} {'gpus':>5} {'prec':<5} {'device':>6}  "
          f"{'before':>6} {'fits':<4} {'room%':>6}  {'after':>6} {'fits':<4} {'room':>6} "
          f"{'room%':>6}  settings | layout")  # fmt: skip
    rows = []
    for (fields, run), old, est in zip(items, before, after, strict=True):
        device = presets[run.hardware].device.memory_gib
        new = est.memory_gib_per_stage
        rows.append((fields["id"], run, device, max(old), max(new), est))
        head = f"{fields['id']:>4} {fields['model']:<18} {run.hardware:<5} {run.parallel.world:>5}"
        print(f"  {head} {fields['precision']:<5} {device:>6.1f}  {max(old):>6.1f} "
              f"{_yes(max(old), device):<4} {_room(max(old), device):>6}  "
              f"{max(new):>6.1f} {_yes(max(new), device):<4} "
              f"{device - max(new):>6.1f} {_room(max(new), device):>6}  "
              f"{_settings(run)} | {_layout(run)}")  # fmt: skip
        print(f"{'':>8}per stage GiB before {_stages(old)}; after {_stages(new)}")
    _summary(rows)
    print(f"\n(benchmark time {time.perf_counter() - t0:.0f} s)")


def estimate_ran(run: Run, cluster: ClusterSpec) -> Estimate:
    """The run priced by this checkout on `cluster`, grown to the run's GPU count."""
    if run.parallel.world > cluster.total_gpus:  # grown as the calibration runs grow it
        cluster = with_nodes(cluster, -(-run.parallel.world // cluster.gpus_per_node))
    return estimate(run.model, cluster, run.training, run.parallel,
                    stage_layers=run.stage_layers, dispatcher=run.dispatcher)  # type: ignore[arg-type]  # fmt: skip


def _summary(rows: list[tuple[str, Run, float, float, float, Estimate]]) -> None:
    n = len(rows)
    fit_old = sum(old <= dev for _, _, dev, old, _, _ in rows)
    fit_new = sum(new <= dev for _, _, dev, _, new, _ in rows)
    room_old = [100 * (dev - old) / dev for _, _, dev, old, _, _ in rows]
    room_new = [100 * (dev - new) / dev for _, _, dev, _, new, _ in rows]
    print("\nfits without margin (every stage's total <= device memory)")
    print(
        f"  before  {fit_old} of {n} ({100 * fit_old / n:.0f}%)   room % of device: min "
        f"{min(room_old):+.1f}, median {statistics.median(room_old):+.1f}"
    )
    print(
        f"  after   {fit_new} of {n} ({100 * fit_new / n:.0f}%)   room % of device: min "
        f"{min(room_new):+.1f}, median {statistics.median(room_new):+.1f}"
    )
    target = "pass" if fit_new >= 0.9 * n else "FAIL"
    print(f"  target >= 90% of layouts that ran fit: {100 * fit_new / n:.0f}%  {target}")
    over = [r for r in rows if r[4] > r[2]]
    if over:
        print("\ndo not fit after: the peak stage by component (GiB)")
    for rid, run, dev, _, new, est in over:
        stage = max(range(len(est.stages)), key=lambda i: est.stages[i].total_gib)
        parts = ", ".join(f"{k} {v:.1f}" for k, v in est.stages[stage].memory_gib if v >= 0.1)
        print(
            f"  {rid:>4} stage {stage}/{run.parallel.pp}: {new:.1f} > {dev:.1f} "
            f"({100 * (new - dev) / dev:+.1f}%): {parts}"
        )


def _yes(peak: float, device: float) -> str:
    return "yes" if peak <= device else "NO"


def _room(peak: float, device: float) -> str:
    return f"{100 * (device - peak) / device:+.1f}"


def _stages(totals: list[float] | tuple[float, ...]) -> str:
    return "[" + " ".join(f"{v:.1f}" for v in totals) + "]"


def _settings(run: Run) -> str:
    t = run.training
    grads = t.grad_dtype or ("fp32" if t.bytes_per_param == 18 else "bf16")
    out = [f"grads {grads}", f"m,v {t.optimizer_dtype}"]
    if t.precision_aware_optimizer:
        out.append("pao")
    if t.optimizer_offload_fraction:
        out.append(f"offload {t.optimizer_offload_fraction:g}")
    if t.activation_offload_modules:
        out.append(f"act-offload {t.activation_offload_modules}")
    return " ".join(out)


def _layout(run: Run) -> str:
    p, t = run.parallel, run.training
    rc = p.recompute if p.recompute != "selective" else f"sel({','.join(p.recompute_modules)})"
    return (f"tp{p.tp} pp{p.pp} vp{p.vp} cp{p.cp} ep{p.ep} dp{p.dp} mbs{p.micro_batch} "
            f"m{p.num_microbatches} {rc} {run.dispatcher} {t.dtype}"
            f"{' fsdp' if t.fsdp else ''}{' a2a-ovl' if t.a2a_overlap else ''}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
