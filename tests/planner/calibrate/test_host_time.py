"""layer_overhead_us from the profile's host-time rows: measured minus the priced compute of the
same layer (planner.resources.layer_cost from the profile's tables), weighted by layer count,
only where the host is the device."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.calibrate.host_time import host_rows, layer_overhead_us
from planner.calibrate.profile_tables import profile_to_cluster_dict
from planner.inputs.clusters import cluster_from_dict, load_cluster
from planner.inputs.models import load_model
from planner.parallel import ParallelConfig
from planner.resources.layer_cost import layer_cost
from planner.specs import SpecError, TrainingSpec
from tests.planner.calibrate.test_profile_tables import raw

HOST_S = {"dense": 0.002, "moe": 0.005}


def _priced(cluster, index: int) -> float:
    training = TrainingSpec(seq_len=64, global_batch=1, dtype="fp32")
    bare = replace(cluster, layer_overhead_us=0.0)
    return layer_cost(load_model("tiny-moe"), index, bare, training,
                      ParallelConfig(pp=1, dp=1, ep=1, micro_batch=1)).time_s  # fmt: skip


def _layers(cluster) -> dict:
    """A layers block whose layers took their priced time plus HOST_S."""
    rows = [{"layer": i, "kind": k, "count": c, "fwd_s": 0.0,
             "bwd_s": _priced(cluster, i) + HOST_S[k]}
            for i, k, c in ((0, "dense", 1), (1, "moe", 3))]  # fmt: skip
    return {"model": "tiny-moe", "seq_len": 64, "micro_batch": 1, "rows": rows}


def _profiled(backend: str):
    base = load_cluster("cpu-gloo")
    plain = profile_to_cluster_dict(raw(), base, "mine")  # the tables that price the layers
    block = _layers(cluster_from_dict(plain))
    measured = raw()
    measured["machine"]["backend"] = backend
    return profile_to_cluster_dict({**measured, "layers": block}, base, "mine")


def test_host_time_is_measured_minus_priced_weighted_by_layer_count():
    out = _profiled("gloo")
    want_us = (1 * HOST_S["dense"] + 3 * HOST_S["moe"]) / 4 * 1e6
    assert out["layer_overhead_us"] == pytest.approx(want_us, abs=0.1)
    rows = {r["kind"]: r for r in out["machine"]["layer_host"]}
    assert rows["moe"]["host_s"] == pytest.approx(HOST_S["moe"], rel=1e-9)
    assert cluster_from_dict(out).layer_overhead_us == pytest.approx(want_us, abs=0.1)


def test_on_nccl_the_rows_are_kept_and_the_constant_is_the_bases():
    out = _profiled("nccl")
    assert out["layer_overhead_us"] == load_cluster("cpu-gloo").layer_overhead_us
    assert len(out["machine"]["layer_host"]) == 2


def test_faster_than_priced_is_no_host_time_and_bounds_hold():
    rows = [{"count": 1, "host_s": 0.0}, {"count": 1, "host_s": 0.0}]
    assert layer_overhead_us(rows) == 0.0
    assert layer_overhead_us([{"count": 1, "host_s": 1.0}]) == 20000.0  # the constant's top


def test_a_layers_block_without_rows_is_one_line():
    with pytest.raises(SpecError, match="layers block lacks 'rows'; re-run 'piper profile'"):
        host_rows({"model": "tiny-moe", "seq_len": 64, "micro_batch": 1},
                  load_cluster("cpu-gloo"), "fp32")  # fmt: skip
