"""Network positions from Slurm's topology files (topology.conf(5), topology.yaml(5) of Slurm
25.11, in their documented syntax) and Frontier's hostname rule."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.inputs.slurm_topology import allocation_of, frontier_position, read_topology
from planner.specs import SpecError

# Tree plugin: two leaf switches per spine, two spines under a core (the manual's style).
TREE_CONF = """\
# leaf switches with their nodes
SwitchName=s0 Nodes=tux[0-3] LinkSpeed=100
SwitchName=s1 Nodes=tux[4-7]
switchname=s2 nodes=tux[8-11]   # names are case-insensitive
SwitchName=s3 Nodes=tux[12,14-16]
SwitchName=spine0 Switches=s[0-1]
SwitchName=spine1 Switches=s[2-3]
SwitchName=core Switches=spine[0-1]
"""
BLOCK_CONF = """\
BlockName=b1 Nodes=dgx[01-04]
BlockName=b2 Nodes=dgx[05-08]
BlockName=b3 Nodes=dgx[09-12]
BlockName=b4 Nodes=dgx[13-16]
BlockSizes=4,8
"""
TREE_YAML = """\
- topology: fabric
  cluster_default: true
  tree:
    switches:
      - switch: leaf1
        nodes: gpu[001-002]
      - switch: leaf2
        nodes: gpu[003-004]
      - switch: spine
        children: leaf[1-2]
- topology: racks
  block:
    block_sizes: [2]
    blocks:
      - block: rack1
        nodes: gpu[001-004]
"""
BLOCK_YAML = """\
- topology: flat
  flat: true
- topology: nvl
  cluster_default: true
  block:
    block_sizes: [2, 4]
    blocks:
      - block: r0
        nodes: g[1-2]
      - block: r1
        nodes: g[3-4]
      - block: r2
        nodes: g[5-6]
"""


def _positions(tmp_path, name, text, hosts, cluster="h100"):
    path = tmp_path / name
    path.write_text(text)
    alloc = allocation_of(hosts, str(path), cluster)
    return [(n.hostname, n.group, n.switch) for n in alloc.nodes]


def test_tree_conf_leaf_switch_and_its_parent(tmp_path):
    hosts = ["tux9", "tux0", "tux5", "tux16"]
    assert _positions(tmp_path, "topology.conf", TREE_CONF, hosts) == [
        ("tux9", "spine1", "s2"),
        ("tux0", "spine0", "s0"),
        ("tux5", "spine0", "s1"),
        ("tux16", "spine1", "s3"),
    ]


def test_block_conf_groups_follow_block_sizes(tmp_path):
    hosts = ["dgx16", "dgx01", "dgx06", "dgx10"]
    assert _positions(tmp_path, "topology.conf", BLOCK_CONF, hosts) == [
        ("dgx16", "1", "b4"),
        ("dgx01", "0", "b1"),
        ("dgx06", "0", "b2"),
        ("dgx10", "1", "b3"),
    ]


def test_topology_yaml_reads_the_cluster_default(tmp_path):
    got = _positions(tmp_path, "topology.yaml", TREE_YAML, ["gpu004", "gpu001"])
    assert got == [("gpu004", "spine", "leaf2"), ("gpu001", "spine", "leaf1")]
    got = _positions(tmp_path, "topology.yaml", BLOCK_YAML, ["g1", "g4", "g6"])
    assert got == [("g1", "0", "r0"), ("g4", "0", "r1"), ("g6", "1", "r2")]


def test_frontier_hostname_rule():
    # 128 nodes per dragonfly group (cabinet), 4 per Slingshot switch, numbered from 1
    assert frontier_position("frontier00001") == ("0", "0.0")
    assert frontier_position("frontier00004") == ("0", "0.0")
    assert frontier_position("frontier00005") == ("0", "0.1")
    assert frontier_position("frontier00128") == ("0", "0.31")
    assert frontier_position("frontier00129") == ("1", "1.0")
    assert frontier_position("frontier09408") == ("73", "73.15")
    alloc = allocation_of(["frontier00012", "frontier00300"], None, "frontier")
    assert (alloc.num_switches, alloc.num_groups) == (2, 2)


@pytest.mark.parametrize(
    ("name", "text", "hosts", "cluster", "message"),
    [
        ("topology.conf", TREE_CONF, ["tux0", "tux13"], "h100", "node 'tux13' .* in no switch"),
        ("topology.conf", "SwitchName=s0 Nodes=n[1-\n", ["n1"], "h100", "without ']'"),
        ("topology.conf", "SwitchName s0\n", ["n1"], "h100", "not KEY=VALUE"),
        ("topology.conf", "NodeName=n1\n", ["n1"], "h100", "expected SwitchName"),
        ("topology.conf", "# empty\n", ["n1"], "h100", "no SwitchName= or BlockName="),
        ("topology.conf", "BlockName=b Nodes=n1\nBlockSizes=8,4\n", ["n1"], "h100", "increasing"),
        ("topology.yaml", "- topology: f\n  flat: true\n", ["n1"], "h100", "no tree or block"),
        ("topology.yaml", "key: [\n", ["n1"], "h100", "not valid YAML"),
        (None, None, ["gpu1"], "h100", "no network position for host 'gpu1'"),
        (None, None, ["frontier00001", "login1"], "frontier", "host 'login1'"),
    ],
)
def test_bad_topologies_are_one_clear_error(tmp_path, name, text, hosts, cluster, message):
    path = None
    if name:
        (tmp_path / name).write_text(text)
        path = str(tmp_path / name)
    with pytest.raises(SpecError, match=message):
        allocation_of(hosts, path, cluster)


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    text=st.text(alphabet="SwitchNameBlockSizes=,[]-0123 \n#:xyz", max_size=80),
    suffix=st.sampled_from([".conf", ".yaml"]),
)
def test_any_topology_text_reads_or_is_one_spec_error(text, suffix, tmp_path):
    """Corrupted topology files: positions (host -> (group, switch) strings) or a SpecError."""
    path = tmp_path / f"topology{suffix}"
    path.write_text(text)
    try:
        positions = read_topology(str(path))
    except SpecError as exc:
        assert "\n" not in str(exc)
        return
    assert all(isinstance(g, str) and isinstance(s, str) for g, s in positions.values())
