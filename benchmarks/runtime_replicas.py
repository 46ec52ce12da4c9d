"""Redundant expert slots inside real training runs (`piper run`, CPU gloo emulation).

Plans tiny-moe on the cpu-gloo cluster (4 processes, 2 per emulated node) in two layouts,
dp=ep=4 (edp 1) and dp=4 ep=2 (edp 2), and trains each twice for the same steps: as
planned, and with replicas written into plan.json's `experts[].slots` for every MoE layer
(planner/migration/MIGRATION.md). Prints side by side the loss agreement (fp32 plans: replicas
change nothing in the math, so the losses agree to fp32 rounding), bytes per step by kind, and
the replica gradient sums against their count by hand: per EP group, MoE layer and step,
each replicated expert with c copies of P gradient bytes (fp32, 4 B/param) moves 2 (c - 1) P
between its lowest holder and the others (runtime/parallel/replicas.py), intra- or
inter-node by the pair. The expert-DP all-reduce covers every slot, so grad_expert grows
with the slots per rank. CPU step times only say how the emulation behaves.

Usage: python benchmarks/runtime_replicas.py [--steps 10] [--out DIR] [--results FILE]
Runs go to DIR (default a temporary directory); what it prints goes to
results/runtime_replicas.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from results_md import recorded

from planner.plan import load_plan
from planner.run.spec import ExpertSlots, run_spec_from_plan
from runtime.parallel.mesh import rank_coords

KINDS = ("dispatch", "grad_dense", "grad_expert", "grad_replica")
RANKS_PER_NODE = 2
# (ep, slots per EP rank): 8 experts, each layout with replicas of two experts, one of them
# crossing the node boundary when the EP group does
LAYOUTS = {
    4: [[0, 1, 4], [0, 2, 3], [4, 5], [6, 7]],
    2: [[0, 1, 2, 3, 4], [0, 4, 5, 6, 7]],
}


def _piper(*args: str) -> None:
    code = "import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, *args], check=True, stdout=subprocess.DEVNULL)


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _bytes(line: dict, kind: str, where: str = "") -> int:
    by_kind = line["bytes_by_kind"]
    places = (where,) if where else ("intra", "inter")
    return sum(by_kind.get(f"{kind}_{p}", 0) for p in places)


def with_slots(plan_path: Path, slots: list[list[int]], out: Path) -> Path:
    """A copy of the plan whose every MoE layer holds `slots` (rank_of_expert: lowest holder)."""
    d = json.loads(plan_path.read_text())
    table = ExpertSlots.even(slots)
    for entry in d["experts"]:
        experts = len(entry["rank_of_expert"])
        entry["slots"], entry["rank_of_expert"] = slots, list(table.rank_of_expert(experts))
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    return out / "plan.json"


def replica_bytes_by_hand(plan_path: Path) -> tuple[int, int]:
    """(intra, inter) bytes of the replica gradient sums per step, from the plan alone."""
    plan = load_plan(plan_path)
    spec = run_spec_from_plan(plan, plan.model_spec(str(plan_path)), 1.0, RANKS_PER_NODE)
    coords = rank_coords(spec)
    intra = inter = 0
    for layer, table in spec.slots:
        moe = spec.model.layers[layer].moe
        grad_bytes = (3 if moe.gated else 2) * spec.model.hidden_size * moe.expert_ffn * 4
        stage = next(s for s, layers in enumerate(spec.stage_layers) if layer in layers)
        for edp_idx in range(spec.edp):  # each EP group of the stage sums its own copies
            node = {c.ep_idx: c.node for c in coords if c.stage == stage and c.edp_idx == edp_idx}
            for e in range(moe.num_experts):
                ranks = [r for r, _ in table.holders(e)]
                for other in ranks[1:]:  # the lowest holder and each other: P each way
                    same = node[ranks[0]] == node[other]
                    intra += 2 * grad_bytes * same
                    inter += 2 * grad_bytes * (not same)
    return intra, inter


def compare(root: Path, steps: int) -> None:
    """Plan and train both layouts with and without replicas under `root`; print them."""
    print(f"tiny-moe on cpu-gloo, 4 processes, {RANKS_PER_NODE} per node, {steps} steps")
    for ep, slots in LAYOUTS.items():
        plan_dir = root / f"plan-ep{ep}"
        _piper("plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "4",
               "--pp", "1", "--tp", "1", "--ep", str(ep), "--micro-batch", "2",
               "--seq-len", "64", "--global-batch", "16", "--dispatcher", "flat",
               "--no-fsdp",  # replicas sum whole experts' gradients; FSDP would shard them
               "--dtype", "fp32",  # fp32 compute: the losses agree to fp32 rounding
               "--out", str(plan_dir))  # fmt: skip
        plans = {"plain": plan_dir / "plan.json"}
        plans["replicas"] = with_slots(plans["plain"], slots, root / f"plan-ep{ep}-slots")
        runs = {}
        for name, path in plans.items():
            out = root / f"run-ep{ep}-{name}"
            _piper("run", str(path), "--steps", str(steps), "--dispatcher", "flat",
                   "--ranks-per-node", str(RANKS_PER_NODE), "--out", str(out))  # fmt: skip
            runs[name] = _lines(out)
        plain, rep = runs["plain"], runs["replicas"]
        dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(plain, rep, strict=True))
        print(f"\ndp=4 ep={ep} (edp {4 // ep}), slots per EP rank {slots}")
        print(f"loss {plain[0]['loss']:.4f} -> {plain[-1]['loss']:.4f}, "
              f"max |replicas - plain| {dloss:.2e}")  # fmt: skip
        last_p, last_r = plain[-1], rep[-1]
        print(f"{'bytes/step':<13} {'plain':>11} {'replicas':>11} {'ratio':>7}")
        for kind in KINDS:
            a, b = _bytes(last_p, kind), _bytes(last_r, kind)
            ratio = f"{b / a:7.3f}" if a else f"{'-':>7}"
            print(f"{kind:<13} {a:>11,} {b:>11,} {ratio}")
        intra, inter = replica_bytes_by_hand(plans["replicas"])
        got = (_bytes(last_r, "grad_replica", "intra"), _bytes(last_r, "grad_replica", "inter"))
        print(f"grad_replica intra / inter: measured {got[0]:,} / {got[1]:,}, "
              f"by hand {intra:,} / {inter:,}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None, help="directory for the plans and runs")
    p.add_argument("--results", default="results/runtime_replicas.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="piper-replicas-"))
    title = "Redundant expert slots in piper run: replicas vs the plain plan"
    with recorded(args.results, title, enabled=not args.no_results):
        compare(root, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
