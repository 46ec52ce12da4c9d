"""Measurements -> cluster profile: table names, level naming, device numbers, errors."""

from __future__ import annotations

import pytest
import yaml

from planner.calibrate.profile_tables import comm_level, profile_to_cluster_dict, profile_yaml
from planner.inputs.clusters import cluster_from_dict, load_cluster
from planner.specs import SpecError


def raw(rpn=2, nproc=4, gemm_y=(0.05, 0.2, 0.15)) -> dict:
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
    assert out["device"]["hbm_gbps"] == 20.0
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
