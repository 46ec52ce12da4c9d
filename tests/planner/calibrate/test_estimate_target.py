"""`piper estimate --target megatron` prices a published calibration row exactly as the
benchmarks do (planner.calibrate.runs: the megatron target's conventions), from flags alone."""

from __future__ import annotations

import json

import pytest

from planner.calibrate.runs import estimate_run, load_runs
from planner.cli import main
from planner.inputs.clusters import load_cluster
from planner.inputs.paths import PROFILES_DIR

CLUSTERS = {"H100": "h100", "GB200": "gb200-nvl72"}


def flags(run) -> list[str]:
    """The `piper estimate` flags of one RUNS.csv row's layout and settings."""
    p, t = run.parallel, run.training
    out = ["--model", run.field("model"), "--cluster", CLUSTERS[run.hardware],
           "--target", "megatron", "--split", "accounted", "--seq-len", str(t.seq_len),
           "--global-batch", str(t.global_batch), "--micro-batch", str(p.micro_batch),
           "--dtype", t.dtype, "--dispatcher", run.dispatcher,
           "--zero" if t.zero else "--fsdp"]  # fmt: skip
    for name in ("pp", "dp", "tp", "ep", "vp", "cp", "etp"):
        out += [f"--{name}", str(getattr(p, name))]
    if p.recompute != "none":
        out += ["--recompute", p.recompute]
    if p.recompute_modules:
        out += ["--recompute-modules", ",".join(p.recompute_modules)]
    if t.a2a_overlap:
        out.append("--a2a-overlap")
    if t.cuda_graphs:
        out += ["--cuda-graphs", t.cuda_graphs]
    return out


@pytest.mark.parametrize("label", ["id 4", "id 5", "id 20", "id 33", "id 36"])
def test_estimate_target_megatron_equals_the_benchmark(label, capsys):
    run = next(
        r for r in load_runs(PROFILES_DIR / "runs" / "published_runs.csv") if r.label == label
    )
    bench = estimate_run(run, load_cluster(CLUSTERS[run.hardware]))
    assert main(["estimate", *flags(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["step_time_s"] == pytest.approx(bench.step_time_s, rel=1e-8)
    assert got["tokens_per_s"] == pytest.approx(bench.tokens_per_s, rel=1e-8)
    totals = [st["total_gib"] for st in got["stages"]]
    assert totals == pytest.approx(list(bench.memory_gib_per_stage), rel=1e-8)
    assert got["fits_without_margin"] == bench.fits
