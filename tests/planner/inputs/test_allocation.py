"""Allocation files: YAML / CSV parsing, the default allocation, and one-line errors."""

from __future__ import annotations

import pytest

from planner.inputs.allocation import default_allocation, load_allocation
from planner.inputs.clusters import load_cluster
from planner.inputs.paths import PROFILES_DIR
from planner.specs import SpecError


def test_example_yaml_is_fragmented():
    alloc = load_allocation(PROFILES_DIR / "allocations" / "frontier-fragmented-13.yaml")
    assert len(alloc) == 13 and alloc.num_switches == 3 and alloc.num_groups == 1
    assert alloc.nodes[0].hostname == "frontier00012" and alloc.nodes[0].switch == "3"


def test_example_csv_two_groups():
    alloc = load_allocation(PROFILES_DIR / "allocations" / "frontier-two-groups-20.csv")
    assert len(alloc) == 20 and alloc.num_groups == 2 and alloc.num_switches == 6


def test_plain_list_and_optional_group(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("- {hostname: x1, switch: 0}\n- {hostname: x2, switch: s1}\n")
    alloc = load_allocation(p)
    assert [n.group for n in alloc.nodes] == ["0", "0"]
    assert [n.switch for n in alloc.nodes] == ["0", "s1"]


def test_default_allocation_follows_cluster_levels():
    """Frontier: 4 nodes per Rosetta switch, 128 nodes per dragonfly group."""
    alloc = default_allocation(load_cluster("frontier"), 130)
    assert [n.switch for n in alloc.nodes[:9]] == ["0"] * 4 + ["1"] * 4 + ["2"]
    assert alloc.nodes[127].group == "0" and alloc.nodes[128].group == "1"


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("missing.yaml", None, "no such allocation file"),
        ("bad.yaml", "- {hostname: a, switch: [\n", "not valid YAML at line"),
        ("empty.yaml", "[]\n", "non-empty list of nodes"),
        ("nohost.yaml", "- {switch: 1}\n", "node 0 is missing 'hostname'"),
        ("noswitch.yaml", "- {hostname: a}\n", "node 0 is missing 'switch'"),
        ("dup.yaml", "- {hostname: a, switch: 1}\n- {hostname: a, switch: 2}\n", "listed twice"),
        ("type.yaml", "- {hostname: a, switch: [1, 2]}\n", "must be a string or integer"),
        ("scalar.yaml", "- a\n", "must be a mapping"),
        ("bad.csv", "host,switch\na,1\n", "CSV header must include hostname,switch"),
        ("binary.yaml", "\udcff\udcfe\x00", "not a text file"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, name, text, match):
    p = tmp_path / name
    if text is not None:
        p.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(SpecError, match=match) as err:
        load_allocation(p)
    assert name in str(err.value) and "\n" not in str(err.value)
