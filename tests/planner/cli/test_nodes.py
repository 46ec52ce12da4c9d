"""`--nodes N` resizes a cluster preset for `piper plan` and `piper estimate`: the outermost
level(s) scaled to N x GPUs per node, the rest kept; a --gpus the preset cannot hold says so."""

from __future__ import annotations

import json

import pytest

from planner.inputs.clusters import load_cluster, with_nodes
from tests.hardening_cli import run_piper

TINY = ["--model", "tiny-moe", "--cluster", "cpu-gloo", "--seq-len", "128",
        "--global-batch", "16"]  # fmt: skip


def _levels(cluster):
    return [(lv.name, lv.devices) for lv in cluster.levels]


@pytest.mark.parametrize(
    "preset, nodes, levels",
    [
        ("h100", 256, [("node", 8), ("leaf", 256), ("spine", 2048)]),
        ("h100", 40, [("node", 8), ("leaf", 256), ("spine", 320)]),
        ("h100", 16, [("node", 8), ("leaf", 128)]),  # inside one leaf: no spine
        ("h100", 1, [("node", 8)]),
        (
            "frontier",
            10000,
            [("package", 2), ("node", 8), ("switch", 32), ("group", 1024), ("system", 80000)],
        ),  # fmt: skip
        ("gb200-nvl72", 20, [("nvl72", 72), ("leaf", 80)]),
    ],
)
def test_resizing_scales_the_outermost_levels(preset, nodes, levels):
    base = load_cluster(preset)
    resized = with_nodes(base, nodes)
    assert _levels(resized) == levels
    assert resized.num_nodes == nodes and resized.total_gpus == nodes * base.gpus_per_node
    assert resized.name == f"{preset}-{nodes}n"
    kept = {lv.name: lv for lv in base.levels}
    for lv in resized.levels:  # bandwidth, latency and taper are the preset's
        assert (lv.bw_gbps, lv.latency_us, lv.taper, lv.kind) == (
            kept[lv.name].bw_gbps, kept[lv.name].latency_us, kept[lv.name].taper,
            kept[lv.name].kind,
        )  # fmt: skip


def test_the_presets_own_size_is_the_preset():
    base = load_cluster("h100")
    assert with_nodes(base, base.num_nodes) is base


def test_gpus_beyond_the_preset_suggest_nodes(tmp_path):
    result = run_piper(["plan", *TINY, "--gpus", "16", "--out", str(tmp_path / "out")])
    assert result.code == 2
    assert result.stderr.splitlines() == [
        "piper plan: error: cluster cpu-gloo: 16 GPUs requested but it has 8 (4 nodes x 2); "
        "lower --gpus or resize it with --nodes 8"
    ]
    assert not (tmp_path / "out").exists()


def test_plan_with_nodes_plans_every_gpu_of_the_resized_cluster(tmp_path):
    out = tmp_path / "out"
    result = run_piper(["plan", *TINY, "--nodes", "8", "--tp", "1", "--out", str(out)])
    assert result.code == 0, result.stderr
    assert "on 16 GPUs of cpu-gloo (8 nodes)" in result.stdout
    plan = json.loads((out / "plan.json").read_text())
    cluster = plan["cluster"]
    assert (cluster["num_nodes"], cluster["gpus"], cluster["name"]) == (8, 16, "cpu-gloo-8n")
    assert [(lv["name"], lv["devices"]) for lv in cluster["levels"]] == [
        ("node", 2),
        ("system", 16),
    ]
    par = plan["parallel"]
    assert par["pp"] * par["dp"] * par["tp"] * par["cp"] == 16


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_a_non_positive_node_count_is_one_line(command, tmp_path):
    layout = ["--pp", "1", "--dp", "8", "--ep", "2"] if command == "estimate" else []
    result = run_piper([command, *TINY, *layout, "--nodes", "0", "--out", str(tmp_path / "o")])
    assert result.code == 2
    assert result.stderr.splitlines() == [
        f"piper {command}: error: --nodes must be a positive integer (nodes of cpu-gloo), "
        "got 0; pass 1 or more"
    ]
    assert not (tmp_path / "o").exists()


def test_estimate_prices_a_layout_on_the_resized_cluster():
    layout = ["--pp", "2", "--dp", "8", "--ep", "4", "--json"]
    too_big = run_piper(["estimate", *TINY, *layout])
    assert too_big.code == 2
    assert too_big.stderr.splitlines() == [
        "piper estimate: error: layout: pp*dp*tp*cp = 16 GPUs but cluster cpu-gloo has 8; "
        "lower pp, dp, tp or cp, or resize it with --nodes 8"
    ]
    result = run_piper(["estimate", *TINY, *layout, "--nodes", "8"])
    assert result.code == 0, result.stderr
    est = json.loads(result.stdout)
    assert est["cluster"] == "cpu-gloo-8n" and est["fits"]
    assert est["tokens_per_s"] == pytest.approx(16 * est["tokens_per_s_per_gpu"])
