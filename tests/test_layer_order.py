"""The floor plan's arrows: a room never imports a room above it, and no module imports itself
back through a cycle.

Planner rooms, lowest first (a module may import its own room and any room of a lower rank;
rooms of equal rank are siblings and do not import each other):

    0  planner.specs, then planner.parallel and planner.topology: the shared vocabulary
    1  planner.inputs                                      configs, presets, clusters, allocations
    2  planner.resources                                   the resource model
    3  planner.plan                                        plan.json
    4  planner.ip                                          solvers and the three integer programs
    5  planner.search                                      layouts, bounds, branch and bound
    6  planner.migration, planner.calibrate, planner.sim
  6.5  planner.run                                         what a run of a plan executes
    7  planner.outputs                                     reports, plots, exports, atomic files
    8  planner.cli                                         `piper ...`

The runtime sits above the planner (it may import any planner room but the CLI; the planner
never imports the runtime). Its own rooms, lowest first: data and metrics; dispatch; the
tensor-parallel layers and process groups; the single-device model; pipeline stages and
migration; checkpoints; the trainer and the benchmarks; the bootstrap.

Every import counts, including those inside functions: a lazy import still ties two rooms.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PLANNER_RANKS = {
    "planner": 0,
    "planner.specs": 0,
    "planner.parallel": 0.5,  # both build on specs
    "planner.topology": 0.5,
    "planner.targets": 0.5,  # the engines a plan is made for (builds on specs)
    "planner.inputs": 1,
    "planner.resources": 2,
    "planner.plan": 3,
    "planner.ip": 4,
    "planner.search": 5,
    "planner.migration": 6,
    "planner.calibrate": 6,
    "planner.sim": 6,
    "planner.run": 6.5,  # a run of a plan: its spec, options and migration prices
    "planner.size": 6.8,  # sizing: plans at every size (search, calibrate, resources)
    "planner.outputs": 7,
    "planner.cli": 8,
}
RUNTIME_RANKS = {
    "runtime": 10,
    "runtime.data": 10,
    "runtime.metrics": 10,
    "runtime.dispatch": 11,
    "runtime.parallel.mesh": 12,
    "runtime.parallel.tensor_parallel": 12,
    "runtime.model": 13,
    "runtime.parallel.replicas": 13.5,  # slot tables on the model, replica gradient sums
    "runtime.parallel.expert_tp": 13.5,  # expert TP: slices of the model's experts
    "runtime.parallel.fsdp": 13.5,  # FSDP units over the model's blocks
    "runtime.parallel.pipeline": 14,
    "runtime.parallel.pp_schedule": 13.8,  # torch pipelining stages and schedules (pp > 1)
    "runtime.migrate": 14,
    "runtime.checkpoint": 14.5,  # saves and loads the stages' modules and migration state
    "runtime.weight_shards": 14.2,  # where each rank's tensors sit in the whole weights
    "runtime.train": 15,
    "runtime.bench": 15,
    "runtime.launch": 16,
}
RANKS = {**PLANNER_RANKS, **RUNTIME_RANKS}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str:
    """The longest key of RANKS that `module` is, or lies inside."""
    best = ""
    for room in RANKS:
        if (module == room or module.startswith(room + ".")) and len(room) > len(best):
            best = room
    if not best:
        raise AssertionError(f"{module} is in no room of tests/test_layer_order.py; add it")
    return best


def imports_of(path: Path) -> set[str]:
    """Project modules `path` imports (planner.* / runtime.*), wherever the import stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from planner.ip import stage_dp` imports the module planner.ip.stage_dp
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("planner", "runtime") and _exists(name):
                found.add(name)
    return found


def _exists(module: str) -> bool:
    base = ROOT / module.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    return {
        module_name(p): imports_of(p)
        for top in ("planner", "runtime")
        for p in sorted((ROOT / top).rglob("*.py"))
    }


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up the floor plan or sideways between sibling rooms."""
    bad = []
    for src, targets in sorted(graph.items()):
        src_room = room_of(src)
        for dst in sorted(targets):
            dst_room = room_of(dst)
            if dst_room == src_room or src_room.startswith(dst_room + "."):
                continue
            src_rank, dst_rank = RANKS[src_room], RANKS[dst_room]
            if src.startswith("runtime") and dst == "planner.cli" or dst_rank >= src_rank:
                bad.append(f"{src} ({src_room}, {src_rank}) imports {dst} ({dst_room}, {dst_rank})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Module-level import cycles (Tarjan's strongly connected components of size > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # A package's __init__ re-exporting its modules is not a cycle with them.
    return {src: {d for d in dsts if not src.startswith(d + ".")} for src, dsts in graph.items()}


def test_every_module_is_in_a_room():
    for module in import_graph():
        room_of(module)


def test_no_room_imports_a_room_above_it():
    assert violations(import_graph()) == []


def test_no_import_cycles():
    assert cycles(_without_packages(import_graph())) == []


@pytest.mark.parametrize(
    "src, dst",
    [
        ("planner.resources.memory", "planner.cli"),  # up the planner's floors
        ("planner.migration.api", "planner.sim.halo"),  # sideways between siblings
        ("planner.plan.schema", "runtime.launch"),  # the planner reaching into the runtime
        ("runtime.model.moe", "runtime.launch"),  # up the runtime's floors
    ],
)
def test_an_upward_import_is_caught(src, dst):
    graph = import_graph()
    graph[src] = graph[src] | {dst}
    found = violations(graph)
    assert any(line.startswith(f"{src} ") and f"imports {dst} " in line for line in found)


def test_a_cycle_is_caught():
    graph = import_graph()
    graph["planner.specs"] = graph["planner.specs"] | {"planner.parallel"}
    graph["planner.parallel"] = graph["planner.parallel"] | {"planner.specs"}
    assert ["planner.parallel", "planner.specs"] in cycles(_without_packages(graph))
