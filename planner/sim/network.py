"""The network of an allocation as the all-to-all simulator sees it: link kinds and flow paths.

Built from a ClusterSpec and a node count. Devices are numbered node-major; a domain of
topology level v is a block of D_v consecutive devices (D_v capped at the allocation size).

Links (each direction is its own link, full duplex):
- scale-up levels (inside a node, or an NVLink domain spanning nodes): every device has an
  egress and an ingress link per level, capacity = the level's per-device bandwidth;
- NICs: `nics_per_node` per node, `nic_gbps` each way; device j of a node uses NIC
  j * nics_per_node // gpus_per_node (GPU-NIC affinity, Frontier: one NIC per MI250X);
- scale-out levels (switch, dragonfly group, system): every child domain (a block of
  D_{v-1} devices) has an up and a down link into level v, capacity
  D_{v-1} x bw_v x taper_v (the taper thins dragonfly global links).
A flow between two devices crosses the innermost level whose domain holds both: inside the
scale-up domain it uses the egress/ingress links of that level; otherwise it leaves through
the source's NIC, climbs the up links of every scale-out level up to that one, descends
the matching down links and enters through the destination's NIC.

Shape letters: V = topology levels, L = link kinds, C = flow classes.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.specs import ClusterSpec, SpecError

_SCALE_UP_KINDS = ("nvlink", "nvl", "nvswitch", "infinity-fabric", "xgmi")


@dataclass(frozen=True)
class SimLevel:
    """One topology level of the allocation (domain size capped at the allocation)."""

    name: str
    reach: int  # D_v: devices per domain of this level inside the allocation
    bw_bytes_s: float  # per-device bandwidth crossing this level (bytes/s)
    taper: float
    latency_s: float
    scale_up: bool  # True: device egress/ingress links; False: NIC + up/down links


@dataclass(frozen=True)
class LinkKind:
    """All links of one kind in the allocation; they carry identical loads by symmetry."""

    name: str  # "egress:<level>", "ingress:<level>", "nic_out", "nic_in", "up:<level>", ...
    level: str  # the topology level whose bandwidth it models ("nic" for NICs)
    capacity_bytes_s: float
    count: int  # instances in the allocation


@dataclass(frozen=True)
class SimNetwork:
    """An allocation of `nodes` nodes of a cluster, ready for the flow model."""

    cluster: str
    nodes: int
    ranks: int  # P: devices in the allocation, one rank each
    gpus_per_node: int
    nics_per_node: int
    nic_bytes_s: float
    domain_ranks: int  # g: ranks of one scale-up domain, HALO's "node"
    levels: tuple[SimLevel, ...]
    gpus_per_nic_max: int  # the most devices sharing one NIC under affinity
    host_bytes_s: float = 0.0  # > 0: every flow also crosses ONE shared "host" link (an
    # emulation whose nodes all run on the same CPUs: every byte sent costs the same cores)

    @property
    def domains(self) -> int:
        """Q: scale-up domains in the allocation."""
        return self.ranks // self.domain_ranks

    def link_kinds(self) -> tuple[LinkKind, ...]:
        """Every link kind the allocation has, in a fixed order (the L axis)."""
        kinds: list[LinkKind] = []
        prev = 1
        for lv in self.levels:
            if lv.reach <= prev:
                continue
            if lv.scale_up:
                for d in ("egress", "ingress"):
                    kinds.append(LinkKind(f"{d}:{lv.name}", lv.name, lv.bw_bytes_s, self.ranks))
            else:
                cap = prev * lv.bw_bytes_s * lv.taper
                for d in ("up", "down"):
                    kinds.append(LinkKind(f"{d}:{lv.name}", lv.name, cap, self.ranks // prev))
            prev = lv.reach
        if self.host_bytes_s > 0:
            kinds.append(LinkKind("host", "host", self.host_bytes_s, 1))
        if self.domains > 1:
            nics = self.nodes * self.nics_per_node
            kinds.append(LinkKind("nic_out", "nic", self.nic_bytes_s, nics))
            kinds.append(LinkKind("nic_in", "nic", self.nic_bytes_s, nics))
        return tuple(kinds)

    def crossing_levels(self) -> tuple[tuple[int, int], ...]:
        """(level index, peers per device whose traffic crosses exactly that level)."""
        out = []
        prev = 1
        for v, lv in enumerate(self.levels):
            if lv.reach > prev:
                out.append((v, lv.reach - prev))
                prev = lv.reach
        return tuple(out)

    def usage(self, v: int, flows_per_device: float) -> dict[str, float]:
        """Flows on ONE link of each kind when every device sends `flows_per_device` flows
        that cross level v (and receives as many)."""
        lv = self.levels[v]
        host = {"host": flows_per_device * self.ranks} if self.host_bytes_s > 0 else {}
        if lv.scale_up:
            return {f"egress:{lv.name}": flows_per_device, f"ingress:{lv.name}": flows_per_device,
                    **host}  # fmt: skip
        use = {
            **host,
            "nic_out": flows_per_device * self.gpus_per_nic_max,
            "nic_in": flows_per_device * self.gpus_per_nic_max,
        }
        prev = 1
        for lw in self.levels[: v + 1]:
            if lw.reach <= prev:
                continue
            if not lw.scale_up:
                use[f"up:{lw.name}"] = flows_per_device * prev
                use[f"down:{lw.name}"] = flows_per_device * prev
            prev = lw.reach
        return use


def is_scale_up(cluster: ClusterSpec, devices: int, kind: str) -> bool:
    """Whether a level is a scale-up fabric (no NIC): inside a node, or an NVLink-like kind."""
    return devices <= cluster.gpus_per_node or any(k in kind.lower() for k in _SCALE_UP_KINDS)


def build_network(cluster: ClusterSpec, nodes: int, host_bytes_s: float = 0.0) -> SimNetwork:
    """The simulator's view of `nodes` consecutive nodes of `cluster` (`host_bytes_s` > 0 adds
    one link that every flow crosses: all emulated nodes sharing one machine's CPUs).

    Raises SpecError when the allocation does not fit the cluster or the levels cannot
    connect it.
    """
    if nodes < 1 or nodes > cluster.num_nodes:
        raise SpecError(
            f"--nodes {nodes}: cluster {cluster.name} has {cluster.num_nodes} nodes; "
            f"choose 1..{cluster.num_nodes}"
        )
    ranks = nodes * cluster.gpus_per_node
    levels = []
    prev = 1
    for lv in cluster.levels:
        reach = max(min(lv.devices, ranks), prev)
        scale_up = is_scale_up(cluster, lv.devices, lv.kind)
        if scale_up and reach % prev:
            raise SpecError(
                f"cluster {cluster.name}: level {lv.name} holds {reach} of the allocation's "
                f"devices, not a multiple of the {prev} of the level below; change --nodes"
            )
        levels.append(
            SimLevel(lv.name, reach, lv.bw_gbps * 1e9, lv.taper, lv.latency_us * 1e-6, scale_up)
        )
        prev = reach
    if prev < ranks:
        raise SpecError(
            f"cluster {cluster.name}: its levels reach {prev} devices but {nodes} nodes hold "
            f"{ranks}; add an outer level to the cluster profile"
        )
    domain = max([lv.reach for lv in levels if lv.scale_up] + [1])
    if ranks % domain:
        raise SpecError(
            f"--nodes {nodes}: {ranks} devices do not fill whole scale-up domains of {domain}; "
            f"choose a multiple of {domain // cluster.gpus_per_node} nodes"
        )
    per_nic = [0] * max(cluster.nics_per_node, 1)
    for j in range(cluster.gpus_per_node):
        per_nic[j * cluster.nics_per_node // cluster.gpus_per_node] += 1
    return SimNetwork(
        cluster=cluster.name,
        nodes=nodes,
        ranks=ranks,
        gpus_per_node=cluster.gpus_per_node,
        nics_per_node=cluster.nics_per_node,
        nic_bytes_s=cluster.nic_gbps * 1e9,
        domain_ranks=domain,
        levels=tuple(levels),
        gpus_per_nic_max=max(per_nic),
        host_bytes_s=host_bytes_s,
    )


def nic_balance(net: SimNetwork) -> float:
    """Hottest NIC's bytes over the mean NIC's under uniform traffic and GPU-NIC affinity."""
    mean = net.gpus_per_node / net.nics_per_node
    return net.gpus_per_nic_max / mean
