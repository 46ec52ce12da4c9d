"""Hand-made specs and traces for the migration tests (no presets needed)."""

from __future__ import annotations

import numpy as np
import pytest

from planner.migration.trace import Trace
from planner.specs import (
    AttentionSpec,
    ClusterSpec,
    DeviceSpec,
    LayerSpec,
    LevelSpec,
    ModelSpec,
    MoESpec,
)


def tiny_model(experts: int = 8, top_k: int = 2) -> ModelSpec:
    """One dense layer then one MoE layer; one expert = 3 * 64 * 128 = 24576 params."""
    att = AttentionSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=16)
    moe = MoESpec(num_experts=experts, top_k=top_k, expert_ffn=128)
    return ModelSpec(
        name="tiny",
        family="test",
        hidden_size=64,
        vocab_size=256,
        layers=(LayerSpec("dense", att, dense_ffn=256), LayerSpec("moe", att, moe=moe)),
    )


def frontier_like() -> ClusterSpec:
    """Packages of 2 devices (200 GB/s), nodes of 8 (50 GB/s), a system of 64 (25 GB/s)."""
    return ClusterSpec(
        name="mini-frontier",
        device=DeviceSpec("gcd", 64.0, (("bf16", 100.0),), 1600.0),
        gpus_per_node=8,
        num_nodes=8,
        nics_per_node=4,
        nic_gbps=25.0,
        levels=(
            LevelSpec("package", 2, 200.0, 1.0),
            LevelSpec("node", 8, 50.0, 2.0),
            LevelSpec("system", 64, 25.0, 5.0),
        ),
        gemm_efficiency=0.5,
    )


@pytest.fixture
def model() -> ModelSpec:
    return tiny_model()


@pytest.fixture
def cluster() -> ClusterSpec:
    return frontier_like()


def make_trace(tokens_ILE, layer_ids=None) -> Trace:
    arr = np.asarray(tokens_ILE, dtype=np.int64)
    ids = tuple(layer_ids) if layer_ids is not None else tuple(range(arr.shape[1]))
    return Trace(arr, ids, "test")


def write_csv(path, rows, header="interval,layer,expert,tokens") -> str:
    text = header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows)
    path.write_text(text)
    return str(path)
