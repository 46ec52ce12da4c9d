"""Where a job's nodes sit in the network: Slurm's topology files, or a site's hostname rule.

`allocation_of(hosts, topology, cluster_name)` returns an Allocation (planner.inputs.allocation)
whose nodes carry a switch and a group id, in the job's order. Sources, from Slurm's manual
pages topology.conf(5) and topology.yaml(5) of Slurm 25.11:

- topology.conf, tree plugin: lines `SwitchName=NAME [Switches=LIST] [Nodes=LIST]
  [LinkSpeed=N]`; LIST is a hostlist expression; names are case-insensitive, '#' starts a
  comment. A node's switch is the leaf switch whose Nodes= lists it; its group is that leaf's
  parent (the switch whose Switches= lists the leaf), or one group when leaves have no parent.
- topology.conf, block plugin: `BlockName=NAME Nodes=LIST` and `BlockSizes=B0[,B1,...]`. A
  node's switch is its block; B1 / B0 consecutive blocks (in file order) form one group, as the
  plugin aggregates base blocks into larger ones; with one block size, one group.
- topology.yaml: a list of topologies `{topology: NAME, cluster_default: bool, tree:
  {switches: [{switch, children, nodes}]} | block: {block_sizes: [...], blocks: [{block,
  nodes}]} | flat: true}`; the first with cluster_default true (else the first) is read, with
  the same meaning as above.

A node listed under two switches (or in two blocks) has no single position and is refused,
naming both. The YAML is read with every key once (planner.inputs.yaml_text.load_yaml).

The cluster profile prices the tiers: a switch is the first topology level wider than a node,
a group the next one (planner.inputs.allocation.default_allocation).

Frontier without a topology file: OLCF's nodes are `frontierNNNNN`; each HPE Cray EX cabinet
is one dragonfly group of 128 nodes on 32 Slingshot switches, 4 nodes (16 NIC ports) per switch
(OLCF Frontier user guide; G. Lockwood's Frontier notes, glennklockwood.com/garden/systems/
frontier). ASSUMPTION: node numbers run consecutively through the cabinets from 1, so node N
is in group (N - 1) // 128 and on switch ((N - 1) % 128) // 4. A site's topology file replaces
the rule.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from planner.inputs.allocation import Allocation, AllocNode
from planner.inputs.hostlist import MAX_HOSTS, expand_hostlist
from planner.inputs.safe_read import read_input_bytes
from planner.inputs.shown import shown
from planner.inputs.yaml_text import load_yaml, yaml_fault
from planner.specs import SpecError

log = logging.getLogger(__name__)

FRONTIER_HOST = re.compile(r"frontier(\d{5})\Z")
FRONTIER_NODES_PER_GROUP = 128
FRONTIER_NODES_PER_SWITCH = 4
Position = tuple[str, str]  # (group, switch)


def allocation_of(hosts: Sequence[str], topology: str | None, cluster_name: str) -> Allocation:
    """The hosts in order with their (switch, group), from `topology` or the hostname rule."""
    if topology is not None:
        positions, source = read_topology(topology), topology
    elif "frontier" in cluster_name.lower() and all(FRONTIER_HOST.match(h) for h in hosts):
        positions, source = {h: frontier_position(h) for h in hosts}, "frontier hostname rule"
    else:
        bad = next((h for h in hosts if not FRONTIER_HOST.match(h)), hosts[0])
        why = (
            "not a frontierNNNNN name"
            if "frontier" in cluster_name.lower()
            else f"cluster '{cluster_name}' has no hostname rule"
        )
        raise SpecError(
            f"--topology: no network position for host {shown(bad)} ({why}); pass Slurm's "
            "topology.conf or topology.yaml"
        )
    nodes = []
    for host in hosts:
        if host not in positions:
            raise SpecError(
                f"{source}: node {shown(host)} of the allocation is in no switch or block; "
                "pass the topology file of this cluster"
            )
        group, switch = positions[host]
        nodes.append(AllocNode(host, switch, group))
    return Allocation(tuple(nodes), source)


def frontier_position(host: str) -> Position:
    """(group, switch) of a Frontier node by the hostname rule in the module docstring."""
    index = int(FRONTIER_HOST.match(host).group(1)) - 1  # type: ignore[union-attr]
    group, slot = divmod(index, FRONTIER_NODES_PER_GROUP)
    return str(group), f"{group}.{slot // FRONTIER_NODES_PER_SWITCH}"


def read_topology(path: str) -> dict[str, Position]:
    """host -> (group, switch) from a topology.conf or topology.yaml file."""
    p = Path(path)
    if not p.exists():
        raise SpecError(f"{path}: no such topology file; pass Slurm's topology.conf")
    try:
        text = read_input_bytes(p, "topology").decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a text file; pass Slurm's topology.conf") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            data = load_yaml(text)
        except yaml.YAMLError as exc:
            raise SpecError(f"{path}: not valid YAML{yaml_fault(exc)}; fix the syntax") from None
        switches, blocks, sizes = _yaml_topology(data, path)
    else:
        switches, blocks, sizes = _conf_topology(text, path)
    if blocks:
        return _block_positions(blocks, sizes, path)
    if switches:
        return _tree_positions(switches, path)
    raise SpecError(f"{path}: no SwitchName= or BlockName= lines; pass a tree or block topology")


# A switch or block: (name, child switches, nodes), as written.
_Entry = tuple[str, tuple[str, ...], tuple[str, ...]]


def _cut(text: Any) -> str:
    """`text` quoted for a message, cut to 60 characters."""
    return shown(text)


def _listed(entry: _Entry) -> int:
    """The names one entry lists (child switches and nodes): a file's total is held to
    MAX_HOSTS, as one node list is."""
    return len(entry[1]) + len(entry[2])


def _conf_topology(text: str, path: str) -> tuple[list[_Entry], list[_Entry], list[int]]:
    switches: list[_Entry] = []
    blocks: list[_Entry] = []
    sizes: list[int] = []
    listed = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}: line {number}"
        fields: dict[str, str] = {}
        for word in line.split():
            key, sep, value = word.partition("=")
            if not sep or not value:
                raise SpecError(f"{where}: {_cut(word)} is not KEY=VALUE; fix the line")
            fields[key.lower()] = value
        if "switchname" in fields:
            switches.append(_entry(fields["switchname"], fields.get("switches"),
                                   fields.get("nodes"), where, listed))  # fmt: skip
            listed += _listed(switches[-1])
        elif "blockname" in fields:
            blocks.append(_entry(fields["blockname"], None, fields.get("nodes"), where, listed))
            listed += _listed(blocks[-1])
        elif "blocksizes" in fields:
            sizes = _sizes(fields["blocksizes"].split(","), where)
        else:
            raise SpecError(f"{where}: expected SwitchName=, BlockName= or BlockSizes=")
    return switches, blocks, sizes


def _yaml_topology(data: Any, path: str) -> tuple[list[_Entry], list[_Entry], list[int]]:
    if not isinstance(data, list) or not all(isinstance(t, dict) for t in data) or not data:
        raise SpecError(f"{path}: expected a list of topologies (topology: NAME, tree|block)")
    topo = next((t for t in data if t.get("cluster_default") is True), data[0])
    name = f"{path}: topology {_cut(topo.get('topology', '?'))}"
    if isinstance(topo.get("tree"), dict):
        rows = _yaml_rows(topo["tree"].get("switches"), "switches", name)
        entries: list[_Entry] = []
        listed = 0
        for r in rows:
            entries.append(_entry(r.get("switch"), r.get("children"), r.get("nodes"), name,
                                  listed))  # fmt: skip
            listed += _listed(entries[-1])
        return entries, [], []
    if isinstance(topo.get("block"), dict):
        rows = _yaml_rows(topo["block"].get("blocks"), "blocks", name)
        blocks: list[_Entry] = []
        listed = 0
        for r in rows:
            blocks.append(_entry(r.get("block"), None, r.get("nodes"), name, listed))
            listed += _listed(blocks[-1])
        sizes = topo["block"].get("block_sizes") or []
        if isinstance(sizes, str):
            sizes = sizes.split(",")
        elif not isinstance(sizes, list):
            sizes = [sizes]
        return [], blocks, _sizes(sizes, name)
    raise SpecError(f"{name}: has no tree or block section (a flat topology places nothing)")


def _yaml_rows(rows: Any, key: str, where: str) -> list[dict]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise SpecError(f"{where}: '{key}' must be a list of mappings")
    return rows


def _entry(name: Any, children: Any, nodes: Any, where: str, listed: int) -> _Entry:
    """One switch or block; `listed`: the names the entries before it list."""
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}: a switch or block without a name; name it")
    for value in (children, nodes):
        if value is not None and not isinstance(value, str):
            raise SpecError(
                f"{where}: {_cut(name)}: node and switch lists must be hostlist strings"
            )
    kids = expand_hostlist(children, where, listed) if children else ()
    return name, kids, expand_hostlist(nodes, where, listed + len(kids)) if nodes else ()


def _sizes(values: list[Any], where: str) -> list[int]:
    shown = str(values) if len(str(values)) <= 60 else str(values)[:57] + "..."
    try:
        sizes = [int(v) for v in values if isinstance(v, int | str) and len(str(v)) <= 18]
    except (TypeError, ValueError):
        sizes = []
    if len(sizes) != len(values) or any(isinstance(v, bool) for v in values):
        raise SpecError(f"{where}: BlockSizes must be whole numbers, got {shown}")
    if any(not 0 < s <= MAX_HOSTS for s in sizes) or sizes != sorted(sizes):
        raise SpecError(
            f"{where}: BlockSizes must be increasing numbers of nodes in [1, {MAX_HOSTS}], "
            f"got {shown}"
        )
    return sizes


def _place(out: dict[str, Position], node: str, position: Position, path: str, kind: str):
    """out[node] = position, the first listing winning: Slurm accepts a node under two leaf
    switches with a warning ("Multiple leaf switches contain nodes", topology/tree), and so
    does this reader, which warns once per node naming both."""
    before = out.setdefault(node, position)
    if before[1] != position[1]:
        log.warning(
            "%s: node %r is listed under %s %s and %s %s; placing it under the first, as "
            "Slurm does", path, node, kind, _cut(before[1]), kind, _cut(position[1]),
        )  # fmt: skip


def _tree_positions(switches: list[_Entry], path: str) -> dict[str, Position]:
    parent = {kid: name for name, kids, _ in switches for kid in kids}
    out: dict[str, Position] = {}
    for name, _, nodes in switches:
        for node in nodes:
            _place(out, node, (parent.get(name, "0"), name), path, "switch")
    return out


def _block_positions(blocks: list[_Entry], sizes: list[int], path: str) -> dict[str, Position]:
    per_group = sizes[1] // sizes[0] if len(sizes) > 1 else 0
    out: dict[str, Position] = {}
    for i, (name, _, nodes) in enumerate(blocks):
        group = str(i // per_group) if per_group else "0"
        for node in nodes:
            _place(out, node, (group, name), path, "block")
    return out
