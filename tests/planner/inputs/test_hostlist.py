"""Slurm hostlist expressions expand as `scontrol show hostnames` does (slurm_hostlist_create(3),
Slurm::Hostlist(3pm), topology.conf(5)'s examples; the expected lists are scontrol's output,
slurm-client 22.05.8, and where scontrol is installed the test runs it on a fake slurm.conf);
bad lists are one SpecError."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.inputs.hostlist import HOSTNAME, expand_hostlist, load_nodelist
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
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("n[1-2]-[3-4]", ["n1-3", "n1-4", "n2-3", "n2-4"]),
        ("h-a,h-b,,h.c", ["h-a", "h-b", "h.c"]),
        ("n[01-3]", ["n01", "n02", "n03"]),
        ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
        ("n[5,3,1]", ["n5", "n3", "n1"]),
        ("n[1-65536]", [f"n{i}" for i in range(1, 65537)]),
    ],
)  # fmt: skip
def test_expansion_matches_slurm(expression, hosts, tmp_path):
    assert list(expand_hostlist(expression)) == hosts
    if shutil.which("scontrol"):  # the oracle itself, without a controller
        assert _scontrol(expression, tmp_path) == hosts


def _scontrol(expression: str, folder) -> list[str]:
    conf = folder / "slurm.conf"
    conf.write_text("ClusterName=piper\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    out = subprocess.run(["scontrol", "show", "hostnames", expression], env=env,
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    invalid = out.returncode != 0 or "Invalid hostlist" in out.stdout + out.stderr
    return ["<invalid>"] if invalid else out.stdout.split()


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
        ("n[0-65536]", "more than 65536"),
        ("gpu-a[01-02]-ib", "after ']'"),
        ("n[1-2]x", "after ']'"),
        ("n1;touch x", "not a hostname"),
        ("$(reboot)", "not a hostname"),
        ("", "no hosts"),
        ("n[1-2],n2", "listed twice"),
    ],
)
def test_bad_lists_are_one_clear_error(expression, message, tmp_path):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_nodelist(expression)
    # Slurm refuses these too (it prints garbage for an unclosed bracket, and takes any text)
    slurm_refuses = ("nested", "backwards", "not a number", "more than", "after")
    if shutil.which("scontrol") and any(w in message for w in slurm_refuses):
        assert _scontrol(expression, tmp_path) == ["<invalid>"]


def test_a_file_with_one_host_per_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the job's nodes\nnode03\n\nnode01  # a comment\nnode[07-08]\n")
    assert load_nodelist(str(path)) == ("node03", "node01", "node07", "node08")
    path.write_text("node03\nnode;03\n")
    with pytest.raises(SpecError, match="line 2"):
        load_nodelist(str(path))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(text=st.text(alphabet="ab01-9[],; $\n\t.x_", max_size=40))
def test_any_text_is_hosts_or_one_spec_error(text):
    """Random node lists: valid hostnames in a tuple, or a SpecError; nothing else."""
    try:
        hosts = load_nodelist(text)
    except SpecError as exc:
        assert "\n" not in str(exc)  # one line, whatever the input held
        return
    assert hosts and all(HOSTNAME.match(h) for h in hosts)
    assert len(set(hosts)) == len(hosts)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    prefix=st.from_regex(r"[a-z]{1,6}", fullmatch=True),
    ranges=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40), st.integers(1, 4)),
                    min_size=1, max_size=4),
)  # fmt: skip
def test_generated_ranges_expand_like_slurm(prefix, ranges):
    """prefix[lo-hi,...] with zero-padded lo: each range's hosts in order, padded to lo's
    width (the rule scontrol follows, checked in test_expansion_matches_slurm)."""
    text = ",".join(f"{lo:0{w}d}-{lo + n:0{w}d}" for lo, n, w in ranges)
    expected = [f"{prefix}{i:0{w}d}" for lo, n, w in ranges for i in range(lo, lo + n + 1)]
    assert list(expand_hostlist(f"{prefix}[{text}]")) == expected
