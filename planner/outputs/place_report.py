"""The files `piper place` writes: the hostfile (one host per rank) and a short report.

hostfile: line r is the host of rank r (Slurm's SLURM_HOSTFILE format for
`srun --distribution=arbitrary`). local_ranks: the device index of each rank, space separated
(the sbatch script's RANK_LOCAL). placement.md: the allocation, the rank IP's report, and the
predicted step time of the placed order against the plain Slurm order and a compact allocation.
"""

from __future__ import annotations

from planner.run.place import Placement, PricedOrder


def placement_files(placement: Placement, plan_path: str) -> dict[str, str]:
    """File name -> text for a placement (hostfile, local_ranks, placement.md)."""
    chosen = placement.chosen
    return {
        "hostfile": "".join(f"{h}\n" for h in chosen.hosts),
        "local_ranks": " ".join(map(str, chosen.local_ranks)) + "\n",
        "placement.md": report_text(placement, plan_path),
    }


def summary_line(placement: Placement) -> str:
    """One line: the chosen order's step time against the Slurm order and compact."""
    c, s, k = placement.chosen, placement.slurm_order, placement.compact
    return (
        f"{c.name}: step {c.step_time_s:.4g} s vs slurm order {s.step_time_s:.4g} s "
        f"({_gain(s, c)}), compact allocation {k.step_time_s:.4g} s; "
        f"{placement.nodes_used} of {placement.nodes_allocated} nodes on "
        f"{placement.switches} switches in {placement.groups} groups"
    )


def report_text(placement: Placement, plan_path: str) -> str:
    """placement.md: what was solved and the three orders side by side."""
    r = placement.report
    rows = [
        "| order | step (s) | vs slurm order | groups reaching farther than priced |",
        "|---|---:|---:|---|",
    ]
    for order in (placement.placed, placement.slurm_order, placement.compact):
        crossed = "; ".join(order.crossings) or "none"
        rows.append(f"| {order.name} | {order.step_time_s:.6g} | "
                    f"{_gain(placement.slurm_order, order)} | {crossed} |")  # fmt: skip
    lines = [
        f"# Placement of {plan_path}",
        "",
        f"Allocation: {placement.nodes_allocated} nodes on {placement.switches} switches in "
        f"{placement.groups} groups; the plan uses {placement.nodes_used}.",
        f"Rank IP: {r.backend} {r.status}, objective {r.objective:g}, bound {r.bound:g}, "
        f"gap {r.gap:.3g}, {placement.solve_s:.2f} s{f' ({r.message})' if r.message else ''}.",
        f"Written: the {placement.chosen.name} order (hostfile, local_ranks).",
        "",
        *rows,
        "",
        "Step times: the resource model, with the groups that reach farther on this allocation "
        "than on a compact one priced at the level they cross (planner/run/place.py).",
    ]
    return "\n".join(lines) + "\n"


def _gain(base: PricedOrder, order: PricedOrder) -> str:
    """Speedup of `order` over `base` as 'x.xxx x'."""
    return f"{base.step_time_s / order.step_time_s:.3f}x" if order.step_time_s > 0 else "-"
