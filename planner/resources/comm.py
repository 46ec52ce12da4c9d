"""Communication time per topology level: all-to-all (flat and HALO), p2p, ring collectives.

Formulas are derived in planner/RESOURCE_MODEL.md (section "Communication"). Conventions:
bytes are bytes (elements x 2 for bf16), bandwidths GB/s = 1e9 B/s per device per direction,
`LevelSpec.bw_gbps` is the per-device bandwidth of traffic that crosses that level, thinned by
its `taper`. Levels outside the local domain (see local_domain_devices) share the device's
NIC share, so their loads add up.

All-to-all: the closed form of the flow-level simulator's per-message model (planner/sim/a2a.py,
planner/SIMULATOR.md). A phase in which a rank sends m messages costs
    T = latency + max(m x o, o + t_bw)
with o = `ClusterSpec.msg_overhead_us` (the sender posts its messages one after another, o
each, while the posted data drains), latency = the largest `latency_us` of the levels the
phase crosses (paid once: the messages are in flight together) and t_bw = the busiest link's
bytes / bandwidth (bandwidth_s). HALO posts Phase II before Phase I, and Phase III starts
when Phase II has arrived and all Phase I and II messages are posted.

Stragglers (straggler_s): a collective that crosses the network completes when its slowest
member does. With each member delayed by an independent exponential of mean
tau = `ClusterSpec.network_jitter_us`, the expected wait is tau x H_n for n members (H_n the
n-th harmonic number, ~ ln n + 0.577). Added to the analytic all-to-all and to the ring
collectives; 0 when tau = 0 or the group stays inside the local domain.

A group of n devices is laid out as n aligned devices `stride` apart (consecutive when
stride = 1; an EP group is ep ranks etp apart, FORMULATION.md's rank convention); the rank IP
may do better or worse on a real allocation; planner.topology gives the level it spans.
HALO-dedup is HALO whose Phase II carries one row per (token, remote domain) instead of one
per (token, expert): its network bytes x dedup_ratio. DeepEP's
node-deduplicated dispatch is in planner.resources.deepep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from planner.resources.tables import lookup
from planner.specs import ClusterSpec, LevelSpec, SpecError
from planner.topology import contiguous_span, span_level_index

Algo = Literal["flat", "halo", "halo-dedup"]
ALGOS: tuple[str, ...] = ("flat", "halo", "halo-dedup")


@dataclass(frozen=True)
class Crossing:
    """Traffic of one rank of a group that crosses one level: fraction of its bytes and the
    number of peers (messages) reached across that level."""

    level: LevelSpec
    fraction: float
    peers: int


def crossings(cluster: ClusterSpec, group_devices: int, stride: int = 1) -> list[Crossing]:
    """Per level, the share of a uniform all-to-all's bytes (and peers) that cross it, for a
    group of `group_devices` devices `stride` apart: a rank reaches min(M_l, n) - min(M_(l-1),
    n) peers whose nearest common domain is level l (M_l = max(D_l // stride, 1) members in a
    domain of D_l devices, M_(-1) = 1)."""
    n = group_devices
    out, inner = [], 1
    for lv in cluster.levels:
        reach = min(max(lv.devices // stride, 1), n)
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


def _nic_share_gbps(cluster: ClusterSpec) -> float:
    """GB/s of one NIC available to each device on the busiest NIC (GPU-NIC affinity: device j
    of a node uses NIC j x nics // gpus, as in planner.sim.network)."""
    per_nic = [0] * max(cluster.nics_per_node, 1)
    for j in range(cluster.gpus_per_node):
        per_nic[j * cluster.nics_per_node // cluster.gpus_per_node] += 1
    return cluster.nic_gbps / max(per_nic)


def bandwidth_s(cluster: ClusterSpec, bytes_per_rank: float, parts: list[Crossing]) -> float:
    """Transfer time (bytes only) of a rank's traffic split over levels by `parts`.

    Levels inside the local domain (NVLink, Infinity Fabric) are separate links that work in
    parallel: each costs its bytes / bandwidth. Levels outside it all start at the device's
    NIC, so traffic to farther levels also loads the nearer ones: network level j carries
    the bytes of every level >= j, at its bandwidth x taper, and the NIC carries them all.
    """
    local = local_domain_devices(cluster)
    times = [
        bytes_per_rank * c.fraction / cluster.link_bytes_per_s(c.level)
        for c in parts
        if c.level.devices <= local
    ]
    net = [c for c in parts if c.level.devices > local]
    if net:
        total = sum(c.fraction for c in net)
        nic = _nic_share_gbps(cluster) * 1e9 * cluster.scale_out_efficiency
        times.append(bytes_per_rank * total / nic)
        times += [
            bytes_per_rank * sum(o.fraction for o in net[j:]) / cluster.link_bytes_per_s(c.level)
            for j, c in enumerate(net)
        ]
    return max(times, default=0.0)


def latency_s(parts: list[Crossing]) -> float:
    """The latency of the slowest level crossed: messages in flight overlap their latencies."""
    return max((c.level.latency_us for c in parts), default=0.0) * 1e-6


def phase_s(
    cluster: ClusterSpec,
    messages: float,
    transfer_s: float,
    latency_s: float,
    posted_before: float = 0.0,
) -> float:
    """One phase of `messages` per rank, posted after `posted_before` earlier ones:
    latency + max((posted_before + messages) x o, o + transfer)."""
    o = cluster.msg_overhead_us * 1e-6
    return latency_s + max((posted_before + messages) * o, o + transfer_s)


EULER_GAMMA = 0.5772156649015329
EXACT_HARMONIC_TERMS = 64  # beyond this the asymptotic series is exact to < 1e-13


def harmonic(n: int) -> float:
    """H_n = 1 + 1/2 + ... + 1/n (0 for n < 1): summed up to EXACT_HARMONIC_TERMS, else
    ln n + gamma + 1/(2n) - 1/(12 n^2) + 1/(120 n^4) (error below 1/(252 n^6))."""
    if n <= EXACT_HARMONIC_TERMS:
        return sum(1.0 / i for i in range(1, n + 1))
    return math.log(n) + EULER_GAMMA + 1.0 / (2 * n) - 1.0 / (12 * n**2) + 1.0 / (120 * n**4)


def straggler_s(cluster: ClusterSpec, group_devices: int, stride: int = 1) -> float:
    """Expected wait for the slowest of a collective's `group_devices` members when the group
    crosses the network: network_jitter_us x H_n, the mean of the largest of n independent
    exponential delays of mean network_jitter_us (Renyi's representation of exponential order
    statistics). 0 when the constant is 0 or every member sits in one local domain (HALO's:
    a node on Frontier or H100, the NVLink rack on GB200)."""
    if cluster.network_jitter_us <= 0 or group_devices <= 1:
        return 0.0
    span = (group_devices - 1) * stride + 1
    if span <= local_domain_devices(cluster):
        return 0.0
    return cluster.network_jitter_us * 1e-6 * harmonic(group_devices)


def flat_all_to_all_s(
    cluster: ClusterSpec, group_devices: int, bytes_per_rank: float, stride: int = 1
) -> float:
    """Analytic flat (NCCL/RCCL-style) all-to-all: every rank sends bytes_per_rank / n to
    each of the n - 1 other ranks directly, one message each:
    latency + max((n - 1) o, o + t_bw)."""
    parts = crossings(cluster, group_devices, stride)
    if not parts:
        return 0.0
    t_bw = bandwidth_s(cluster, bytes_per_rank, parts)
    return phase_s(cluster, group_devices - 1, t_bw, latency_s(parts))


def distinct_groups(groups: int, experts: int, top_k: int) -> float:
    """Expected distinct groups (of experts / groups experts each) that a token's top_k
    distinct experts fall in, uniform routing: R (1 - C(E - E/R, k) / C(E, k))."""
    if groups <= 1:
        return float(groups)
    return groups * hit_probability(experts, experts // groups, top_k)


def hit_probability(experts: float, held: float, top_k: int) -> float:
    """Probability that a token's top_k distinct experts, drawn uniformly from `experts`,
    include one of `held` of them: 1 - C(E - e, k) / C(E, k), as a product."""
    miss = 1.0
    for i in range(top_k):
        miss *= max(experts - held - i, 0.0) / (experts - i)
    return 1.0 - miss


def dedup_ratio(
    cluster: ClusterSpec, group_devices: int, experts: int, top_k: int, stride: int = 1
) -> float:
    """Remote bytes of HALO-dedup over HALO's for uniform routing of top_k of `experts` spread
    evenly over the group's n members, g of them per local domain (the last domain holds
    n mod g when g does not divide n). A token of a source in domain s sends one row to each
    remote domain q it hits, probability p_q (hit_probability of q's experts), against
    k (E - e_s) / E copies without dedup; the ratio of the two sums over the sources (D(Q) / k
    for Q equal domains; 1 inside one domain and for top-1 routing). The group starts on a
    domain boundary, as every group of this module does (the first EP group of a mesh; a
    later one whose ep does not divide the domain may straddle it otherwise)."""
    n = group_devices
    g = min(max(local_domain_devices(cluster) // stride, 1), n)
    if g >= n or top_k <= 1:
        return 1.0
    sizes = [g] * (n // g) + ([n % g] if n % g else [])
    held = [experts * size / n for size in sizes]
    hits = [hit_probability(experts, e, top_k) for e in held]
    unique = sum(size * (sum(hits) - hit) for size, hit in zip(sizes, hits, strict=True))
    copies = sum(size * top_k * (1.0 - e / experts) for size, e in zip(sizes, held, strict=True))
    return min(unique / copies, 1.0) if copies > 0 else 1.0


def halo_all_to_all_s(
    cluster: ClusterSpec,
    group_devices: int,
    bytes_per_rank: float,
    stride: int = 1,
    remote_ratio: float = 1.0,
) -> float:
    """Analytic HALO over Q = n / g local domains of g devices. Phase II (remote rows packed
    per destination domain: Q - 1 messages to the rail peers, the network bytes of flat) is
    posted first, then Phase I (the intra-domain all-to-all of the g / n local share, g - 1
    messages), which runs beside it on the local links; Phase III (the rail peer forwards the
    received (1 - g / n) share to its g - 1 local peers) starts at max(end of II, time all
    I + II messages are posted). t = max(t_I, t_III). Equal to flat inside one domain; g
    counts the group's members in a domain (its devices // stride). `remote_ratio` scales
    Phase II's bytes (HALO-dedup: dedup_ratio); Phase III forwards every row, as without it."""
    n = group_devices
    g = max(local_domain_devices(cluster) // stride, 1)
    if n <= g:
        return flat_all_to_all_s(cluster, n, bytes_per_rank, stride)
    o = cluster.msg_overhead_us * 1e-6
    local_share = g / n
    inner = crossings(cluster, g, stride)
    remote = [c for c in crossings(cluster, n, stride) if c.level.devices > g * stride]
    m_1, m_2 = g - 1, n / g - 1
    lat_1 = latency_s(inner)
    t_2 = phase_s(
        cluster, m_2, bandwidth_s(cluster, bytes_per_rank * remote_ratio, remote), latency_s(remote)
    )
    t_1 = phase_s(
        cluster, m_1, bandwidth_s(cluster, bytes_per_rank * local_share, inner), lat_1, m_2
    )
    start_3 = max(t_2, (m_1 + m_2) * o)
    bw_3 = bandwidth_s(cluster, bytes_per_rank * (1.0 - local_share), inner)
    t_3 = start_3 + phase_s(cluster, m_1, bw_3, lat_1)
    return max(t_1, t_3)


def all_to_all_time_s(
    cluster: ClusterSpec,
    group_devices: int,
    bytes_per_rank: float,
    algo: str,
    stride: int = 1,
    remote_ratio: float = 1.0,
) -> float:
    """Seconds for one all-to-all in which each of `group_devices` ranks sends
    `bytes_per_rank` bytes in total (including its own share), by the analytic model.

    algo: "flat" (direct sends), "halo" (hierarchical, see halo_all_to_all_s) or "halo-dedup"
    (HALO with Phase II's bytes x `remote_ratio`, dedup_ratio; 1 for the others).
    """
    if algo not in ALGOS:
        raise SpecError(f"all-to-all algo '{algo}' is unknown; use one of {', '.join(ALGOS)}")
    if group_devices <= 1 or bytes_per_rank <= 0:
        return 0.0
    if algo != "flat":
        ratio = remote_ratio if algo == "halo-dedup" else 1.0
        return halo_all_to_all_s(cluster, group_devices, bytes_per_rank, stride, ratio)
    return flat_all_to_all_s(cluster, group_devices, bytes_per_rank, stride)


def group_span(cluster: ClusterSpec, group_devices: int, stride: int = 1) -> LevelSpec | None:
    """The level a group of `group_devices` aligned devices `stride` apart spans."""
    if group_devices <= 1:
        return None
    return contiguous_span(cluster, (group_devices - 1) * stride + 1)


def a2a_time_s(
    cluster: ClusterSpec,
    group_devices: int,
    bytes_per_rank: float,
    algo: str,
    stride: int = 1,
    remote_ratio: float = 1.0,
) -> tuple[float, str, tuple[str, ...]]:
    """One all-to-all for the resource model: the measured `a2a_<level>` table of the level the
    group spans when present (flat only: the profiler measures the flat collective), else the
    analytic model plus the wait for its slowest member (straggler_s; a measured table
    already holds it). Returns (seconds, level name, measured tables used)."""
    span = group_span(cluster, group_devices, stride)
    if span is None or bytes_per_rank <= 0:
        return 0.0, "", ()
    name = f"a2a_{span.name}"
    measured = lookup(cluster, name, bytes_per_rank) if algo == "flat" else None
    if measured is not None:
        return bytes_per_rank / (measured * 1e9), span.name, (name,)
    t = all_to_all_time_s(cluster, group_devices, bytes_per_rank, algo, stride, remote_ratio)
    return t + straggler_s(cluster, group_devices, stride), span.name, ()


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
    t = lv.latency_us * 1e-6 + message_bytes / cluster.link_bytes_per_s(lv)
    return t, lv.name, ()


def ring_allreduce_s(
    cluster: ClusterSpec, group_size: int, stride: int, nbytes: float, passes: float = 2.0
) -> tuple[float, str]:
    """Ring collective over `group_size` devices `stride` apart: each device moves
    passes * (n - 1) / n * nbytes over the slowest level the group spans, in
    passes * (n - 1) latency-bound steps. passes = 2 for all-reduce (reduce-scatter +
    all-gather), 1 for reduce-scatter or all-gather alone; plus the wait for the slowest member
    (straggler_s). Returns (seconds, level name)."""
    n = group_size
    if n <= 1 or nbytes <= 0:
        return 0.0, ""
    lv = cluster.levels[span_level_index(cluster, [i * stride for i in range(n)])]
    steps = passes * (n - 1)
    t = steps / n * nbytes / cluster.link_bytes_per_s(lv) + steps * lv.latency_us * 1e-6
    return t + straggler_s(cluster, n, stride), lv.name
