"""Hand-made specs for the resource-model tests: small enough to compute every number by hand.

A plain module (not conftest.py) so its name is unique in the suite."""

from __future__ import annotations

from planner.specs import (
    AttentionSpec,
    ClusterSpec,
    DeviceSpec,
    LayerSpec,
    LevelSpec,
    ModelSpec,
    MoESpec,
)


def make_model(
    layers: int = 4,
    d: int = 64,
    heads: int = 4,
    experts: int = 8,
    top_k: int = 2,
    ffn: int = 128,
    vocab: int = 256,
    gated: bool = True,
    first_dense: int = 0,
    dense_ffn: int = 256,
    kv_heads: int | None = None,
) -> ModelSpec:
    """MHA (or GQA) model; `first_dense` leading dense layers, the rest MoE."""
    att = AttentionSpec(
        kind="mha" if kv_heads is None else "gqa",
        num_heads=heads,
        num_kv_heads=heads if kv_heads is None else kv_heads,
        head_dim=d // heads,
    )
    moe = MoESpec(num_experts=experts, top_k=top_k, expert_ffn=ffn, gated=gated)
    specs = tuple(
        LayerSpec("dense", att, dense_ffn=dense_ffn)
        if i < first_dense
        else LayerSpec("moe", att, moe=moe)
        for i in range(layers)
    )
    return ModelSpec(name="hand", family="test", hidden_size=d, vocab_size=vocab, layers=specs)


def make_cluster(
    gpus_per_node: int = 4,
    nodes: int = 4,
    memory_gib: float = 80.0,
    nic_gbps: float = 25.0,
    nics_per_node: int = 4,
    tables: tuple = (),
) -> ClusterSpec:
    """Node of `gpus_per_node` at 100 GB/s, then the whole system over NICs (10 us latency)."""
    return ClusterSpec(
        name="hand-cluster",
        device=DeviceSpec("dev", memory_gib, (("bf16", 100.0),), 1000.0),
        gpus_per_node=gpus_per_node,
        num_nodes=nodes,
        nics_per_node=nics_per_node,
        nic_gbps=nic_gbps,
        levels=(
            LevelSpec("node", gpus_per_node, 100.0, 1.0),
            LevelSpec(
                "system", gpus_per_node * nodes, nics_per_node * nic_gbps / gpus_per_node, 10.0
            ),
        ),  # fmt: skip
        framework_overhead_gib=2.0,
        gemm_efficiency=0.5,
        attention_efficiency=0.25,
        tables=tables,
    )
