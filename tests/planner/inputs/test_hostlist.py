"""Slurm hostlist expressions expand as `scontrol show hostnames` does (slurm_hostlist_create(3),
Slurm::Hostlist(3pm) of slurm 23.11; topology.conf(5)'s examples); bad lists are one SpecError."""

from __future__ import annotations

import pytest

from planner.inputs.hostlist import expand_hostlist, load_nodelist
from planner.specs import SpecError


@pytest.mark.parametrize(
    ("expression", "hosts"),
    [
        # the manual pages' own examples
        ("tux[0-3,12,18-20]", ["tux0", "tux1", "tux2", "tux3", "tux12", "tux18", "tux19", "tux20"]),
        ("node1,node[2-5,12]", ["node1", "node2", "node3", "node4", "node5", "node12"]),
        ("linux[1-3,6]", ["linux1", "linux2", "linux3", "linux6"]),
        # zero padding keeps the first number's width; no padding grows naturally
        ("frontier[00012-00014,00040-00041]",
         ["frontier00012", "frontier00013", "frontier00014", "frontier00040", "frontier00041"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[007]", ["n007"]),
        # comma-separated groups, whitespace, suffixes, several bracket groups, order kept
        ("b[3-4],a1 c[1-2]", ["b3", "b4", "a1", "c1", "c2"]),
        ("gpu-a[01-02]-ib", ["gpu-a01-ib", "gpu-a02-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("h-a,h-b,,h.c", ["h-a", "h-b", "h.c"]),
    ],
)  # fmt: skip
def test_expansion_matches_slurm(expression, hosts):
    assert list(expand_hostlist(expression)) == hosts


def test_a_large_range_expands_in_order():
    hosts = expand_hostlist("frontier[00001-09408]")
    assert len(hosts) == 9408 and hosts[0] == "frontier00001" and hosts[-1] == "frontier09408"


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("n[1-4", "'[' without ']'"),
        ("n1-4]", "']' without '['"),
        ("n[1-[2]]", "nested '['"),
        ("n[4-1]", "runs backwards"),
        ("n[a-c]", "not a number or range"),
        ("n[1-2-3]", "not a number or range"),
        ("n[]", "not a number or range"),
        ("n[0-99999999]", "more than"),
        ("n1;touch x", "not a hostname"),
        ("$(reboot)", "not a hostname"),
        ("", "no hosts"),
        ("n[1-2],n2", "listed twice"),
    ],
)
def test_bad_lists_are_one_clear_error(expression, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_nodelist(expression)


def test_a_file_with_one_host_per_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the job's nodes\nnode03\n\nnode01  # a comment\nnode[07-08]\n")
    assert load_nodelist(str(path)) == ("node03", "node01", "node07", "node08")
    path.write_text("node03\nnode;03\n")
    with pytest.raises(SpecError, match="line 2"):
        load_nodelist(str(path))
