"""Job-start placement: `piper place` on fragmented allocations and at Frontier's size.

For each case a plan is made for the cluster (planner.search.make_plan, layout fixed), an
allocation is drawn as Slurm would list it (hostnames sorted), and `place_plan` re-solves the
rank IP on it. Printed per case: the allocation (nodes, switches, groups), the rank IP's
status and gap, the placement's wall time (in-process: hostlist expansion, topology, rank IP,
pricing) and the predicted step time of the placed order, the plain Slurm order and a
compact allocation (planner/run/place.py), with the gain over the Slurm order.

Cases:
- frontier-8-interleaved: weak-16e (pp 4, ep 16: each stage's EP group on 2 nodes) on 8
  nodes of two dragonfly groups whose switches hold alternate host names (a topology.conf
  written here): Slurm's sorted order splits every EP group over the two groups.
- frontier-128: 128 Frontier nodes over 5 dragonfly groups (ragged fragments), deepseek-v2
  with ep 32 (EP groups of 4 nodes), positions from Frontier's hostname rule.
- h100-64: 64 H100 nodes over 6 of 8 leaf switches of a fat tree whose leaves hold racks of 2
  nodes round-robin (a topology.conf written here; Slurm's sorted order alternates leaves),
  qwen3-30b-a3b with ep 32.
- speed-1024 / speed-9408: deepseek-v3 on 1,024 Frontier nodes drawn from the whole machine,
  and on all 9,408 nodes (the plan uses 8,192 of them); targets 2 s and 10 s.

Run: python3 benchmarks/job_start_placement.py [--time-limit-s 1] [--no-results]
Writes what it prints to results/job_start_placement.md (--results FILE, --no-results).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from results_md import ROOT, recorded

from planner.inputs.clusters import load_cluster
from planner.inputs.hostlist import load_nodelist
from planner.inputs.models import load_model
from planner.inputs.slurm_topology import allocation_of
from planner.ip.solvers import SolverOptions
from planner.plan import load_plan
from planner.plan.schema import Plan
from planner.run.place import place_plan
from planner.search.make_plan import make_plan
from planner.specs import TrainingSpec


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    cluster: str
    gpus: int
    fixed: dict
    seq_len: int
    global_batch: int
    target_s: float | None = None


CASES = [
    Case("frontier-8-interleaved", "weak-16e", "frontier", 64, {"tp": 1, "pp": 4, "ep": 16}, 1024,
         64),
    Case("frontier-128", "deepseek-v2", "frontier", 1024, {"tp": 1, "pp": 1, "ep": 32}, 4096, 1024),
    Case("h100-64", "qwen3-30b-a3b", "h100", 512, {"tp": 1, "pp": 1, "ep": 32}, 4096, 1024),
    Case("speed-1024", "deepseek-v3", "frontier", 8192, {"tp": 8, "pp": 8, "ep": 256}, 4096,
         1024, 2.0),
    Case("speed-9408", "deepseek-v3", "frontier", 65536, {"tp": 8, "pp": 8, "ep": 128}, 4096,
         1024, 10.0),
]  # fmt: skip
# Frontier fragments (first, last node number): 28 + 27 + 26 + 24 + 23 = 128 nodes, 5 groups
FRONTIER_FRAGMENTS = ((3, 30), (135, 161), (290, 315), (645, 668), (900, 922))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time-limit-s", type=float, default=1.0, help="rank IP time limit")
    p.add_argument("--case", action="append", help="run only these cases (repeatable)")
    p.add_argument("--results", default="results/job_start_placement.md")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    with recorded(args.results, "Job-start placement", enabled=not args.no_results):
        run(args)


def run(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if args.case and case.name not in args.case:
                continue
            plan = _plan(case)
            nodelist, topology = _allocation(case, Path(tmp))
            start = time.perf_counter()
            hosts = load_nodelist(nodelist)
            alloc = allocation_of(hosts, topology, case.cluster)
            placement = place_plan(plan, alloc, SolverOptions("cpsat", args.time_limit_s, 1, 0))
            wall = time.perf_counter() - start
            cli = _cli_wall_s(plan, nodelist, topology, Path(tmp), args.time_limit_s)
            rows.append((case, placement, wall, cli))
    print(_table(rows))
    print()
    for case, placement, _, _ in rows:
        for order in (placement.placed, placement.slurm_order):
            print(f"{case.name} {order.name}: {'; '.join(order.crossings) or 'no group crosses'}")
    print(
        "\nplacer: the rank IP (cpsat) or, above PLACE_IP_CELLS node x switch cells, the"
        " greedy-by-switch warm start. gap: the IP's (objective - bound) / objective in"
        " straddle weights, or for the greedy (step - compact step) / step, the compact"
        " allocation's step time being a lower bound under this pricing."
    )
    print(
        "\nStep times: planner/run/place.py (the resource model, groups that reach farther than"
        " on a compact allocation priced at the level they cross). wall s: in-process (node list,"
        " topology, placement, pricing) after imports; CLI s: the whole `piper place` process"
        " (interpreter, imports, plan.json, files), of which load_plan s reads and validates"
        f" plan.json; rank IP time limit {args.time_limit_s:g} s."
    )


def _cli_wall_s(plan: Plan, nodelist: str, topology: str | None, tmp: Path, limit_s: float):
    """Wall seconds of the whole `piper place` process (interpreter start, imports, files),
    and of reading and validating plan.json alone (planner.plan.load_plan)."""
    path = tmp / "plan.json"
    path.write_text(plan.to_json())
    argv = [sys.executable, "-c", "import sys; from planner.cli import main; sys.exit(main())",
            "place", str(path), "--nodelist", nodelist, "--out", str(tmp / "placement"),
            "--time-limit-s", str(limit_s)]  # fmt: skip
    if topology:
        argv += ["--topology", topology]
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, cwd=ROOT)
    cli_s = time.perf_counter() - start
    start = time.perf_counter()
    load_plan(path)
    return cli_s, time.perf_counter() - start


def _plan(case: Case) -> Plan:
    result = make_plan(
        load_model(case.model),
        load_cluster(case.cluster),
        TrainingSpec(seq_len=case.seq_len, global_batch=case.global_batch),
        case.gpus,
        case.fixed,
        SolverOptions("cpsat", 5.0, 1, 0),
    )
    if result.plan is None:
        raise SystemExit(f"{case.name}: no plan: {result.message}")
    return result.plan


def _allocation(case: Case, tmp: Path) -> tuple[str, str | None]:
    """(nodelist, topology file or None) as Slurm would hand them over."""
    if case.name == "frontier-128":
        ranges = ",".join(f"{a:05d}-{b:05d}" for a, b in FRONTIER_FRAGMENTS)
        return f"frontier[{ranges}]", None
    if case.name == "h100-64":
        return _h100_fat_tree(tmp)
    if case.name == "frontier-8-interleaved":
        topology = tmp / "interleaved.conf"
        topology.write_text(
            "SwitchName=s0 Nodes=tux[1,3,5,7]\nSwitchName=s1 Nodes=tux[2,4,6,8]\n"
            "SwitchName=g0 Switches=s0\nSwitchName=g1 Switches=s1\n"
        )
        return "tux[1-8]", str(topology)
    nodes = 9408 if case.name == "speed-9408" else 1024
    picked = sorted(random.Random(0).sample(range(1, 9409), nodes))
    path = tmp / f"{case.name}.hosts"
    path.write_text("".join(f"frontier{n:05d}\n" for n in picked))
    return str(path), None


def _h100_fat_tree(tmp: Path) -> tuple[str, str]:
    """8 leaves of 16 nodes; rack r (2 nodes, dgx[2r+1 .. 2r+2]) hangs off leaf r % 8. The
    job gets 64 nodes on leaves 0-5 (16, 16, 8, 8, 8, 8)."""
    leaves: dict[int, list[int]] = {leaf: [] for leaf in range(8)}
    for n in range(1, 129):
        leaves[((n - 1) // 2) % 8].append(n)
    lines = [f"SwitchName=leaf{k} Nodes=" + ",".join(f"dgx{n:03d}" for n in nodes)
             for k, nodes in leaves.items()]  # fmt: skip
    lines.append("SwitchName=spine Switches=leaf[0-7]")
    topology = tmp / "topology.conf"
    topology.write_text("\n".join(lines) + "\n")
    take = {0: 16, 1: 16, 2: 8, 3: 8, 4: 8, 5: 8}
    picked = sorted(n for k, count in take.items() for n in leaves[k][:count])
    return ",".join(f"dgx{n:03d}" for n in picked), str(topology)


def _table(rows) -> str:
    head = ("case", "nodes", "switches", "groups", "placer", "gap", "wall s", "CLI s",
            "load_plan s", "target s",
            "placed s", "slurm order s", "compact s", "gain vs slurm")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, pl, wall, (cli, load) in rows:
        r = pl.report
        gain = pl.slurm_order.step_time_s / pl.chosen.step_time_s
        cells = (case.name, f"{pl.nodes_used}/{pl.nodes_allocated}", pl.switches, pl.groups,
                 f"{r.backend} {r.status}", f"{r.gap:.3f}", f"{wall:.2f}", f"{cli:.2f}",
                 f"{load:.2f}",
                 f"{case.target_s:g}" if case.target_s else "-",
                 f"{pl.chosen.step_time_s:.4f}", f"{pl.slurm_order.step_time_s:.4f}",
                 f"{pl.compact.step_time_s:.4f}", f"{gain:.4f}x")  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
