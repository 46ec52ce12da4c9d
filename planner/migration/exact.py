"""Piper's assignment as an integer program (`piper migrate --solver cpsat|cbc`).

Same data as the local search (assignment.py) with the plain maximum (no smoothing):

    Data        forecast load f_e, slots S per rank, cost c_er of having e on r (seconds:
                transfer from its current rank + the per-move margin; 0 where it is),
                scale_s (seconds per token of hottest-rank load)
    Variables   x_er = 1 if expert e sits on rank r (`expert{e}_on_rank{r}`); z = max load
    Constraints (M1) every expert on exactly one rank; (M2) every rank holds S experts;
                (M3) sum_e f_e x_er <= z for every rank
    Objective   minimize scale_s * z + sum c_er x_er

The local search's answer is the solution hint, so a time limit returns at least that;
status, objective, bound and gap come back in a SolveReport. Replicas are not modelled
(use the default local search with --redundant-slots). Shape letters: E experts, R ranks.
"""

from __future__ import annotations

import numpy as np

from planner.ip.solvers import LinearModel, SolveReport, SolverOptions, quantize, solve, unit_for
from planner.migration.placement import initial_slots, rank_loads, rank_of_expert


def solve_assignment(
    start_RS: np.ndarray,
    load_E: np.ndarray,
    cost_ER: np.ndarray,
    scale_s: float,
    options: SolverOptions,
) -> tuple[np.ndarray, SolveReport]:
    """Optimal (or best within the time limit) slots for one layer, hinted by `start_RS`."""
    num_r, slots = start_RS.shape
    num_e = len(load_E)
    load_unit = unit_for(float(load_E.sum()), 100_000)
    cost_unit = unit_for(max(scale_s * float(load_E.sum()) / num_r, 1e-12), 100_000)
    f_E = [quantize(v, load_unit) for v in load_E]
    m = LinearModel("migration", objective_unit=cost_unit)
    x = [[m.bool_var(f"expert{e}_on_rank{r}") for r in range(num_r)] for e in range(num_e)]
    z = m.int_var(0, sum(f_E), "max_load")
    for e in range(num_e):  # (M1) every expert on exactly one rank
        m.add(((1, x[e][r]) for r in range(num_r)), "==", 1, f"M1_e{e}")
    for r in range(num_r):  # (M2) every rank keeps its slots; (M3) its load is below z
        m.add(((1, x[e][r]) for e in range(num_e)), "==", slots, f"M2_r{r}")
        m.add([*((f_E[e], x[e][r]) for e in range(num_e)), (-1, z)], "<=", 0, f"M3_r{r}")
    z_coef = quantize(scale_s * load_unit, cost_unit)
    m.minimize(
        [(z_coef, z)]
        + [
            (quantize(cost_ER[e, r], cost_unit), x[e][r])
            for e in range(num_e)
            for r in range(num_r)
        ]
    )
    hint_E = rank_of_expert(start_RS, num_e)
    for e in range(num_e):
        for r in range(num_r):
            m.hint(x[e][r], int(hint_E[e] == r))
    m.hint(z, max(sum(f_E[e] for e in range(num_e) if hint_E[e] == r) for r in range(num_r)))
    solution = solve(m, options)
    if not solution.report.has_solution:
        return start_RS.copy(), solution.report
    rank_E = np.array(
        [next(r for r in range(num_r) if solution.value(x[e][r])) for e in range(num_e)]
    )
    return initial_slots(rank_E, num_r), solution.report


def predicted_max(slots_RS: np.ndarray, load_E: np.ndarray) -> float:
    """Forecast hottest-rank load of a placement (tokens)."""
    return float(rank_loads(slots_RS, load_E).max())
