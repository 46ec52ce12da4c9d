"""The emulated network of benchmarks/halo_emulated.py as a cluster the simulator can run.

The emulation: N network namespaces ("nodes"), each with one veth link to a bridge,
rate-limited by `tc tbf` to `rate_mbit` each way; G gloo ranks per node talk to each other
over loopback (no rate limit; CPU-bound copies through the kernel). Its workload is one
MoE dispatch + combine in float32: every rank sends tokens x topk rows of `dim` floats in
each direction (the combine mirrors the dispatch), with experts spread evenly.

As a ClusterSpec: level "node" (G ranks, loopback bandwidth), level "network" (N x G ranks,
the link rate shared by the node's G ranks), one "NIC" per node at the link rate. All
emulated nodes run on the same machine, so every byte sent (over veth or loopback) also
costs the same CPUs. Two ways to account for that host:
- `host_gbps` (predict_dispatch_combine_s): the CPUs as one more link every flow crosses,
  with a per-message overhead; both fitted (fit_parameters);
- a host profile (predict_with_host_profile): the same workload measured with the links
  unthrottled gives the host's time for it (tensor copies, TCP stacks, Python: everything but
  the links); the emulated time is the simulated link time plus the share `alpha` of that host
  time that does not hide behind transfers (the ranks of all nodes compute in lockstep
  between their link phases, so most of it does not); alpha is fitted (fit_alpha).
"""

from __future__ import annotations

import math

from planner.sim.a2a import phase_timings
from planner.sim.network import build_network
from planner.sim.routing import dedup_ratio
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
    host_gbps: float = 0.0,
    direct_below_bytes: float = 0.0,
    experts_per_rank: int = 8,
    elem_bytes: int = 4,
) -> float:
    """Simulated seconds of one dispatch + combine for one emulated measurement.

    Args:
        point: a measurement of halo_emulated.py --json (nodes, ranks_per_node, rate_mbit,
            topk, tokens_per_rank, dim, algo).
        overhead_us: per-message software cost (gloo over TCP plus the dispatcher's Python).
        host_gbps: > 0 adds the machine's CPUs as one link every flow crosses (GB/s of
            payload the host can push through its TCP stacks; all emulated nodes share it).
        direct_below_bytes: the runtime's HALO sends straight to the final ranks (one flat
            round, no dedup) when a rank's message to one remote node, B / N, is smaller
            (a point whose recorded `path` is "direct" is simulated as flat in any case).
    """
    cluster = emulated_cluster(
        point["nodes"], point["ranks_per_node"], point["rate_mbit"], loopback_gbps, latency_us
    )
    net = build_network(cluster, point["nodes"], host_bytes_s=host_gbps * 1e9)
    nbytes = point["tokens_per_rank"] * point["topk"] * point["dim"] * elem_bytes
    algo = point["algo"]
    if algo != "flat" and (
        point.get("path") == "direct" or nbytes / point["nodes"] < direct_below_bytes
    ):
        algo = "flat"  # the runtime's HALO sent every row straight to its rank
    ratio = 1.0
    if algo == "halo-dedup":
        ratio = dedup_ratio(experts_per_rank * net.ranks, net.domains, point["topk"])
    _, phases = phase_timings(net, algo, nbytes, overhead_us * 1e-6, ratio)
    return 2.0 * max(ph.end_s for ph in phases)


def fit_parameters(
    points: list[dict], loopback_gbps: float, direct_below_bytes: float = 0.0
) -> tuple[float, float]:
    """(overhead_us, host_gbps) minimizing the squared log error on `points` (grid search:
    overhead 1 us .. 100 ms and host 0.01 .. 100 GB/s, 10 steps per decade)."""
    overheads = [10 ** (k / 10) for k in range(0, 51)]
    hosts = [10 ** (k / 10) for k in range(-20, 21)]

    def loss(o: float, h: float) -> float:
        return sum(
            math.log(
                predict_dispatch_combine_s(p, o, loopback_gbps, 50.0, h, direct_below_bytes)
                / p["median_s"]
            )
            ** 2
            for p in points
        )

    return min(((o, h) for o in overheads for h in hosts), key=lambda oh: loss(*oh))


def predict_with_host_profile(
    point: dict, host_s: float, alpha: float, latency_us: float = 50.0
) -> float:
    """Emulated seconds of one dispatch + combine = simulated link time + alpha x host time.

    Args:
        point: a measurement of halo_emulated.py --json (see predict_dispatch_combine_s).
        host_s: the same workload's time with the links unthrottled (halo_emulated.py's host
            profile): what the host's CPUs need for it.
        alpha: share of the host time that does not overlap the transfers (0..1).
    The link part is the flow-level simulation of the rate-limited links alone: loopback
    and software cost nothing there, since the host time already holds them.
    """
    link_s = predict_dispatch_combine_s(point, 0.0, 1e6, latency_us)
    return link_s + alpha * host_s


def fit_alpha(points: list[tuple[dict, float]], latency_us: float = 50.0) -> float:
    """alpha in [0, 1.5] (steps of 0.01) minimizing the squared log error on (point, host_s)."""

    def loss(alpha: float) -> float:
        return sum(
            math.log(predict_with_host_profile(p, h, alpha, latency_us) / p["median_s"]) ** 2
            for p, h in points
        )

    return min((k / 100 for k in range(151)), key=loss)
