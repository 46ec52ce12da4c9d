"""`piper place`: the rank IP on the nodes Slurm allocated, priced against the plain Slurm order
and a compact allocation; bad inputs are one line; the sbatch script places at job start and
falls back to the plan's order with a warning."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from planner.inputs.clusters import load_cluster
from planner.inputs.hostlist import expand_hostlist
from planner.inputs.models import load_model
from planner.inputs.slurm_topology import allocation_of
from planner.ip.rank_ip import group_ranks, logical_rank
from planner.ip.solvers import SolverOptions
from planner.outputs.export.slurm import slurm_script
from planner.parallel import ParallelConfig
from planner.plan import load_plan
from planner.run import place
from planner.run.place import place_plan
from planner.run.place_layout import rank_group_arrays
from planner.search.make_plan import make_plan
from planner.specs import TrainingSpec
from tests.hardening_cli import run_piper
from tests.planner.outputs import export_plans

# Two dragonfly groups whose switches hold alternate host names: Slurm's sorted order puts
# every pair of consecutive hosts in different groups.
INTERLEAVED = """\
SwitchName=s0 Nodes=tux[1,3,5,7]
SwitchName=s1 Nodes=tux[2,4,6,8]
SwitchName=s2 Nodes=tux[9-16]
SwitchName=g0 Switches=s0
SwitchName=g1 Switches=s[1-2]
"""


@pytest.fixture(scope="module")
def frontier_plan(tmp_path_factory) -> Path:
    """weak-16e on 8 Frontier nodes: pp 4, each stage's EP group of 16 on 2 nodes."""
    result = make_plan(
        load_model("weak-16e"),
        load_cluster("frontier"),
        TrainingSpec(seq_len=1024, global_batch=64),
        64,
        {"tp": 1, "ep": 16, "pp": 4},  # pp fixed: the fitted frontier preset prefers pp 2
        SolverOptions("cpsat", 5.0, 1, 0),
    )
    assert result.plan is not None, result.message
    assert (result.plan.parallel.pp, result.plan.parallel.ep) == (4, 16)
    folder = tmp_path_factory.mktemp("place")
    (folder / "plan.json").write_text(result.plan.to_json())
    (folder / "topology.conf").write_text(INTERLEAVED)
    return folder


def test_placement_beats_the_slurm_order_and_compact_reproduces_the_plan(frontier_plan):
    plan = load_plan(frontier_plan / "plan.json")
    topology = str(frontier_plan / "topology.conf")
    alloc = allocation_of(expand_hostlist("tux[1-8]"), topology, "frontier")
    placement = place_plan(plan, alloc, SolverOptions("cpsat", 5.0, 1, 0))
    assert placement.compact.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-6)
    assert placement.compact.crossings == ()
    # the Slurm order splits every EP and data-parallel group over the two groups
    assert placement.slurm_order.crossings == ("a2a+dp+fsdp: switch -> system",)
    # placement keeps them on one switch; only pipeline neighbours cross
    assert placement.placed.crossings == ("p2p: switch -> system",)
    assert placement.chosen is placement.placed
    gain = placement.slurm_order.step_time_s / placement.placed.step_time_s
    # 1.04 on the fitted preset: the straggler wait of the EP all-to-all across 2 nodes
    # (network_jitter_us x H_16) is paid on either placement, only the taper differs
    assert gain > 1.03, gain
    switch_of = {n.hostname: n.switch for n in alloc.nodes}
    hosts = placement.placed.hosts
    for stage in range(4):  # the 16 ranks of a stage: one switch
        assert len({switch_of[h] for h in hosts[16 * stage : 16 * stage + 16]}) == 1
    assert placement.placed.local_ranks == tuple(r % 8 for r in range(64))


def test_cli_writes_hostfile_and_report(frontier_plan, tmp_path):
    out = tmp_path / "placement"
    argv = ["place", str(frontier_plan / "plan.json"), "--nodelist", "tux[1-8]",
            "--topology", str(frontier_plan / "topology.conf"), "--out", str(out)]  # fmt: skip
    result = run_piper(argv)
    assert result.code == 0, result.stderr
    assert result.stdout.startswith("placed: step ")
    hosts = (out / "hostfile").read_text().splitlines()
    assert len(hosts) == 64 and set(hosts) == {f"tux{i}" for i in range(1, 9)}
    assert (out / "local_ranks").read_text().split() == [str(r % 8) for r in range(64)]
    report = (out / "placement.md").read_text()
    assert "| slurm order |" in report and "a2a+dp+fsdp: switch -> system" in report


@pytest.mark.parametrize(
    ("nodelist", "topology", "field"),
    [
        ("tux[1-8", "topology.conf", "'[' without ']'"),
        ("tux[1-7],tux17", "topology.conf", "node 'tux17'"),
        ("tux[1-7]", "topology.conf", "7 nodes but the plan uses 8"),
        ("tux[1-8]", "missing.conf", "no such topology file"),
        ("tux[1-8]", None, "no network position for host 'tux1'"),
        ("tux[1-8]", "topology.conf --time-limit-s 0", "--time-limit-s: 0.0 must be positive"),
    ],
)
def test_bad_input_is_one_line(frontier_plan, tmp_path, nodelist, topology, field):
    out = tmp_path / "out"
    argv = ["place", str(frontier_plan / "plan.json"), "--nodelist", nodelist, "--out", str(out)]
    if topology:
        name, *flags = topology.split()
        argv += ["--topology", str(frontier_plan / name), *flags]
    result = run_piper(argv)
    assert result.code == 2, result.stderr
    assert len(result.err_lines) == 1 and "Traceback" not in result.stderr
    assert result.err_lines[0].startswith("piper place: error: ")
    assert field in result.err_lines[0]
    assert not out.exists()


def _job(tmp_path: Path, plan_dir: Path, topology: str | None) -> subprocess.CompletedProcess:
    """The exported sbatch script run in a fake allocation of tux[1-8]."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {
        "scontrol": "#!/bin/bash\n" + "".join(f"echo tux{i}\n" for i in range(1, 9)),
        "srun": "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        'for ((i = 0; i < WORLD_SIZE; i += 16)); do SLURM_PROCID=$i "$@"; done\n',
    }
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    plan = load_plan(plan_dir / "plan.json")
    script = tmp_path / "job.sbatch"
    cmd = "sh -c 'echo task $RANK $LOCAL_RANK $MASTER_ADDR'"
    script.write_text(slurm_script(plan, str(plan_dir / "plan.json"), cmd)[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PIPER_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_NODELIST="tux[1-8]",
               PIPER_HOSTFILE=str(tmp_path / "hostfile"), PIPER_PLACE_TIME_LIMIT_S="5")  # fmt: skip
    if topology:
        env["PIPER_TOPOLOGY"] = topology
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)


@pytest.mark.slow  # two `piper place` processes: 10-25 s on a busy 2-core machine
def test_sbatch_places_at_job_start_and_falls_back(frontier_plan, tmp_path):
    run = _job(tmp_path, frontier_plan, str(frontier_plan / "topology.conf"))
    assert run.returncode == 0, run.stderr
    assert "WARNING" not in run.stderr
    placed = (tmp_path / "hostfile.placement" / "hostfile").read_text()
    assert (tmp_path / "hostfile").read_text() == placed
    first = placed.split()[0]
    assert run.stdout.split("\n")[:4] == [f"task {r} 0 {first}" for r in (0, 16, 32, 48)]
    # without a topology, placement fails: one warning, the plan's order on Slurm's list
    run = _job(tmp_path, frontier_plan, None)
    assert run.returncode == 0, run.stderr
    assert "piper: WARNING: placement failed" in run.stderr
    assert "no network position for host 'tux1'" in run.stderr
    plan = json.loads((frontier_plan / "plan.json").read_text())
    nodes = [r["node"] for r in sorted(plan["ranks"], key=lambda r: r["rank"])]
    assert (tmp_path / "hostfile").read_text().split() == [f"tux{n + 1}" for n in nodes]


@pytest.mark.parametrize(
    "sizes",
    [
        dict(pp=2, dp=4, tp=2, ep=4),
        dict(pp=1, dp=4, tp=2, cp=2, ep=8, etp=2),
        dict(pp=3, dp=2, tp=1, ep=2),
        dict(pp=2, dp=8, tp=1, ep=4, etp=1),
    ],
)
def test_group_arrays_match_the_rank_ip_groups(sizes):
    """The reshaped groups are rank_ip.group_ranks' TP/CP/expert-TP/EP groups exactly."""
    par = ParallelConfig(**sizes)
    arrays = {names[0]: ranks for names, ranks in rank_group_arrays(par)}
    mine = {(k, frozenset(map(int, row))) for k, a in arrays.items() if k != "p2p"
            for row in a if k in ("tp", "cp", "etp", "a2a")}  # fmt: skip
    theirs = {({"ep": "a2a"}.get(k, k), frozenset(r)) for k, r in group_ranks(par)}
    assert mine == theirs
    block = par.tp * par.cp * par.dp
    assert {tuple(map(int, p)) for p in arrays.get("p2p", ())} == {
        (r, r + block) for r in range(par.world - block)
    }
    # data-parallel peers share stage, cp and tp indices; expert ones stage and EP index
    for name, key in (("dp", lambda q: q[0:1] + q[2:4]), ("edp", lambda q: (q[0], q[4]))):
        rows = arrays.get(name, np.arange(par.world).reshape(-1, 1))
        assert sorted(rows.ravel().tolist()) == list(range(par.world))
        for row in rows:
            assert len({key(logical_rank(par, int(q))) for q in row}) == 1


def test_greedy_by_switch_keeps_ep_groups_on_a_switch(frontier_plan, monkeypatch):
    """Above PLACE_IP_CELLS the greedy warm start is used, with its step-time gap."""
    monkeypatch.setattr(place, "PLACE_IP_CELLS", 0)
    plan = load_plan(frontier_plan / "plan.json")
    alloc = allocation_of(expand_hostlist("tux[1-8]"), str(frontier_plan / "topology.conf"),
                          "frontier")  # fmt: skip
    placement = place.place_plan(plan, alloc, SolverOptions("cpsat", 5.0, 1, 0))
    assert placement.report.backend == "greedy-by-switch"
    assert placement.placed.crossings == ("p2p: switch -> system",)
    gap = 1 - placement.compact.step_time_s / placement.placed.step_time_s
    assert placement.report.gap == pytest.approx(gap) and 0 < gap < 0.05


def test_sbatch_dry_run_shows_the_placement_it_would_run(frontier_plan, tmp_path):
    """Outside an allocation: the `piper place` line it would run, the plan's order."""
    plan = load_plan(frontier_plan / "plan.json")
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(plan, "/runs/my plan.json", None)[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PIPER_"))}
    env.update(PATH="/usr/bin:/bin", PIPER_HOSTFILE=str(tmp_path / "h"))
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    line = next(ln for ln in run.stderr.splitlines() if "this runs:" in ln)
    assert line.split("this runs: ")[1].split() == [
        "piper", "place", "/runs/my\\", "plan.json", "--nodelist", '"$SLURM_JOB_NODELIST"',
        "--out", f"{tmp_path}/h.placement", "--time-limit-s", "30",
    ]  # fmt: skip
    nodes = [r.node for r in sorted(plan.ranks, key=lambda r: r.rank)]
    assert (tmp_path / "h").read_text().split() == [f"node{n}" for n in nodes]
    assert not (tmp_path / "h.placement").exists()


def test_sbatch_falls_back_when_piper_place_cannot_run(tmp_path):
    """A failing `piper place` (here: PIPER=/bin/false) and a time limit that is not a number
    leave the job running in the plan's order, with a warning for each."""
    plan = export_plans.make_plan()
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(plan, "/p/plan.json", "true")[0])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'a\\nb\\nc\\nd\\n'\n")
    (bin_dir / "srun").write_text("#!/bin/bash\necho ran\n")
    for f in bin_dir.iterdir():
        f.chmod(stat.S_IRWXU)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "a,b,c,d",
           "PIPER_HOSTFILE": str(tmp_path / "h"), "PIPER": "/bin/false",
           "PIPER_PLACE_TIME_LIMIT_S": "soon",
           "PIPER_TOPOLOGY": str(tmp_path / "t.conf")}  # fmt: skip
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout == "ran\n", run.stderr
    assert run.stderr.splitlines() == [
        "piper: WARNING: PIPER_PLACE_TIME_LIMIT_S=soon is not a number of seconds; using 30",
        "piper: WARNING: placement failed (see above); ranks follow the plan's order on the "
        "Slurm node list",
    ]
    nodes = [r.node for r in sorted(plan.ranks, key=lambda r: r.rank)]
    assert (tmp_path / "h").read_text().split() == ["abcd"[n] for n in nodes]
