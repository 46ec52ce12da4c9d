"""Flow-level simulator of flat all-to-all vs HALO on large topologies: the public entry point.

`simulate_all_to_all(cluster, nodes, bytes_per_rank, algo, topk=...)` builds the network of
`nodes` consecutive nodes (planner.sim.network), the flows of the algorithm
(planner.sim.a2a), shares links max-min fairly (planner.sim.fluid) and returns a SimResult:
the time, the phases, bytes and busy time per link kind and per level, messages per rank
and NIC balance. Model and assumptions: planner/SIMULATOR.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from planner.sim.a2a import ALGOS, FlowClass, PhaseTiming, phase_timings
from planner.sim.network import SimNetwork, build_network, nic_balance
from planner.sim.routing import dedup_ratio
from planner.specs import ClusterSpec, SpecError

# per-message posting cost of a GPU collective library (order 1 us); the default of
# ClusterSpec.msg_overhead_us, which simulate_all_to_all uses when overhead_us is None
DEFAULT_OVERHEAD_US = ClusterSpec.msg_overhead_us


@dataclass(frozen=True)
class LinkLoad:
    """Load on one kind of link (all its instances carry the same bytes by symmetry)."""

    link: str  # "egress:node", "nic_out", "up:group", ...
    level: str
    links: int  # instances in the allocation
    capacity_gbps: float  # one link, GB/s
    bytes_per_link: float
    busy_s: float  # bytes_per_link / capacity: the time this link alone needs


@dataclass(frozen=True)
class LevelTraffic:
    """Traffic crossing one topology level (sender side, so each byte counts once)."""

    level: str
    bytes: float  # total over the allocation
    busy_s: float  # the busiest link kind of the level


@dataclass(frozen=True)
class SimResult:
    algo: str
    cluster: str
    nodes: int
    ranks: int
    domain_ranks: int  # ranks per scale-up domain (HALO's node)
    bytes_per_rank: float
    topk: int
    experts: int
    overhead_us: float
    time_s: float
    messages_per_rank: float
    dedup_ratio: float  # remote bytes kept by dedup (1.0 unless algo == "halo-dedup")
    nic_balance: float  # hottest NIC bytes / mean NIC bytes
    bottleneck: str  # link kind with the longest busy time
    phases: tuple[PhaseTiming, ...]
    links: tuple[LinkLoad, ...]
    levels: tuple[LevelTraffic, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def _link_loads(net: SimNetwork, classes: list[FlowClass]) -> tuple[LinkLoad, ...]:
    loads = []
    for kind in net.link_kinds():
        per_link = 0.0
        for fc in classes:
            per_link += net.usage(fc.level, fc.flows_per_device).get(kind.name, 0.0) * (
                fc.bytes_per_flow
            )
        loads.append(
            LinkLoad(
                kind.name,
                kind.level,
                kind.count,
                kind.capacity_bytes_s / 1e9,
                per_link,
                per_link / kind.capacity_bytes_s,
            )
        )
    return tuple(loads)


def _level_traffic(loads: tuple[LinkLoad, ...]) -> tuple[LevelTraffic, ...]:
    out: dict[str, LevelTraffic] = {}
    for ld in loads:
        sends = ld.link.startswith(("egress:", "up:", "nic_out"))
        prev = out.get(ld.level, LevelTraffic(ld.level, 0.0, 0.0))
        added = ld.bytes_per_link * ld.links if sends else 0.0
        out[ld.level] = LevelTraffic(ld.level, prev.bytes + added, max(prev.busy_s, ld.busy_s))
    return tuple(out.values())


def simulate_all_to_all(
    cluster: ClusterSpec,
    nodes: int,
    bytes_per_rank: float,
    algo: str = "flat",
    topk: int = 8,
    experts: int | None = None,
    overhead_us: float | None = None,
) -> SimResult:
    """Simulate one all-to-all over `nodes` consecutive nodes of `cluster`.

    Args:
        cluster: topology, NICs and bandwidths (planner.inputs.clusters.load_cluster).
        nodes: nodes in the allocation, one rank per device.
        bytes_per_rank: bytes each rank sends in total (token copies x hidden x dtype bytes),
            spread uniformly over all ranks.
        algo: "flat", "halo" or "halo-dedup".
        topk: experts per token; only HALO-dedup's routing model uses it.
        experts: routed experts spread evenly over the ranks (default: one per rank, more
            when top-k exceeds the ranks); only HALO-dedup's routing model uses it.
        overhead_us: per-message software cost at the sender (microseconds); None: the
            cluster's msg_overhead_us (the same parameter the analytic model uses).

    Returns:
        SimResult with time_s and the per-phase, per-link and per-level breakdown.
    """
    if algo not in ALGOS:
        raise SpecError(f"--algo {algo}: choose one of {', '.join(ALGOS)}")
    if bytes_per_rank <= 0:
        raise SpecError(f"--bytes-per-rank {bytes_per_rank}: must be positive")
    if overhead_us is None:
        overhead_us = cluster.msg_overhead_us
    if overhead_us < 0:
        raise SpecError(f"--overhead-us {overhead_us}: must be >= 0")
    if topk < 1:
        raise SpecError(f"--topk {topk}: a token goes to at least 1 expert; give >= 1")
    net = build_network(cluster, nodes)
    # default: one expert per rank, or the fewest experts per rank that top-k can route to
    n_experts = experts if experts is not None else net.ranks * -(-topk // net.ranks)
    used_ratio = dedup_ratio(n_experts, net.domains, topk) if algo == "halo-dedup" else 1.0
    classes, phases = phase_timings(net, algo, bytes_per_rank, overhead_us * 1e-6, used_ratio)
    loads = _link_loads(net, classes)
    bottleneck = max(loads, key=lambda ld: ld.busy_s).link if loads else ""
    return SimResult(
        algo=algo,
        cluster=cluster.name,
        nodes=nodes,
        ranks=net.ranks,
        domain_ranks=net.domain_ranks,
        bytes_per_rank=float(bytes_per_rank),
        topk=topk,
        experts=n_experts,
        overhead_us=overhead_us,
        time_s=max(ph.end_s for ph in phases),
        messages_per_rank=sum(ph.messages_per_rank for ph in phases),
        dedup_ratio=used_ratio,
        nic_balance=nic_balance(net) if net.domains > 1 else 1.0,
        bottleneck=bottleneck,
        phases=phases,
        links=loads,
        levels=_level_traffic(loads),
    )
