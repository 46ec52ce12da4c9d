"""A job's real node allocation: the nodes it got, with each node's switch and group ids.

`--allocation FILE` is YAML or CSV. YAML: a list of nodes, or {nodes: [...]}, each node a
mapping `{hostname: str, switch: str|int, group: str|int}` (group optional: one group).
CSV: a header row with `hostname,switch[,group]`. Node order is the job's order (the order
Slurm lists the nodes); plan.json's `ranks[].node` indexes this list. A switch is identified
by (group, switch), so switch ids may repeat across groups. Fragmented allocations
(any node count, switches partly used) are the normal case.

Without a file, `default_allocation(cluster, num_nodes)` takes the first nodes of the
cluster, with switch/group ids from the two topology levels above the node level.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from planner.inputs.safe_read import read_input_bytes
from planner.inputs.shown import shown
from planner.inputs.yaml_text import load_yaml, yaml_fault
from planner.specs import ClusterSpec, SpecError


@dataclass(frozen=True)
class AllocNode:
    """One node: its hostname, the switch it hangs off and the (dragonfly/spine) group."""

    hostname: str
    switch: str
    group: str = "0"


@dataclass(frozen=True)
class Allocation:
    nodes: tuple[AllocNode, ...]
    source: str = ""

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def num_switches(self) -> int:
        return len({(n.group, n.switch) for n in self.nodes})

    @property
    def num_groups(self) -> int:
        return len({n.group for n in self.nodes})


def load_allocation(path: str | Path) -> Allocation:
    """Read and validate an allocation file (YAML or CSV; see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise SpecError(
            f"{p}: no such allocation file; pass a YAML/CSV list of nodes with hostname, "
            "switch and group"
        )
    try:
        text = read_input_bytes(p, "allocation").decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{p}: not a text file; pass a YAML or CSV allocation") from None
    if p.suffix.lower() == ".csv":
        rows: Any = _read_csv(text, p)
    else:
        try:
            rows = load_yaml(text)
        except yaml.YAMLError as exc:
            raise SpecError(f"{p}: not valid YAML{yaml_fault(exc)}; fix the syntax") from None
    return parse_allocation(rows, str(p))


def parse_allocation(rows: Any, source: str = "allocation") -> Allocation:
    """Validate parsed rows (list of mappings, or {nodes: [...]}) into an Allocation."""
    if isinstance(rows, dict) and "nodes" in rows:
        rows = rows["nodes"]
    if not isinstance(rows, list) or not rows:
        raise SpecError(f"{source}: expected a non-empty list of nodes (hostname, switch, group)")
    nodes, seen = [], set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise SpecError(f"{source}: node {i} must be a mapping with hostname, switch, group")
        host = _field(row, "hostname", i, source, required=True)
        if host in seen:
            raise SpecError(
                f"{source}: node {i}: hostname '{host}' is listed twice; list each once"
            )
        seen.add(host)
        switch = _field(row, "switch", i, source, required=True)
        group = _field(row, "group", i, source, required=False) or "0"
        nodes.append(AllocNode(host, switch, group))
    return Allocation(tuple(nodes), source)


def _field(row: dict, key: str, i: int, source: str, required: bool) -> str:
    value = row.get(key)
    if value is None or value == "":
        if required:
            raise SpecError(f"{source}: node {i} is missing '{key}'")
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise SpecError(
            f"{source}: node {i}: '{key}' must be a string or integer, got {shown(value)}"
        )
    return str(value).strip()


def _read_csv(text: str, path: Path) -> list[dict[str, str]]:
    """The rows of a CSV allocation; a field past the csv module's size limit or a stray
    quote (csv.Error) is one SpecError line naming the file and the line."""
    reader = csv.DictReader(io.StringIO(text))
    try:
        fields = [f.strip() for f in reader.fieldnames or []]
        if "hostname" not in fields or "switch" not in fields:
            raise SpecError(
                f"{path}: CSV header must include hostname,switch (and optionally group)"
            )
        return [{k.strip(): (v or "").strip() for k, v in row.items() if k} for row in reader]
    except csv.Error as exc:
        raise SpecError(
            f"{path}: line {reader.reader.line_num}: not CSV ({exc}); write one node a line as "
            "hostname,switch,group"
        ) from None


def default_allocation(cluster: ClusterSpec, num_nodes: int) -> Allocation:
    """The first `num_nodes` nodes of `cluster`; switch/group ids from its topology levels."""
    if num_nodes > cluster.num_nodes:
        raise SpecError(
            f"cluster {cluster.name}: {num_nodes} nodes needed but it has {cluster.num_nodes}"
        )
    g = cluster.gpus_per_node
    above = [lv for lv in cluster.levels if lv.devices > g]
    switch_dev = above[0].devices if above else g * max(num_nodes, 1)
    group_dev = above[1].devices if len(above) > 1 else switch_dev * max(num_nodes, 1)
    nodes = tuple(
        AllocNode(f"node{n:05d}", str(n * g // switch_dev), str(n * g // group_dev))
        for n in range(num_nodes)
    )
    return Allocation(nodes, f"{cluster.name}:first-{num_nodes}-nodes")
