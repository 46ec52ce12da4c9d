"""Readers never crash: any file becomes a valid spec or one SpecError line.

Hypothesis feeds each input reader (model config, cluster YAML, allocation) random bytes,
random values at every key of a real preset (numbers no hardware could hold, wrong types,
nesting) and checks that the reader returns a spec the planner can use (parameters and FLOPs
count, the cluster's topology resolves) or raises SpecError with a single line.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.inputs.allocation import load_allocation
from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model, model_config
from planner.inputs.paths import CLUSTERS_DIR, MODELS_DIR
from planner.resources.flops import flops_per_token
from planner.resources.params import count_params
from planner.specs import SpecError

SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)  # fmt: skip

# Values of every kind a hand-edited or corrupted file can hold at a key.
MAGNITUDES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**18, 10**30, 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 1e-308, 5e-324, 0.5]),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2),
)
RANDOM_BYTES = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"\xff\xfe\x00", b"\x00\x00", b"{", b"[]", b"null", b"1e999", b"- - -"]),
)


def one_line(exc: SpecError) -> bool:
    text = str(exc)
    return bool(text) and "\n" not in text and "Traceback" not in text


def _leaves(doc, path=()):
    """(path, value) of every scalar or container inside a parsed document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield path + (k,), v
            yield from _leaves(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield path + (i,), v
            yield from _leaves(v, path + (i,))


def _set(doc, path, value):
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _mutated(base: dict, data) -> dict:
    doc = copy.deepcopy(base)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p, _ in _leaves(doc)]  # again: a change may replace a subtree
        _set(doc, data.draw(st.sampled_from(paths)), data.draw(MAGNITUDES))
    return doc


def _model_is_usable(path: Path) -> None:
    try:
        model = load_model(str(path))
    except SpecError as exc:
        assert one_line(exc), str(exc)
        return
    counts = count_params(model)
    assert counts.total >= 0 and counts.active >= 0
    flops = flops_per_token(model, 4096)
    assert flops.total >= 0 and flops.mtp >= 0


def _cluster_is_usable(path: Path) -> None:
    try:
        cluster = load_cluster(str(path))
    except SpecError as exc:
        assert one_line(exc), str(exc)
        return
    assert cluster.total_gpus >= 1 and cluster.levels


MODEL = json.loads((MODELS_DIR / "deepseek-v3.json").read_text())
CLUSTER = yaml.safe_load((CLUSTERS_DIR / "h100.yaml").read_text())


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
@SETTINGS
@given(raw=RANDOM_BYTES)
def test_model_config_of_random_bytes(suffix, raw, tmp_path):
    path = tmp_path / f"config{suffix}"
    path.write_bytes(raw)
    _model_is_usable(path)


@SETTINGS
@given(data=st.data())
def test_model_config_with_random_values(data, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_mutated(MODEL, data)))
    _model_is_usable(path)


@SETTINGS
@given(data=st.data())
def test_normalized_model_config_with_random_values(data, tmp_path):
    """The format plan.json embeds (`model_type: piper`, layer groups)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_mutated(model_config(load_model("deepseek-v3")), data)))
    _model_is_usable(path)


@SETTINGS
@given(raw=RANDOM_BYTES)
def test_cluster_yaml_of_random_bytes(raw, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(raw)
    _cluster_is_usable(path)


@SETTINGS
@given(data=st.data())
def test_cluster_yaml_with_random_values(data, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(_mutated(CLUSTER, data)))
    _cluster_is_usable(path)


ALLOCATION = [{"hostname": f"n{i}", "switch": i // 2, "group": 0} for i in range(4)]


@pytest.mark.parametrize("suffix", [".yaml", ".csv"])
@SETTINGS
@given(raw=RANDOM_BYTES)
def test_allocation_of_random_bytes(suffix, raw, tmp_path):
    path = tmp_path / f"alloc{suffix}"
    path.write_bytes(raw)
    try:
        alloc = load_allocation(path)
    except SpecError as exc:
        assert one_line(exc), str(exc)
        return
    assert len(alloc) >= 1


@SETTINGS
@given(data=st.data())
def test_allocation_with_random_values(data, tmp_path):
    path = tmp_path / "alloc.yaml"
    path.write_text(yaml.safe_dump(_mutated({"nodes": ALLOCATION}, data)))
    try:
        alloc = load_allocation(path)
    except SpecError as exc:
        assert one_line(exc), str(exc)
        return
    assert len(alloc) >= 1 and len({n.hostname for n in alloc.nodes}) == len(alloc)
