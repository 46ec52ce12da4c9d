"""Solver backends for Piper's integer programs: OR-Tools CP-SAT (default) and CBC via PuLP.

Every formulation is written once against `LinearModel`, a small backend-neutral layer
(bool / integer / continuous variables, linear constraints, a linear objective to minimize,
solution hints) and solved by `solve(model, options)` on either backend.

Integer data: CP-SAT only accepts integer coefficients, so formulations quantize their float
data (seconds, bytes, tokens) to integer units with `quantize` before building the model, and
pass the unit as `LinearModel(objective_unit=...)`. Both backends then solve the *same*
integer program, so they reach the same optimum; objective and bound are reported back in the
original units (objective_units * objective_unit + objective_offset).

Determinism: time limit, threads and seed are always explicit. CP-SAT runs with
num_workers=threads and random_seed=seed; CBC with `threads` and `randomSeed`.
"""

from __future__ import annotations

import logging
import math
import re
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from planner.plan.schema import SolveReport
from planner.specs import SpecError

log = logging.getLogger(__name__)

SolverName = Literal["cpsat", "cbc"]
Sense = Literal["<=", ">=", "=="]
Terms = Iterable[tuple[int, int]]  # (integer coefficient, variable index)

BACKENDS: tuple[str, ...] = ("cpsat", "cbc")
# CP-SAT presolve off above this many constraint terms per second of time limit (20,000 at
# the default 10 s): presolve does not watch the clock, and on a 64-expert, 8-rank replica
# model (11,272 terms) it alone took 2.4 s of a 0.42 s limit and left no solution, where
# without it the solve returned in 0.5 s with the warm start kept.
PRESOLVE_TERMS_PER_S = 2_000
CBC_MAX_TERMS = 100_000  # larger models overrun CBC's time limit in its root LP; not sent


@dataclass(frozen=True)
class SolverOptions:
    """How to solve: backend, wall-clock limit (s), solver threads and random seed."""

    backend: SolverName = "cpsat"
    time_limit_s: float = 10.0
    threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SpecError(f"--solver: unknown backend '{self.backend}'; use cpsat or cbc")
        if not self.time_limit_s > 0:
            raise SpecError(f"--time-limit-s must be > 0, got {self.time_limit_s}")
        if self.threads < 1:
            raise SpecError(f"--threads must be >= 1, got {self.threads}")
        if self.seed < 0:
            raise SpecError(f"--seed must be >= 0, got {self.seed}")


def quantize(value: float, unit: float, mode: Literal["round", "ceil", "floor"] = "round") -> int:
    """`value` in integer multiples of `unit` (ceil for demands, floor for capacities)."""
    x = value / unit
    if mode == "ceil":
        return math.ceil(x - 1e-9)
    if mode == "floor":
        return math.floor(x + 1e-9)
    return round(x)


def unit_for(max_value: float, resolution: int = 1_000_000) -> float:
    """A quantum such that `max_value` is about `resolution` units (1.0 when max_value <= 0)."""
    return max_value / resolution if max_value > 0 else 1.0


@dataclass(frozen=True)
class _Var:
    name: str
    lb: int
    ub: int
    kind: Literal["bool", "int", "num"]


class LinearModel:
    """Solver-neutral integer linear model. Variables are ints (indices); terms (coef, var)."""

    def __init__(self, name: str, objective_unit: float = 1.0, objective_offset: float = 0.0):
        self.name = name
        self.objective_unit = objective_unit
        self.objective_offset = objective_offset
        self.vars: list[_Var] = []
        self.constraints: list[tuple[tuple[tuple[int, int], ...], Sense, int, str]] = []
        self.objective: tuple[tuple[int, int], ...] = ()
        self.hints: dict[int, int] = {}
        self.canonical: list[int] | None = None  # tie-break order; None = all bool vars
        self.created_at = time.perf_counter()  # building the model counts against the limit

    def canonical_vars(self) -> list[int]:
        """Variables whose lexicographic order breaks ties between optimal solutions."""
        if self.canonical is not None:
            return self.canonical
        return [i for i, v in enumerate(self.vars) if v.kind == "bool"]

    def bool_var(self, name: str) -> int:
        return self._add_var(name, 0, 1, "bool")

    def int_var(self, lb: int, ub: int, name: str) -> int:
        return self._add_var(name, lb, ub, "int")

    def num_var(self, lb: int, ub: int, name: str) -> int:
        """Continuous on CBC; integer on CP-SAT. Use only where an integer optimum exists
        anyway (e.g. a bound on a max of integer expressions)."""
        return self._add_var(name, lb, ub, "num")

    def _add_var(self, name: str, lb: int, ub: int, kind: Literal["bool", "int", "num"]) -> int:
        self.vars.append(_Var(name, int(lb), int(ub), kind))
        return len(self.vars) - 1

    def add(self, terms: Terms, sense: Sense, rhs: int, name: str = "") -> None:
        """Add sum(coef * var) <sense> rhs with integer coefficients."""
        t = tuple((int(c), v) for c, v in terms if c != 0)
        self.constraints.append((t, sense, int(rhs), name))

    def minimize(self, terms: Terms) -> None:
        self.objective = tuple((int(c), v) for c, v in terms if c != 0)

    def hint(self, var: int, value: int) -> None:
        self.hints[var] = int(value)

    def num_terms(self) -> int:
        return sum(len(terms) for terms, _s, _r, _n in self.constraints)

    def evaluate(self, values: Sequence[int]) -> int:
        """Objective (integer units) of a full assignment."""
        return sum(c * values[v] for c, v in self.objective)

    def to_original(self, units: float) -> float:
        return units * self.objective_unit + self.objective_offset


@dataclass(frozen=True)
class Solution:
    """A solve report plus the variable values (empty when there is no solution)."""

    report: SolveReport
    values: tuple[int, ...] = ()

    def value(self, var: int) -> int:
        return self.values[var]


def solve(model: LinearModel, options: SolverOptions) -> Solution:
    """Solve `model` (minimize) on the chosen backend within options.time_limit_s.

    A proven optimum is then made canonical (`_canonical_cpsat`): among all solutions with
    that objective, the first in lexicographic order of `model.canonical`, so the answer
    depends neither on the backend nor on the thread count or seed.
    """
    start = time.perf_counter()
    left_s = max(options.time_limit_s - (start - model.created_at), options.time_limit_s / 10)
    run = replace(options, time_limit_s=left_s)
    if options.backend == "cbc" and model.num_terms() > CBC_MAX_TERMS:
        message = (
            f"{model.name}: {model.num_terms()} terms is more than CBC handles within a time "
            "limit (its root LP ignores it); the warm start is kept, use --solver cpsat"
        )
        nan = float("nan")
        return Solution(SolveReport("cbc", "NOT_SOLVED", nan, nan, math.inf, 0.0, message))
    if options.backend == "cpsat":
        status, obj, bound, values = _solve_cpsat(model, run)
    else:
        status, obj, bound, values = _solve_cbc(model, run)
    if status == "OPTIMAL" and model.canonical_vars():
        # a deterministic budget (CP-SAT's work units, not the wall clock left), so whether
        # the canonical answer is reached does not depend on the machine's load
        canonical = _canonical_cpsat(model, obj, options.time_limit_s)
        values = canonical if canonical is not None else values
    wall_s = time.perf_counter() - start
    if status in ("OPTIMAL", "FEASIBLE"):
        objective = model.to_original(obj)
        bound_orig = model.to_original(min(bound, obj))
        gap = 0.0 if status == "OPTIMAL" else _gap(objective, bound_orig)
        if status == "FEASIBLE" and gap <= 1e-12:
            status = "OPTIMAL"
        if status == "OPTIMAL":
            bound_orig = objective
        report = SolveReport(options.backend, status, objective, bound_orig, gap, wall_s)
        log.info("%s: %s %s objective %.6g bound %.6g gap %.2g in %.3f s", model.name,
                 options.backend, status, objective, bound_orig, gap, wall_s)  # fmt: skip
        return Solution(report, tuple(values))
    message = (
        f"{model.name}: proven infeasible"
        if status == "INFEASIBLE"
        else f"{model.name}: no solution within {options.time_limit_s:g} s; raise --time-limit-s"
    )
    nan = float("nan")
    return Solution(SolveReport(options.backend, status, nan, nan, math.inf, wall_s, message))


def _gap(objective: float, bound: float) -> float:
    return max(0.0, objective - bound) / max(abs(objective), 1e-12)


def _cp_model(model: LinearModel):
    """CpModel built through its proto (fast for 10^5 terms); returns (model, vars, objective)."""
    from ortools.sat.python import cp_model

    cp = cp_model.CpModel()
    xs = [cp.NewIntVar(v.lb, v.ub, v.name) for v in model.vars]
    proto = cp.Proto()
    big = cp_model.INT_MAX
    for terms, sense, rhs, _name in model.constraints:
        lin = proto.constraints.add().linear
        lin.vars.extend(v for _, v in terms)
        lin.coeffs.extend(c for c, _ in terms)
        lo = rhs if sense in (">=", "==") else -big
        hi = rhs if sense in ("<=", "==") else big
        lin.domain.extend([lo, hi])
    objective = cp_model.LinearExpr.WeightedSum(
        [xs[v] for _, v in model.objective], [c for c, _ in model.objective]
    )
    return cp, xs, objective


def presolve_fits(terms: int, time_limit_s: float) -> bool:
    """Whether CP-SAT's presolve runs: at most PRESOLVE_TERMS_PER_S terms per second of limit."""
    return terms <= PRESOLVE_TERMS_PER_S * time_limit_s


def _solve_cpsat(model: LinearModel, options: SolverOptions):
    from ortools.sat.python import cp_model

    cp, xs, objective = _cp_model(model)
    cp.Minimize(objective)
    for v, val in sorted(model.hints.items()):
        cp.AddHint(xs[v], val)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = options.time_limit_s
    solver.parameters.num_workers = options.threads
    solver.parameters.random_seed = options.seed
    # Leave Ctrl-C to Python (KeyboardInterrupt): CP-SAT's own SIGINT handler would swallow
    # it mid-solve and leave SIG_DFL behind, killing the process on the next Ctrl-C.
    solver.parameters.catch_sigint_signal = False
    solver.parameters.cp_model_presolve = presolve_fits(model.num_terms(), options.time_limit_s)
    code = solver.Solve(cp)
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        status = "OPTIMAL" if code == cp_model.OPTIMAL else "FEASIBLE"
        values = list(solver.ResponseProto().solution)
        obj = model.evaluate(values)
        return status, obj, solver.BestObjectiveBound(), values
    if code == cp_model.INFEASIBLE:
        return "INFEASIBLE", 0, 0, []
    return "NOT_SOLVED", 0, 0, []


# The canonical search stops at `time_limit_s` of CP-SAT's deterministic time; the wall clock
# only stops it at this multiple, far beyond, so load on the machine does not change the plan.
CANONICAL_WALL_FACTOR = 20.0


def _canonical_cpsat(model: LinearModel, objective_units: int, time_limit_s: float):
    """The lexicographically largest `model.canonical_vars()` vector among solutions with
    the given objective: a single-worker depth-first search in that variable order, first
    solution. Deterministic whatever found the optimum; None if it runs out of its
    deterministic time."""
    from ortools.sat.python import cp_model

    cp, xs, objective = _cp_model(model)
    cp.Add(objective == objective_units)
    order = [xs[v] for v in model.canonical_vars()]
    cp.AddDecisionStrategy(order, cp_model.CHOOSE_FIRST, cp_model.SELECT_MAX_VALUE)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.max_time_in_seconds = CANONICAL_WALL_FACTOR * time_limit_s  # a backstop
    solver.parameters.num_workers = 1
    solver.parameters.search_branching = cp_model.FIXED_SEARCH
    solver.parameters.random_seed = 0
    solver.parameters.catch_sigint_signal = False  # Ctrl-C stays with Python, as above
    code = solver.Solve(cp)
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return list(solver.ResponseProto().solution)
    return None


_CBC_BOUND = re.compile(r"best possible\s+(-?[0-9.eE+]+)")
_CBC_BOUND2 = re.compile(r"Cbc0010I.*best possible\s+(-?[0-9.eE+]+)")


def _solve_cbc(model: LinearModel, options: SolverOptions):
    import pulp

    prob = pulp.LpProblem(_safe(model.name), pulp.LpMinimize)
    cat = {"bool": pulp.LpBinary, "int": pulp.LpInteger, "num": pulp.LpContinuous}
    xs = [
        prob.add_variable(f"v{i}_{_safe(v.name)}", v.lb, v.ub, cat[v.kind])
        for i, v in enumerate(model.vars)
    ]

    def affine(terms):
        return pulp.LpAffineExpression([(xs[v], c) for c, v in terms])

    prob += affine(model.objective)
    for k, (terms, sense, rhs, _name) in enumerate(model.constraints):
        expr = affine(terms)
        con = expr <= rhs if sense == "<=" else expr >= rhs if sense == ">=" else expr == rhs
        prob += con, f"c{k}"
    for v, val in model.hints.items():
        xs[v].setInitialValue(val)
    with tempfile.TemporaryDirectory(prefix="piper_cbc_") as tmp:
        log_path = str(Path(tmp) / "cbc.log")
        with warnings.catch_warnings():  # PuLP 3.x flags PULP_CBC_CMD for its 4.0 rename
            warnings.simplefilter("ignore", DeprecationWarning)
            cmd = pulp.PULP_CBC_CMD(
                msg=False,
                timeLimit=options.time_limit_s,
                threads=options.threads,
                warmStart=bool(model.hints),
                options=[f"randomSeed {options.seed + 1}", f"randomCbcSeed {options.seed + 1}"],
                logPath=log_path,
                keepFiles=False,
            )
        prob.solve(cmd)
        text = Path(log_path).read_text() if Path(log_path).exists() else ""
    sol_status = prob.sol_status
    if sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        values = [_round_value(x.varValue) for x in xs]
        obj = model.evaluate(values)
        if sol_status == pulp.LpSolutionOptimal:
            return "OPTIMAL", obj, obj, values
        return "FEASIBLE", obj, _cbc_bound(text, obj), values
    if prob.status == pulp.LpStatusInfeasible or sol_status == pulp.LpSolutionInfeasible:
        return "INFEASIBLE", 0, 0, []
    return "NOT_SOLVED", 0, 0, []


def _round_value(x: float | None) -> int:
    return 0 if x is None else round(x)


def _cbc_bound(log_text: str, objective: int) -> float:
    """Best bound CBC printed before stopping (its log is the only place PuLP exposes it)."""
    matches = _CBC_BOUND.findall(log_text)
    if not matches:
        return -math.inf
    return min(float(matches[-1]), float(objective))


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:60]
