"""Emulated multi-node network from Linux network namespaces (needs root).

Layout for N nodes (RUN = the creating process id, so concurrent runs never share names):
  namespace `piper-h{RUN}sw`   one bridge `br0` (the switch)
  namespace `piper-h{RUN}n{i}` one emulated node: `lo` and `eth0` = 10.213.0.{i+1}/24
  veth pair eth0 <-> `hb{i}`   the node's link; `hb{i}` is a port of br0
Each link is rate limited in both directions with `tc ... tbf` (egress of eth0 and of hb{i}),
so a node sends and receives at most `rate_mbit` each way. Ranks on one node talk over the
node's own address, which the kernel routes through loopback (unlimited), as inside a node.

Only those namespace names and addresses in 10.213.0.0/24 inside them are created (interface
names live inside the namespaces). `teardown(net)` removes one run's namespaces by name;
`teardown_all()` removes every run's (`--cleanup`), leaving other names alone.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PREFIX = "piper-h"
OURS = re.compile(r"^piper-h\d+(sw|n\d+)$")
SUBNET = "10.213.0"
MAX_NODES = 64


@dataclass(frozen=True)
class EmulatedNet:
    """A created network: node namespaces and their addresses."""

    num_nodes: int
    rate_mbit: int
    run: int = field(default_factory=os.getpid)

    @property
    def switch(self) -> str:
        """Namespace name of the switch."""
        return f"{PREFIX}{self.run}sw"

    def namespace(self, node: int) -> str:
        """Namespace name of a node."""
        return f"{PREFIX}{self.run}n{node}"

    def names(self) -> list[str]:
        """Every namespace of this network."""
        return [self.switch] + [self.namespace(n) for n in range(self.num_nodes)]

    def address(self, node: int) -> str:
        """IPv4 address of a node's eth0."""
        return f"{SUBNET}.{node + 1}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def _in_ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _ip("netns", "exec", ns, *cmd, check=check)


def _tbf(ns: str, dev: str, rate_mbit: int) -> None:
    # burst must hold a full GSO segment (64 KiB) or tbf drops it; latency bounds the queue.
    burst_bytes = max(128 * 1024, rate_mbit * 1_000_000 // 8 // 250)
    _in_ns(
        ns,
        *("tc", "qdisc", "replace", "dev", dev, "root", "tbf"),
        *("rate", f"{rate_mbit}mbit", "burst", str(burst_bytes), "latency", "100ms"),
    )


def setup(num_nodes: int, rate_mbit: int, mtu: int = 9000) -> EmulatedNet:
    """Creates the switch and `num_nodes` node namespaces with rate-limited links.

    Args:
      num_nodes: emulated nodes (1..64).
      rate_mbit: per-direction link rate of every node (Mbit/s); 0 = no limit (the links
        then cost only the host's CPU: used to profile the host).
      mtu: link MTU in bytes (9000: jumbo frames, as HPC fabrics use; fewer packets also
        keep the emulation's CPU cost per byte down).

    Returns:
      The EmulatedNet (call `teardown()` when done, also on failure).
    """
    if not 1 <= num_nodes <= MAX_NODES:
        raise ValueError(f"num_nodes must be in 1..{MAX_NODES}, got {num_nodes}")
    net = EmulatedNet(num_nodes, rate_mbit)
    teardown(net)
    switch = net.switch
    _ip("netns", "add", switch)
    _in_ns(switch, "ip", "link", "set", "lo", "up")
    _in_ns(switch, "ip", "link", "add", "br0", "type", "bridge")
    _in_ns(switch, "ip", "link", "set", "br0", "up")
    for node in range(num_nodes):
        ns, port = net.namespace(node), f"hb{node}"
        _ip("netns", "add", ns)
        _in_ns(ns, "ip", "link", "set", "lo", "up")
        # A fabric has no TCP slow start: keep each connection's window across idle gaps
        # between exchanges (this sysctl is per namespace; the host's is untouched).
        _in_ns(ns, "sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0")
        # Reno, not the host's default (BBR here): BBR paces every flow with timers, which
        # costs the CPUs all emulated nodes share; a fabric does no such pacing in software.
        _in_ns(ns, "sysctl", "-q", "-w", "net.ipv4.tcp_congestion_control=reno")
        # Create the pair inside the node namespace, then move the switch end out.
        _in_ns(ns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", port)
        _in_ns(ns, "ip", "link", "set", "eth0", "mtu", str(mtu))
        _in_ns(ns, "ip", "link", "set", port, "mtu", str(mtu))
        _in_ns(ns, "ip", "link", "set", port, "netns", switch)
        _in_ns(ns, "ip", "addr", "add", f"{net.address(node)}/24", "dev", "eth0")
        _in_ns(ns, "ip", "link", "set", "eth0", "up")
        _in_ns(switch, "ip", "link", "set", port, "master", "br0")
        _in_ns(switch, "ip", "link", "set", port, "up")
        if rate_mbit > 0:
            _tbf(ns, "eth0", rate_mbit)
            _tbf(switch, port, rate_mbit)
    log.info("emulated network: %d nodes at %d Mbit/s", num_nodes, rate_mbit)
    return net


def teardown(net: EmulatedNet) -> list[str]:
    """Deletes this network's namespaces (by name); returns the names removed."""
    return _delete([ns for ns in _listed() if ns in net.names()])


def teardown_all() -> list[str]:
    """Deletes the namespaces of every run of this module (and no other names)."""
    return _delete([ns for ns in _listed() if OURS.match(ns)])


def _listed() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.strip()]


def _delete(names: list[str]) -> list[str]:
    for ns in sorted(names):
        _ip("netns", "del", ns, check=False)
    return sorted(names)


def ping(net: EmulatedNet, src: int, dst: int) -> bool:
    """Whether node `src` reaches node `dst` (one ping, 2 s limit)."""
    result = _in_ns(net.namespace(src), "ping", "-c", "1", "-W", "2", net.address(dst), check=False)
    return result.returncode == 0
