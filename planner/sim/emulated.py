"""The emulated network of benchmarks/halo_emulated.py as a cluster the simulator can run.

The emulation: N network namespaces ("nodes"), each with one veth link to a bridge,
rate-limited by `tc tbf` to `rate_mbit` each way; G gloo ranks per node talk to each other
over loopback (no rate limit; CPU-bound copies through the kernel). Its workload is one
MoE dispatch + combine in float32: every rank sends tokens x topk rows of `dim` floats in
each direction (the combine mirrors the dispatch), with experts spread evenly.

As a ClusterSpec: level "node" (G ranks, loopback bandwidth), level "network" (N x G ranks,
the link rate shared by the node's G ranks), one "NIC" per node at the link rate.
"""

from __future__ import annotations

import math

from planner.halo_sim import simulate_all_to_all
from planner.specs import ClusterSpec, DeviceSpec, LevelSpec

CPU_RANK = DeviceSpec("emulated-cpu-rank", 4.0, (("fp32", 0.1),), 10.0)


def emulated_cluster(
    nodes: int, ranks_per_node: int, rate_mbit: float, loopback_gbps: float, latency_us: float
) -> ClusterSpec:
    """The emulated network as a cluster (bandwidths in GB/s per direction)."""
    link_gbps = rate_mbit / 8000.0
    levels = (
        LevelSpec("node", ranks_per_node, loopback_gbps, latency_us, kind="loopback"),
        LevelSpec(
            "network", nodes * ranks_per_node, link_gbps / ranks_per_node, latency_us, kind="nic"
        ),
    )
    return ClusterSpec(
        name=f"emulated-{nodes}x{ranks_per_node}-{rate_mbit:g}mbit",
        device=CPU_RANK,
        gpus_per_node=ranks_per_node,
        num_nodes=nodes,
        nics_per_node=1,
        nic_gbps=link_gbps,
        levels=levels,
        topology="emulated",
    )


def predict_dispatch_combine_s(
    point: dict,
    overhead_us: float,
    loopback_gbps: float,
    latency_us: float = 50.0,
    experts_per_rank: int = 8,
    elem_bytes: int = 4,
) -> float:
    """Simulated seconds of one dispatch + combine for one emulated measurement.

    Args:
        point: a measurement of halo_emulated.py --json (nodes, ranks_per_node, rate_mbit,
            topk, tokens_per_rank, dim, algo).
        overhead_us: per-message software cost (gloo over TCP plus the dispatcher's Python).
    """
    cluster = emulated_cluster(
        point["nodes"], point["ranks_per_node"], point["rate_mbit"], loopback_gbps, latency_us
    )
    ranks = point["nodes"] * point["ranks_per_node"]
    nbytes = point["tokens_per_rank"] * point["topk"] * point["dim"] * elem_bytes
    one = simulate_all_to_all(
        cluster,
        point["nodes"],
        nbytes,
        point["algo"],
        topk=point["topk"],
        experts=experts_per_rank * ranks,
        overhead_us=overhead_us,
    )
    return 2.0 * one.time_s


def fit_overhead_us(points: list[dict], loopback_gbps: float) -> float:
    """Per-message overhead minimizing the squared log error on `points` (grid search)."""
    grid = [10 ** (k / 40) for k in range(0, 201)]  # 1 us .. 100 ms, 40 per decade

    def loss(o: float) -> float:
        return sum(
            math.log(predict_dispatch_combine_s(p, o, loopback_gbps) / p["median_s"]) ** 2
            for p in points
        )

    return min(grid, key=loss)
