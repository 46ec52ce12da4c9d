"""Measurements -> cluster profile: table names, level naming, device numbers, errors."""

from __future__ import annotations

import pytest
import yaml

from planner.calibrate.profile_tables import comm_level, profile_to_cluster_dict, profile_yaml
from planner.inputs.clusters import cluster_from_dict, load_cluster
from planner.specs import SpecError


def raw(rpn=2, nproc=4, gemm_y=(0.05, 0.2, 0.15), **extra) -> dict:
    return {
        "machine": {
            "hostname": "h",
            "device": "cpu-x",
            "torch": "2",
            "date": "d",
            "backend": "gloo",
            "nproc": nproc,
            "ranks_per_node": rpn,
            "dtype": "fp32",
        },
        "compute": {
            "gemm": {"x": [64, 16, 256], "y": list(gemm_y)},  # unsorted on purpose
            "gemm_grouped": {"x": [8, 32], "y": [0.01, 0.02]},
            "gemm_looped": {"x": [8, 32], "y": [0.005, 0.02]},
            "attention": {"x": [128, 256], "y": [0.01, 0.03]},
            "membw": {"x": [1e6, 1e7], "y": [20.0, 12.0]},
            **extra,
        },
        "comm": [
            {"kind": "p2p", "ranks": [0, 1], "x": [1024, 4096], "y": [0.1, 0.4]},
            {"kind": "p2p", "ranks": [0, 2], "x": [1024, 4096], "y": [0.05, 0.2]},
            {"kind": "a2a", "ranks": [0, 1], "x": [4096], "y": [0.3]},
            {"kind": "a2a", "ranks": [0, 1, 2, 3], "x": [4096], "y": [0.1]},
        ],
    }


def test_tables_named_for_the_planner_and_sorted():
    base = load_cluster("cpu-gloo")  # levels: node (2), system (8)
    out = profile_to_cluster_dict(raw(), base, "mine")
    tables = {t["name"]: t for t in out["tables"]}
    assert set(tables) == {
        "gemm_fp32",
        "gemm_grouped_fp32",
        "gemm_looped_fp32",
        "attention_fp32",
        "membw",
        "p2p_node",
        "p2p_system",
        "a2a_node",
        "a2a_system",
    }
    assert tables["gemm_fp32"]["x"] == [16.0, 64.0, 256.0]
    assert tables["gemm_fp32"]["y"] == [0.2, 0.05, 0.15]
    # the largest copy (10 MB at 12 GB/s), not the cache-sized one at 20
    assert out["device"]["hbm_gbps"] == 12.0
    # measured 0.2 TFLOPS > declared 0.1 fp32 peak: the peak rises, efficiency = 1
    assert out["device"]["peak_tflops"]["fp32"] == 0.2
    assert out["gemm_efficiency"] == 1.0
    assert out["attention_efficiency"] == pytest.approx(0.03 / 0.2)
    assert out["machine"]["hostname"] == "h"
    text = profile_yaml(out)
    again = cluster_from_dict(yaml.safe_load(text))
    assert again.table("a2a_system").y == (0.1,) and again.name == "mine"


def test_efficiency_below_peak_is_kept_as_fraction():
    base = load_cluster("cpu-gloo")
    out = profile_to_cluster_dict(raw(gemm_y=(0.01, 0.05, 0.02)), base, "m")
    assert out["device"]["peak_tflops"]["fp32"] == 0.1
    assert out["gemm_efficiency"] == pytest.approx(0.5)


def test_comm_level_maps_measured_nodes_onto_the_base():
    base = load_cluster("frontier")  # package (2), node (8), switch (32), ...
    assert comm_level(base, [0, 1], 8) == "package"
    assert comm_level(base, [0, 2], 8) == "node"
    assert comm_level(base, [0, 8], 8) == "switch"
    # 1 rank per measured node: ranks 0 and 1 sit on different nodes
    assert comm_level(base, [0, 1], 1) == "switch"
    with pytest.raises(SpecError, match="ranks-per-node"):
        comm_level(load_cluster("cpu-gloo"), [0, 1], 4)


def test_missing_field_is_a_spec_error():
    bad = raw()
    del bad["compute"]
    with pytest.raises(SpecError, match="compute"):
        profile_to_cluster_dict(bad, load_cluster("cpu-gloo"), "m")


PERMUTE = {
    "permute": {"x": [4096, 1024], "y": [6.0, 3.0], "topk": 2, "hidden": 64},
    "unpermute": {"x": [4096, 1024], "y": [4.0, 3.0], "topk": 2, "hidden": 64},
}


def test_hbm_efficiency_is_what_the_permute_pair_reaches():
    base = load_cluster("cpu-gloo")
    out = profile_to_cluster_dict(raw(**PERMUTE), base, "m")
    # pair at 4096: bytes over summed time = 2 / (1/6 + 1/4) = 4.8 GB/s; at 1024: 3; best 4.8
    assert out["hbm_efficiency"] == pytest.approx(4.8 / 12.0)
    tables = {t["name"]: t for t in out["tables"]}
    assert tables["permute_fp32"] == {
        "name": "permute_fp32",
        "x": [1024.0, 4096.0],
        "y": [3.0, 6.0],
    }
    assert tables["unpermute_fp32"]["y"] == [3.0, 4.0]
    cluster = cluster_from_dict(yaml.safe_load(profile_yaml(out)))
    assert cluster.hbm_efficiency == pytest.approx(0.4)
    assert cluster.hbm_bytes_per_s == pytest.approx(4.8e9)  # memory-bound work as measured


@pytest.mark.parametrize(("gbps", "want"), [(1.0, 0.3), (30.0, 1.0)])
def test_hbm_efficiency_held_within_its_bounds(gbps, want):
    perm = {k: {**v, "y": [gbps, gbps]} for k, v in PERMUTE.items()}
    out = profile_to_cluster_dict(raw(**perm), load_cluster("cpu-gloo"), "m")
    assert out["hbm_efficiency"] == want


def test_without_permute_the_base_hbm_efficiency_stays():
    base = load_cluster("h200")
    out = profile_to_cluster_dict(raw(rpn=1, nproc=1), base, "m")
    assert out["hbm_efficiency"] == base.hbm_efficiency
    assert not any(t["name"].startswith("permute") for t in out["tables"])


def test_every_expert_shape_and_head_dim_gets_a_table():
    extra = {
        "gemm_grouped_shapes": [
            {"model": "a", "k": 64, "n": 64, "x": [8, 32], "grouped": [0.01, 0.02]},
            {"model": "b", "k": 128, "n": 32, "x": [32, 8], "grouped": [0.03, 0.01]},
        ],
        "attention_head_dims": [
            {"head_dim": 32, "x": [128, 256], "y": [0.01, 0.03]},
            {"head_dim": 16, "x": [128, 256], "y": [0.005, 0.02]},
        ],
    }
    extra["attention"] = {"x": [128, 256], "y": [0.01, 0.03], "head_dim": 32}
    out = profile_to_cluster_dict(raw(**extra), load_cluster("cpu-gloo"), "m")
    tables = {t["name"]: t for t in out["tables"]}
    assert tables["gemm_grouped_fp32_64x64"]["y"] == [0.01, 0.02]
    assert tables["gemm_grouped_fp32_128x32"] == {
        "name": "gemm_grouped_fp32_128x32", "x": [8.0, 32.0], "y": [0.01, 0.03]
    }  # fmt: skip
    assert tables["attention_fp32_hd16"]["y"] == [0.005, 0.02]
    assert "attention_fp32_hd32" not in tables  # the main attention table is head dim 32
