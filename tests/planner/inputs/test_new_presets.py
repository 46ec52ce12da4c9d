"""The accelerator presets b200, b300, gb300-nvl72, mi300x, mi325x, mi355x and h800: each loads,
carries the data-sheet figures its comments cite (a table of them here, so a typo fails), marks
every named efficiency with its evidence or as an ASSUMPTION, records no fit, and plans
DeepSeek-V3 on a natural size."""

from __future__ import annotations

import re

import pytest
import yaml

from planner.calibrate.uncertainty import describe_source, error_model
from planner.cli import main
from planner.inputs.clusters import list_cluster_presets, load_cluster
from planner.inputs.paths import CLUSTERS_DIR
from planner.plan import load_plan
from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES

NEW = ("b200", "b300", "gb300-nvl72", "mi300x", "mi325x", "mi355x", "h800")

# What the cited documents say, per GPU: dense bf16 / fp8 / fp4 TFLOPS (sparse / 2 where only the
# sparse figure is printed), memory as the device exposes it (GiB), HBM GB/s, scale-up GB/s per
# direction, NIC GB/s per direction.
DATASHEET = {
    # HGX B200: 36 / 72 PFLOPS sparse, FP4 72 dense (8 GPUs); nvidia-smi 183,359 MiB; DGX B200
    # 64 TB/s; NVLink 5 1.8 TB/s bidirectional; ConnectX-7 400 Gb/s
    "b200": dict(bf16=2250, fp8=4500, nvfp4=9000, mem=183359 / 1024, hbm=8000, up=900, nic=50),
    # HGX B300: FP4 105 PFLOPS dense; nvidia-smi 275,040 MiB; ConnectX-8 800 Gb/s
    "b300": dict(bf16=2250, fp8=4500, nvfp4=13125, mem=275040 / 1024, hbm=8000, up=900, nic=100),
    # GB300 NVL72: 360 / 720 PFLOPS sparse, FP4 1,080 dense (72 GPUs); nvidia-smi 284,208 MiB
    "gb300-nvl72": dict(
        bf16=2500, fp8=5000, nvfp4=15000, mem=284208 / 1024, hbm=8000, up=900, nic=100
    ),
    # MI300X: 1,307.4 / 2,614.9 dense; rocm-smi 206,141,652,992 B; 5.3 TB/s; 7 x 128 GB/s bidir
    "mi300x": dict(bf16=1307.4, fp8=2614.9, mem=206141652992 / 2**30, hbm=5300, up=448, nic=50),
    # MI325X: the MI300X die with 256 GB HBM3E at 6 TB/s (exposed memory an ASSUMPTION)
    "mi325x": dict(bf16=1307.4, fp8=2614.9, mem=255.98, hbm=6000, up=448, nic=50),
    # MI355X: 2.5 / 5.0 / MXFP4 10.1 PFLOPS dense; rocm-smi 309,220,868,096 B; 7 x 153.6 GB/s
    "mi355x": dict(
        bf16=2516.6, fp8=5033.2, mxfp4=10066.3, mem=309220868096 / 2**30, hbm=8000, up=537.6,
        nic=50,
    ),
    # H800 SXM: 1,979 / 3,958 sparse; nvidia-smi 81,559 MiB; 3.35 TB/s; NVLink 400 GB/s
    # bidirectional; DeepSeek-V3 report 3.1: 2,048 GPUs, 8 per node, 400 Gb/s IB per GPU
    "h800": dict(bf16=989, fp8=1979, mem=81559 / 1024, hbm=3350, up=200, nic=50, gpus=2048),
}  # fmt: skip


@pytest.mark.parametrize("name", NEW)
def test_the_preset_carries_the_cited_figures(name):
    c = load_cluster(name)
    want = DATASHEET[name]
    peak = dict(c.device.peak_tflops)
    for dtype in ("bf16", "fp8", "nvfp4", "mxfp4"):
        if dtype in want:
            assert peak[dtype] == want[dtype], dtype
    assert peak["fp16"] == peak["bf16"]
    assert c.device.memory_gib == pytest.approx(want["mem"], abs=0.01)
    assert c.device.hbm_gbps == want["hbm"]
    assert c.levels[0].bw_gbps == want["up"]
    assert c.levels[0].kind in ("nvlink", "infinity-fabric")
    assert c.nic_gbps == want["nic"] and c.nics_per_node == c.gpus_per_node
    assert all(lv.bw_gbps == want["nic"] for lv in c.levels[1:])
    if "gpus" in want:
        assert c.total_gpus == want["gpus"]


def test_block_scaled_fp4_is_where_the_part_has_it():
    """NVFP4 on Blackwell only; MXFP4 on Blackwell and CDNA4; neither on Hopper or CDNA3."""
    have = {n: {k for k, _ in load_cluster(n).device.peak_tflops} for n in NEW}
    assert {n for n in NEW if "nvfp4" in have[n]} == {"b200", "b300", "gb300-nvl72"}
    assert {n for n in NEW if "mxfp4" in have[n]} == {"b200", "b300", "gb300-nvl72", "mi355x"}


@pytest.mark.parametrize("name", NEW)
def test_every_named_efficiency_is_cited_or_marked_and_in_bounds(name):
    text = (CLUSTERS_DIR / f"{name}.yaml").read_text()
    c = load_cluster(name)
    for eff in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES):
        assert eff.low <= getattr(c, eff.name) <= eff.high, eff.name
        line = re.search(rf"^{eff.name}:.*$", text, re.MULTILINE)
        if line is None:  # left at the model's default
            continue
        comment = line.group(0).partition("#")[2]
        cited = re.search(r"\[[a-z0-9-]+\]|issue \d+", comment)  # a source tag or an issue
        assert "ASSUMPTION (from " in comment or cited, eff.name


@pytest.mark.parametrize("name", NEW)
def test_no_fit_is_recorded_so_the_interval_is_the_uncalibrated_default(name):
    data = yaml.safe_load((CLUSTERS_DIR / f"{name}.yaml").read_text())
    assert "calibration" not in data
    c = load_cluster(name)
    assert not error_model(c).calibrated and error_model(c).runs == 0
    assert "without" in describe_source(c)


def test_the_presets_are_listed(capsys):
    assert set(NEW) <= set(list_cluster_presets())
    # an unknown preset answers with the list of presets, the new ones in it
    assert main(["estimate", "--model", "tiny-moe", "--cluster", "no-such-gpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    listed = err.split("presets: ")[1].split(", ")
    assert set(NEW) <= {name.strip() for name in listed}


@pytest.mark.parametrize("name", ["b200", "mi355x", "h800"])
def test_deepseek_v3_plans_on_256_gpus(name, tmp_path):
    args = ["plan", "--model", "deepseek-v3", "--cluster", name, "--gpus", "256",
            "--time-limit-s", "5", "--no-plots", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    plan = load_plan(tmp_path / "plan.json")
    par = plan.parallel
    assert par.pp * par.dp * par.tp * par.cp == 256
    assert [layer for s in plan.stages for layer in s.layers] == list(range(61))
    assert plan.predicted.usable_memory_gib == load_cluster(name).device.memory_gib
    assert max(plan.predicted.memory_gib_per_stage) <= plan.predicted.usable_memory_gib
    assert plan.predicted.step_time_s > 0 and 0 < plan.predicted.mfu < 1
