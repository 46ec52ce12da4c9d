"""Communication time per topology level: all-to-all (flat and HALO), p2p, ring collectives.

Formulas are derived in planner/RESOURCE_MODEL.md (section "Communication"). Conventions:
bytes are bytes (elements x 2 for bf16), bandwidths GB/s = 1e9 B/s per device per direction,
`LevelSpec.bw_gbps` is the per-device bandwidth of traffic that crosses that level, thinned by
its `taper`, and `latency_us` is charged once per message that crosses the level (messages
leave a device one after another, so the per-message cost adds up: this is what makes a flat
all-to-all over many nodes slow and what HALO's packing removes). Levels outside the local
domain (see local_domain_devices) share the device's NIC share, so their loads add up.

A group of n devices is laid out as n consecutive, aligned devices (the rank IP may do
better or worse on a real allocation; planner.topology gives the level it spans).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from planner.resources.tables import lookup
from planner.specs import ClusterSpec, LevelSpec, SpecError
from planner.topology import contiguous_span, span_level_index

Algo = Literal["flat", "halo"]
ALGOS: tuple[str, ...] = ("flat", "halo")


@dataclass(frozen=True)
class Crossing:
    """Traffic of one rank of a group that crosses one level: fraction of its bytes and the
    number of peers (messages) reached across that level."""

    level: LevelSpec
    fraction: float
    peers: int


def crossings(cluster: ClusterSpec, group_devices: int) -> list[Crossing]:
    """Per level, the share of a uniform all-to-all's bytes (and peers) that cross it, for a
    group of `group_devices` consecutive devices: a rank reaches min(D_l, n) - min(D_(l-1), n)
    peers whose nearest common domain is level l (D = devices per domain, D_(-1) = 1)."""
    n = group_devices
    out, inner = [], 1
    for lv in cluster.levels:
        reach = min(lv.devices, n)
        if reach > inner:
            out.append(Crossing(lv, (reach - inner) / n, reach - inner))
        inner = reach
        if reach >= n:
            break
    return out


def local_domain_devices(cluster: ClusterSpec) -> int:
    """Devices of HALO's local domain: the outermost level faster than the device's NIC share
    (a node of 8 on Frontier or H100, the 72-GPU NVLink domain on GB200 NVL72)."""
    nic_share = cluster.nics_per_node * cluster.nic_gbps / cluster.gpus_per_node
    fast = [lv.devices for lv in cluster.levels if lv.bw_gbps > nic_share]
    return fast[-1] if fast else 1


def _crossing_time_s(
    cluster: ClusterSpec, bytes_per_rank: float, parts: list[Crossing], msg_scale: float = 1.0
) -> float:
    """Time for a rank's traffic split over levels by `parts`.

    Levels inside the local domain (NVLink, Infinity Fabric) are separate links that work in
    parallel: each costs its bytes / bandwidth. Levels outside it all start at the device's
    NIC, so traffic to farther levels also loads the nearer ones: network level j carries
    the bytes of every level >= j, at its bandwidth x taper. Every message crossing a level
    costs that level's latency once (messages leave one after another); `msg_scale` scales
    message counts (HALO sends one packed message per remote domain).
    """
    local = local_domain_devices(cluster)
    inner = [c for c in parts if c.level.devices <= local]
    net = [c for c in parts if c.level.devices > local]
    times = [
        bytes_per_rank * c.fraction / (c.level.bw_gbps * c.level.taper * 1e9)
        + c.peers * msg_scale * c.level.latency_us * 1e-6
        for c in inner
    ]
    if net:
        latency = sum(c.peers * msg_scale * c.level.latency_us * 1e-6 for c in net)
        carried = [
            bytes_per_rank
            * sum(o.fraction for o in net[j:])
            / (c.level.bw_gbps * c.level.taper * 1e9)
            for j, c in enumerate(net)
        ]
        times.append(max(carried) + latency)
    return max(times, default=0.0)


def flat_all_to_all_s(cluster: ClusterSpec, group_devices: int, bytes_per_rank: float) -> float:
    """Analytic flat (NCCL/RCCL-style) all-to-all: every rank sends bytes_per_rank / n to
    each of the n ranks directly."""
    return _crossing_time_s(cluster, bytes_per_rank, crossings(cluster, group_devices))


def halo_all_to_all_s(cluster: ClusterSpec, group_devices: int, bytes_per_rank: float) -> float:
    """Analytic HALO: Phase I (intra-domain all-to-all of the G/n local share) runs beside
    Phase II (remote rows packed per destination domain, one message per remote domain to the
    rail peer) followed by Phase III (redistribution of the received rows inside the domain).
    t = max(t_I, t_II + t_III). Equal to flat when the group fits in one local domain."""
    n = group_devices
    g = local_domain_devices(cluster)
    if n <= g:
        return flat_all_to_all_s(cluster, n, bytes_per_rank)
    local_share = g / n
    t_1 = flat_all_to_all_s(cluster, g, bytes_per_rank * local_share)
    remote = [c for c in crossings(cluster, n) if c.level.devices > g]
    t_2 = _crossing_time_s(cluster, bytes_per_rank, remote, msg_scale=1.0 / g)
    t_3 = flat_all_to_all_s(cluster, g, bytes_per_rank * (1.0 - local_share))
    return max(t_1, t_2 + t_3)


def all_to_all_time_s(
    cluster: ClusterSpec, group_devices: int, bytes_per_rank: float, algo: str
) -> float:
    """Seconds for one all-to-all in which each of `group_devices` ranks sends
    `bytes_per_rank` bytes in total (including its own share), by the analytic model.

    algo: "flat" (direct sends) or "halo" (hierarchical, see halo_all_to_all_s).
    """
    if algo not in ALGOS:
        raise SpecError(f"all-to-all algo '{algo}' is unknown; use one of {', '.join(ALGOS)}")
    if group_devices <= 1 or bytes_per_rank <= 0:
        return 0.0
    if algo == "halo":
        return halo_all_to_all_s(cluster, group_devices, bytes_per_rank)
    return flat_all_to_all_s(cluster, group_devices, bytes_per_rank)


def a2a_time_s(
    cluster: ClusterSpec, group_devices: int, bytes_per_rank: float, algo: str
) -> tuple[float, str, tuple[str, ...]]:
    """One all-to-all for the resource model: the measured `a2a_<level>` table of the level the
    group spans when present (flat only: the profiler measures the flat collective), else the
    analytic model. Returns (seconds, level name, measured tables used)."""
    span = contiguous_span(cluster, group_devices)
    if span is None or bytes_per_rank <= 0:
        return 0.0, "", ()
    name = f"a2a_{span.name}"
    measured = lookup(cluster, name, bytes_per_rank) if algo == "flat" else None
    if measured is not None:
        return bytes_per_rank / (measured * 1e9), span.name, (name,)
    return all_to_all_time_s(cluster, group_devices, bytes_per_rank, algo), span.name, ()


def a2a_lower_bound_s(
    micro_batch_group: float,
    seq_len: int,
    top_k: int,
    hidden: int,
    ep: int,
    nic_gbps: float,
    bytes_per_element: int = 2,
) -> float:
    """The paper's bound for the four all-to-alls of one MoE layer and micro-batch:
    T >= 4 b s k d / (EP B_NIC), with b the sequences of the whole EP group, d in elements
    converted to bytes (x2 for bf16) and B_NIC the per-GPU NIC bandwidth in GB/s."""
    elems = 4.0 * micro_batch_group * seq_len * top_k * hidden
    return elems * bytes_per_element / (ep * nic_gbps * 1e9)


def p2p_time_s(
    cluster: ClusterSpec, devices: tuple[int, int], message_bytes: float
) -> tuple[float, str, tuple[str, ...]]:
    """One point-to-point message between two devices: the `p2p_<level>` table when present,
    else latency + bytes / bandwidth of the level they span. Returns (s, level, tables)."""
    idx = span_level_index(cluster, devices)
    if idx < 0 or message_bytes <= 0:
        return 0.0, "", ()
    lv = cluster.levels[idx]
    name = f"p2p_{lv.name}"
    measured = lookup(cluster, name, message_bytes)
    if measured is not None:
        return message_bytes / (measured * 1e9), lv.name, (name,)
    t = lv.latency_us * 1e-6 + message_bytes / (lv.bw_gbps * lv.taper * 1e9)
    return t, lv.name, ()


def ring_allreduce_s(
    cluster: ClusterSpec, group_size: int, stride: int, nbytes: float, passes: float = 2.0
) -> tuple[float, str]:
    """Ring collective over `group_size` devices `stride` apart: each device moves
    passes * (n - 1) / n * nbytes over the slowest level the group spans, in
    passes * (n - 1) latency-bound steps. passes = 2 for all-reduce (reduce-scatter +
    all-gather), 1 for reduce-scatter or all-gather alone. Returns (seconds, level name)."""
    n = group_size
    if n <= 1 or nbytes <= 0:
        return 0.0, ""
    lv = cluster.levels[span_level_index(cluster, [i * stride for i in range(n)])]
    steps = passes * (n - 1)
    t = steps / n * nbytes / (lv.bw_gbps * lv.taper * 1e9) + steps * lv.latency_us * 1e-6
    return t, lv.name
