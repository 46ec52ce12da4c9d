"""Cluster presets and YAML parsing: every preset loads and round-trips; bad files are one line."""

from __future__ import annotations

import pytest
import yaml

from planner.inputs.clusters import (
    cluster_from_dict,
    cluster_to_dict,
    cluster_to_yaml,
    list_cluster_presets,
    load_cluster,
)
from planner.specs import SpecError

PRESETS = ("cpu-gloo", "frontier", "gb200-nvl72", "h100", "h200")


def test_presets_are_listed():
    assert set(PRESETS) <= set(list_cluster_presets())


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_round_trips(name, tmp_path):
    c = load_cluster(name)
    assert cluster_from_dict(cluster_to_dict(c), c.source) == c
    path = tmp_path / f"{name}-copy.yaml"
    path.write_text(cluster_to_yaml(c))
    assert load_cluster(str(path)) == c
    sizes = [lv.devices for lv in c.levels]
    assert sizes == sorted(set(sizes)) and sizes[-1] == c.total_gpus
    assert all(0 < lv.taper <= 1 for lv in c.levels)


def test_frontier_numbers():
    c = load_cluster("frontier")
    assert c.device.memory_gib == pytest.approx(64e9 / 2**30, abs=0.05)
    assert c.device.peak("bf16") == 191.5 and c.device.hbm_gbps == 1600
    assert (c.gpus_per_node, c.num_nodes, c.nics_per_node, c.nic_gbps) == (8, 9408, 4, 25)
    by_name = {lv.name: lv for lv in c.levels}
    assert [lv.name for lv in c.levels] == ["package", "node", "switch", "group", "system"]
    assert by_name["package"].bw_gbps == 200 and by_name["package"].devices == 2
    assert by_name["switch"].devices == 4 * 8  # 4 nodes per switch
    assert by_name["group"].devices == 128 * 8
    # one NIC per package: each GCD gets half a NIC
    assert by_name["switch"].bw_gbps == c.nics_per_node * c.nic_gbps / c.gpus_per_node
    assert by_name["system"].taper == 0.57


@pytest.mark.parametrize(
    "name,mem_gb,hbm", [("h100", 80, 3350), ("h200", 141, 4800), ("gb200-nvl72", 186, 8000)]
)
def test_nvidia_presets(name, mem_gb, hbm):
    c = load_cluster(name)
    assert c.device.memory_gib == pytest.approx(mem_gb * 1e9 / 2**30, abs=0.05)
    assert c.device.hbm_gbps == hbm
    nvlink = c.levels[0]
    assert nvlink.kind == "nvlink"
    if name == "gb200-nvl72":
        assert (nvlink.devices, nvlink.bw_gbps, c.gpus_per_node) == (72, 900, 4)
        assert c.device.peak("bf16") == 2500
    else:
        assert (nvlink.devices, nvlink.bw_gbps) == (8, 450)
        assert c.device.peak("bf16") == 989
        assert c.nics_per_node * c.nic_gbps / c.gpus_per_node == 50


def _write(tmp_path, data) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _base() -> dict:
    return cluster_to_dict(load_cluster("cpu-gloo"))


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda d: d.pop("num_nodes"), "num_nodes"),
        (lambda d: d.update(gpus_per_node="two"), "gpus_per_node"),
        (lambda d: d["device"].update(memory_gib=-1), "device.memory_gib"),
        (lambda d: d["levels"][0].update(devices=16), "levels[1].devices"),
        (lambda d: d.update(num_nodes=3), "levels[1].devices"),
        (lambda d: d["levels"][0].update(taper=1.5), "levels[0].taper"),
        (lambda d: d["levels"][1].pop("bw_gbps"), "levels[1].bw_gbps"),
        (
            lambda d: d.update(tables=[{"name": "gemm_bf16", "x": [2, 1], "y": [1, 2]}]),
            "tables[0].x",
        ),
        (lambda d: d.update(tables=[{"name": "gemm_bf16", "x": [1, 2], "y": [1]}]), "tables[0].y"),
    ],  # fmt: skip
)
def test_invalid_files_name_the_file_and_field(tmp_path, edit, field):
    data = _base()
    edit(data)
    path = _write(tmp_path, data)
    with pytest.raises(SpecError) as err:
        load_cluster(path)
    msg = str(err.value)
    assert "\n" not in msg and path in msg and f"'{field}'" in msg


def test_msg_overhead_us_is_an_optional_non_negative_float(tmp_path):
    data = _base()
    data.pop("msg_overhead_us")
    assert load_cluster(_write(tmp_path, data)).msg_overhead_us == 1.0  # presets may omit it
    data["msg_overhead_us"] = 0
    assert load_cluster(_write(tmp_path, data)).msg_overhead_us == 0.0
    data["msg_overhead_us"] = 2.5
    c = load_cluster(_write(tmp_path, data))
    assert c.msg_overhead_us == 2.5 and cluster_to_dict(c)["msg_overhead_us"] == 2.5
    for bad in (-1, "fast", True):
        data["msg_overhead_us"] = bad
        path = _write(tmp_path, data)
        with pytest.raises(SpecError, match=">= 0") as err:
            load_cluster(path)
        msg = str(err.value)
        assert "\n" not in msg and path in msg and "'msg_overhead_us'" in msg


def test_unknown_preset_suggests_close_names():
    with pytest.raises(SpecError, match="did you mean h100") as err:
        load_cluster("h10")
    assert "frontier" in str(err.value) and "\n" not in str(err.value)


def test_cli_exit_code_for_a_bad_cluster(tmp_path, capsys):
    from planner.cli import main

    data = _base()
    data.pop("device")
    rc = main(["estimate", "--model", "tiny-moe", "--cluster", _write(tmp_path, data)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "'device'" in err
