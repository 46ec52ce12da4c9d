"""Bad input to the model, cluster, node-list, allocation, topology, token-file and engine-log
readers is one SpecError line naming the file and the field (planner/HARDENING.md): zero sizes
and unknown kinds in Piper's model format, keys given twice, nesting past the stack, integers
of thousands of digits, non-finite or absurd numbers, node lists too large to build, a
non-string model_type. Through `piper` it is exit code 2 and one
stderr line without a traceback."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import yaml

from planner.calibrate.logs import parse_log
from planner.inputs.allocation import load_allocation
from planner.inputs.clusters import (
    cluster_from_dict,
    cluster_to_dict,
    list_cluster_presets,
    load_cluster,
)
from planner.inputs.hostlist import MAX_HOSTS, expand_hostlist, load_nodelist
from planner.inputs.models import load_model, model_config, model_from_config
from planner.inputs.slurm_topology import read_topology
from planner.run.token_data import open_token_file
from planner.specs import SpecError
from tests.hardening_cli import run_piper
from tests.planner.calibrate.engine_logs import (
    megatron_log,
    megatron_memory,
    titan_log,
    titan_mesh,
)

DEEP_JSON = "[" * 100_000 + "]" * 100_000
DEEP_YAML = "[" * 800 + "]" * 800  # past the stack: PyYAML recurses a few frames a level
BIG_INT = "9" * 5000


def _one_line_exit_2(argv: list[str], *needles: str) -> str:
    result = run_piper(argv)
    assert result.code == 2, (argv, result.stderr)
    assert len(result.err_lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.err_lines[0], (needle, result.err_lines[0])
    return result.err_lines[0]


def _refused(fn, *needles: str) -> str:
    with pytest.raises(SpecError) as err:
        fn()
    text = str(err.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)
    return text


# ---- 1. Piper's normalized model format -------------------------------------------------

PIPER_CFG = model_config(load_model("mixtral-8x7b"))


def _piper(change) -> dict:
    cfg = copy.deepcopy(PIPER_CFG)
    change(cfg["layer_groups"][0])
    return cfg


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("num_heads", 0, "must be >= 1"),
        ("head_dim", 0, "must be >= 1"),
        ("num_kv_heads", 0, "must be >= 1"),
        ("num_kv_heads", 3, "must divide num_heads"),
        ("sliding_window", 0, "write null for full causal attention"),
        ("kind", ["gqa"], "must be one of mha, gqa, mla"),
        ("kind", "mla", "must be >= 1 for kind 'mla'"),
    ],
)
def test_piper_format_attention_sizes_and_kind(field, value, needle):
    cfg = _piper(lambda g: g["attention"].__setitem__(field, value))
    _refused(lambda: model_from_config(cfg, "m", "plan.json"), "plan.json",
             "layer_groups[0].attention.", needle)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda g: g.__setitem__("kind", ["moe"]), "'layer_groups[0].kind' must be one of dense"),
        (lambda g: g.__setitem__("kind", "sparse"), "'layer_groups[0].kind' must be one of"),
        (lambda g: g.__setitem__("kind", "dense"), "the group has a moe section"),
        (lambda g: g["moe"].__setitem__("expert_ffn", 0), "'layer_groups[0].moe.expert_ffn'"),
        (lambda g: g["moe"].__setitem__("top_k", 0), "'layer_groups[0].moe.top_k'"),
        (lambda g: g.__setitem__("dense_fnn", 8), "did you mean 'layer_groups[0].dense_ffn'"),
        (lambda g: g.__setitem__("count", 10_001), "'layer_groups[0].count' must be <= 10000"),
    ],
)
def test_piper_format_layer_groups(change, needle):
    cfg = _piper(change)
    _refused(lambda: model_from_config(cfg, "m", "plan.json"), "plan.json", needle)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("piper_family", "mix\ntral", "'piper_family' is 'mix\\ntral'"),
        ("piper_family", "", "write a plain name"),
        ("_piper", {"count_unit": "1\n0"}, "'1\\n0'"),
    ],
)
def test_piper_format_names_are_plain_and_quoted_in_one_line(field, value, needle):
    cfg = copy.deepcopy(PIPER_CFG)
    cfg[field] = {**cfg.get(field, {}), **value} if isinstance(value, dict) else value
    _refused(lambda: model_from_config(cfg, "m", "plan.json"), "plan.json", needle)


def test_piper_format_layers_are_counted_across_groups():
    cfg = copy.deepcopy(PIPER_CFG)
    cfg["layer_groups"] = [{**cfg["layer_groups"][0], "count": 9_999}] * 2
    _refused(lambda: model_from_config(cfg, "m", "plan.json"), "'layer_groups[1].count' brings")


def test_piper_format_round_trips_and_refuses_zero_heads_on_the_cli(tmp_path):
    assert model_from_config(copy.deepcopy(PIPER_CFG), "m", "x") == model_from_config(
        PIPER_CFG, "m", "x"
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_piper(lambda g: g["attention"].__setitem__("num_heads", 0))))
    _one_line_exit_2(["model-info", str(path)], str(path), "attention.num_heads")


# ---- 2. config.json / model YAML parsing and numerics ------------------------------------

BASE_JSON = json.dumps(json.loads((Path(__file__).parents[3] / "profiles/models/mixtral-8x7b.json")
                                  .read_text()))  # fmt: skip


@pytest.mark.parametrize(
    ("name", "text", "needles"),
    [
        ("dup.json", BASE_JSON[:-1] + ', "hidden_size": 8}', ("key 'hidden_size'", "twice")),
        ("deep.json", DEEP_JSON, ("nesting deeper",)),
        ("big.json", '{"hidden_size": ' + BIG_INT + "}", ("more than 4300 digits",)),
        ("dup.yaml", "hidden_size: 8\nhidden_size: 9\n", ("line 2", "duplicate key 'hidden_size'")),
        ("deep.yaml", "a: " + DEEP_YAML + "\n", ("nesting deeper",)),
        ("big.yaml", f"hidden_size: {BIG_INT}\n", ("more than 4300 digits",)),
        ("eps.json", BASE_JSON[:-1] + ', "rms_norm_eps": "abc"}', ("key 'rms_norm_eps'",)),
        ("nan.json", BASE_JSON[:-1] + ', "rope_theta": NaN}', ("key 'rope_theta'", "nan")),
        ("type.json", BASE_JSON.replace('"mixtral"', "5"), ("key 'model_type'", "got 5")),
    ],
    ids=[
        "dup.json",
        "deep.json",
        "big.json",
        "dup.yaml",
        "deep.yaml",
        "big.yaml",
        "eps",
        "nan",
        "model_type",
    ],  # fmt: skip
)
def test_model_config_files_are_one_line(tmp_path, name, text, needles):
    path = tmp_path / name
    path.write_text(text)
    _refused(lambda: load_model(str(path)), str(path), *needles)


def test_model_config_faults_on_the_cli(tmp_path, caplog):
    for name, text, needle in [
        ("dup.json", BASE_JSON[:-1] + ', "vocab_size": 8}', "key 'vocab_size'"),
        ("deep.json", DEEP_JSON, "nesting deeper"),
        ("eps.json", BASE_JSON[:-1] + ', "rms_norm_eps": "abc"}', "key 'rms_norm_eps'"),
    ]:
        path = tmp_path / name
        path.write_text(text)
        _one_line_exit_2(["model-info", str(path)], str(path), needle)
    path = tmp_path / "type.json"
    path.write_text(BASE_JSON.replace('"mixtral"', "5"))
    with caplog.at_level(logging.WARNING):
        _one_line_exit_2(["model-info", str(path)], "key 'model_type' must be a string")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---- 3. cluster YAML and the cluster section of plan.json --------------------------------

H100 = cluster_to_dict(load_cluster("h100"))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d["levels"][0].__setitem__("latency_us", float("nan")), "levels[0].latency_us"),
        (lambda d: d["levels"][1].__setitem__("bw_gbps", float("inf")), "levels[1].bw_gbps"),
        (lambda d: d.__setitem__("nics_per_node", 10**30), "'nics_per_node' must be an integer"),
        (lambda d: d.__setitem__("num_nodes", 2**21), "'num_nodes' must be an integer in [1,"),
        (lambda d: d["device"].__setitem__("memory_gib", 1e308), "device.memory_gib"),
        (lambda d: d["device"].__setitem__("memory_gib", "abc"), "device.memory_gib"),
        (lambda d: d["device"]["peak_tflops"].__setitem__("bf16", 1e300), "peak_tflops.bf16"),
        (lambda d: d.__setitem__("msg_overhead_us", 1e300), "'msg_overhead_us'"),
    ],
)
def test_cluster_numbers_are_finite_and_bounded(change, needle):
    d = copy.deepcopy(H100)
    change(d)
    text = _refused(lambda: cluster_from_dict(d, "plan.json cluster"), "plan.json cluster", needle)
    assert "<=" in text or "[1," in text or "must be" in text


def test_every_cluster_preset_loads():
    assert all(load_cluster(name).levels for name in list_cluster_presets())


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("levels:\n  - latency_us: .nan\n", "latency_us"),
        ("name: a\nname: b\n", "line 2 (duplicate key 'name')"),
        ("name: " + DEEP_YAML + "\n", "nesting deeper"),
        (f"num_nodes: {BIG_INT}\n", "more than 4300 digits"),
    ],
    ids=["nan", "dup", "deep", "big"],
)
def test_cluster_files_are_one_line(tmp_path, text, needle):
    d = copy.deepcopy(H100)
    path = tmp_path / "c.yaml"
    if text.startswith("levels"):
        d["levels"][0]["latency_us"] = float("nan")
        path.write_text(yaml.safe_dump(d))
    else:
        path.write_text(text)
    _refused(lambda: load_cluster(str(path)), str(path), needle)
    if text.startswith("levels"):
        argv = ["estimate", "--model", "tiny-moe", "--cluster", str(path), "--gpus", "8"]
        _one_line_exit_2(argv, str(path), "levels[0].latency_us")


# ---- 4. node lists -----------------------------------------------------------------------


def test_a_node_list_is_counted_before_it_is_built(tmp_path, monkeypatch):
    _refused(lambda: expand_hostlist("a[0-9999]b[0-9999]"), "--nodelist", f"{MAX_HOSTS} hosts")
    _refused(lambda: expand_hostlist(f"n[1-{BIG_INT}]"), "--nodelist", "more than 18 digits")
    _refused(lambda: expand_hostlist("n" * 300 + "[1-2]"), "more than a hostname's 253")
    monkeypatch.setattr("planner.inputs.hostlist.MAX_HOSTS", 100)
    hosts = tmp_path / "hosts"
    hosts.write_text("n[0-39]x[0-0]\n" * 3)  # 3 x 40 names: past MAX_HOSTS together
    _refused(lambda: load_nodelist(str(hosts)), f"{hosts}: line 3", "more than 100 hosts")
    assert expand_hostlist("r[1-2]n[01-3]") == ("r1n01", "r1n02", "r1n03", "r2n01", "r2n02",
                                                "r2n03")  # fmt: skip


# ---- 5. allocation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("big.csv", "hostname,switch\n" + "a" * 140_000 + ",1\n", "line 2: not CSV"),
        ("dup.yaml", "- hostname: a\n  hostname: b\n  switch: 1\n", "duplicate key 'hostname'"),
        ("deep.yaml", DEEP_YAML, "nesting deeper"),
        ("big.yaml", f"- hostname: {BIG_INT}\n  switch: 1\n", "more than 4300 digits"),
    ],
    ids=["big.csv", "dup.yaml", "deep.yaml", "big.yaml"],
)
def test_allocation_files_are_one_line(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    _refused(lambda: load_allocation(path), str(path), needle)


# ---- 6. topology -------------------------------------------------------------------------


def test_a_node_under_two_switches_or_blocks_stays_under_the_first_with_a_warning(tmp_path, caplog):
    """Slurm accepts it with a warning ("Multiple leaf switches contain nodes"); so does the
    reader, the first listing winning."""
    conf = tmp_path / "topology.conf"
    conf.write_text("SwitchName=s1 Nodes=n[1-4]\nSwitchName=s2 Nodes=n[4-8]\n")
    with caplog.at_level(logging.WARNING):
        positions = read_topology(str(conf))
    assert positions["n4"][1] == "s1" and positions["n5"][1] == "s2"
    assert "'n4' is listed under switch 's1' and switch 's2'" in caplog.text
    blocks = tmp_path / "blocks.conf"
    blocks.write_text("BlockName=b1 Nodes=n[1-4]\nBlockName=b2 Nodes=n[1-2]\n")
    assert read_topology(str(blocks))["n1"][1] == "b1"


def test_topology_files_that_cannot_be_read_are_one_line(tmp_path):
    sizes = tmp_path / "sizes.conf"
    sizes.write_text(f"BlockName=b1 Nodes=n[1-4]\nBlockSizes=4,{BIG_INT}\n")
    _refused(lambda: read_topology(str(sizes)), f"{sizes}: line 2", "BlockSizes")
    dup = tmp_path / "topology.yaml"
    dup.write_text("- topology: a\n  topology: b\n")
    _refused(lambda: read_topology(str(dup)), str(dup), "duplicate key 'topology'")
    deep = tmp_path / "deep.yaml"
    deep.write_text(DEEP_YAML)
    _refused(lambda: read_topology(str(deep)), str(deep), "nesting deeper")


# ---- 8. engine logs ----------------------------------------------------------------------


def test_absurd_numbers_in_engine_logs_are_one_line():
    good = megatron_log((9.0, 2.0, 2.2))
    line = next(ln for ln in good.splitlines() if " iteration " in ln)
    bad = good.replace(line, line.replace("iteration        1/", f"iteration {BIG_INT}/"))
    _refused(lambda: parse_log(bad, "m.log"), "m.log line", "iteration 99999", "5000 digits")
    memory = megatron_memory(0, 1, 1.0, 2.0).replace("max allocated: 2.00", "max allocated: 2.0.0")
    _refused(lambda: parse_log(good + memory + "\n", "m.log"), "m.log line", "'2.0.0'")
    titan = titan_log((900.0, 1000.0), (1.0, 1.0))
    step = titan.replace("step:  1", f"step: {BIG_INT}")
    _refused(lambda: parse_log(step, "t.log"), "t.log line 3", "step 99999")
    mesh = titan.replace(titan_mesh(), titan_mesh(dp_shard=int("9" * 40)))
    _refused(lambda: parse_log(mesh, "t.log"), "t.log line 1", "dp_shard 99999")


def test_an_absurd_log_on_the_cli_is_one_line(tmp_path):
    from tests.planner.calibrate.test_compare import tiny_plan

    plan = tmp_path / "plan.json"
    plan.write_text(tiny_plan().to_json())
    log = tmp_path / "t.log"
    log.write_text(titan_log((900.0, 1000.0), (1.0, 1.0)).replace("step:  2", f"step: {BIG_INT}"))
    argv = ["calibrate", "--fit", "--log", f"{plan}:{log}", "--out", str(tmp_path / "o.yaml")]
    _one_line_exit_2(argv, f"{log} line 4", "step")


# ---- 9. token file sidecar ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (DEEP_JSON, "nesting deeper"),
        ('{"dtype": "uint16", "vocab_size": ' + BIG_INT + "}", "more than 4300 digits"),
        ('{"dtype": "uint16", "dtype": "uint32"}', "key 'dtype' is given twice"),
        ('{"dtype": "uint16", "tokens": 1e400}', "field 'tokens'"),
        ('{"vocab_size": 10}', "field 'dtype' is missing"),
    ],
    ids=["deep", "big", "dup", "inf", "no-dtype"],
)
def test_token_sidecar_faults_are_one_line(tmp_path, text, needle):
    (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02\x00")
    (tmp_path / "train.json").write_text(text)
    _refused(lambda: open_token_file(str(tmp_path / "train.bin")), "train.json", needle)
