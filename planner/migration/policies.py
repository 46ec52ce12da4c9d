"""Migration policies: one MoE layer, one interval, past loads only.

Every policy maps (placement in force, loads of the past intervals) to the placement for
the next interval; all keep each rank's slot count.

- none:   never move.
- swap:   the paper's greedy swap, on the last interval's loads: up to `swap_rounds` times,
          take the hottest and the coldest rank and make the swap of one expert of each that
          most narrows their gap; stop when no swap narrows it.
- repack: EPLB's policy: re-pack from scratch on the last interval's loads (replicas first
          when there are spare slots), ignoring where experts are and what moves cost.
- piper:  forecast the loads (forecast.py), then the priced assignment (assignment.py),
          moving only when the predicted gain pays for the moves.

Shape letters: T past intervals, E experts, R ranks, S slots per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from planner.ip.solvers import SolverOptions
from planner.migration.assignment import priced_local_search, smooth_max
from planner.migration.exact import solve_assignment
from planner.migration.forecast import ForecastOptions, forecast_interval
from planner.migration.placement import (
    ABSENT,
    capacity,
    holders,
    placement_cost_ER,
    rank_loads,
    replica_counts,
)
from planner.migration.replicate import adjust_replicas, pack, replica_counts_for

log = logging.getLogger(__name__)

PolicyName = Literal["none", "swap", "repack", "piper"]

# Past intervals a policy reads: the runtime hands its policy the newest 64 intervals
# (runtime.train.close_interval), so a replay reads the same window and decides alike,
# and each decision's work is bounded whatever the trace's length.
HISTORY_INTERVALS = 64
POLICIES: tuple[PolicyName, ...] = ("none", "swap", "repack", "piper")


@dataclass(frozen=True)
class MigrationOptions:
    """Knobs shared by the policies (defaults are the documented ones)."""

    forecast: ForecastOptions = field(default_factory=ForecastOptions)
    swap_rounds: int = 0  # paper's T for `swap`; 0 = number of ranks
    max_steps: int = 0  # exchanges Piper's search may try; 0 = number of experts
    # Extra predicted imbalance reduction (in units of max/mean) a migration must deliver on
    # top of paying for its moves: a hysteresis against forecast noise.
    min_gain: float = 0.0
    # Fixed predicted imbalance reduction (units of max/mean) each moved expert must buy on
    # top of its transfer time (a floor; the uncertainty margin below is added to it).
    move_margin: float = 0.0
    # A set of n moved experts must also buy this many standard errors of its realized
    # gain's counting noise, k sqrt(n) sqrt(tokens / E) tokens of hottest-rank load: each
    # moved expert's count is off by about sqrt(its tokens) from any forecast, and these
    # errors add in quadrature (see MIGRATION.md).
    margin_sigmas: float = 2.8
    # Forecast error of a rank load, in units of its measured RMS error on the last interval;
    # 0 = optimize the plain maximum of the forecast.
    noise_scale: float = 1.0
    sources: int = 8  # hottest ranks that may give up an expert in one exchange
    # Most slots of a rank traded in one exchange: 1 = swaps; 2 also trades two for two
    # (measured on benchmarks/migration_quality.py: no better there, 3-4x slower).
    exchange_slots: int = 1
    # None = the local search; set = also solve the integer program (exact.py) on the
    # plain maximum, hinted by the local search (no replicas).
    solver: SolverOptions | None = None
    # Rows of the load history per interval: 1 when each row is an interval; K when each row
    # is a step and an interval is K steps (piper run passes steps; forecast_interval).
    rows_per_interval: int = 1
    # Past intervals the policy reads (the newest); older rows are ignored.
    history_intervals: int = HISTORY_INTERVALS

    def window_rows(self) -> int:
        """Rows of the history the policy reads: the newest history_intervals intervals."""
        return max(1, self.history_intervals) * max(1, self.rows_per_interval)


def recent(history_TE: np.ndarray, opts: MigrationOptions) -> np.ndarray:
    """The newest opts.window_rows() rows of a history (T, ...): what a policy reads."""
    return history_TE[max(0, history_TE.shape[0] - opts.window_rows()) :]


@dataclass(frozen=True)
class LayerCosts:
    """Prices for one layer: move seconds between ranks and balanced expert seconds."""

    move_s_RR: np.ndarray
    balanced_s: float


def no_migration(current_RS, history_TE, costs, opts):  # noqa: ARG001 - uniform signature
    return current_RS.copy()


def last_interval(history_TE: np.ndarray, rows_per_interval: int = 1) -> np.ndarray:
    """Tokens per expert of the newest interval: the sum of the last rows_per_interval rows."""
    return history_TE[-max(1, rows_per_interval) :].sum(axis=0).astype(float)


def greedy_swap(current_RS: np.ndarray, history_TE: np.ndarray, costs, opts) -> np.ndarray:
    """The paper's heuristic on the last interval's loads (see module docstring)."""
    load_E = last_interval(history_TE, opts.rows_per_interval)
    slots_RS = current_RS.copy()
    num_e = len(load_E)
    share_X = np.append(load_E / np.maximum(replica_counts(slots_RS, num_e), 1), 0.0)
    rounds = opts.swap_rounds or slots_RS.shape[0]
    for _ in range(rounds):
        load_R = rank_loads(slots_RS, load_E)
        hot, cold = int(np.argmax(load_R)), int(np.argmin(load_R))
        gap = load_R[hot] - load_R[cold]
        held_ER = holders(slots_RS, num_e)
        best = (gap - 1e-9, -1, -1)
        for sa, ea in enumerate(slots_RS[hot]):
            for sb, eb in enumerate(slots_RS[cold]):
                if ABSENT in (ea, eb) or ea == eb:
                    continue
                if (ea >= 0 and held_ER[ea, cold]) or (eb >= 0 and held_ER[eb, hot]):
                    continue
                new_gap = abs(gap - 2.0 * (share_X[ea] - share_X[eb]))
                if new_gap < best[0]:
                    best = (new_gap, sa, sb)
        if best[1] < 0:
            break
        _, sa, sb = best
        slots_RS[hot, sa], slots_RS[cold, sb] = slots_RS[cold, sb], slots_RS[hot, sa]
    return slots_RS


def repack(current_RS: np.ndarray, history_TE: np.ndarray, costs, opts) -> np.ndarray:
    """EPLB: replicas by load per replica, then heaviest-first packing, from scratch."""
    load_E = last_interval(history_TE, opts.rows_per_interval)
    capacity_R = capacity(current_RS)
    counts_E = replica_counts_for(load_E, len(capacity_R), int(capacity_R.sum()))
    return pack(load_E, counts_E, capacity_R)


def rank_error(
    current_RS: np.ndarray, history_TE: np.ndarray, fopts: ForecastOptions, rows: int = 1
) -> float:
    """RMS error, tokens, of the forecast of a rank load, measured on the last past interval
    (the last `rows` rows of the history: forecast_interval).

    With one past interval only, the counting noise sqrt(mean rank load) stands in.
    """
    last_E = last_interval(history_TE, rows)
    mean = float(last_E.sum()) / current_RS.shape[0]
    if history_TE.shape[0] < 2 * rows:
        return float(np.sqrt(max(mean, 0.0)))
    guess_E = forecast_interval(history_TE[:-rows], rows, fopts)
    guess_E = guess_E * last_E.sum() / max(float(guess_E.sum()), 1e-300)
    err_R = rank_loads(current_RS, last_E) - rank_loads(current_RS, guess_E)
    return float(np.sqrt(np.mean(err_R**2)))


def _candidates(current_RS, load_E, cost_ER, opts, search):
    """Local searches from the current placement (and from re-counted replicas)."""
    ranks, total = current_RS.shape[0], int(capacity(current_RS).sum())
    num_e = len(load_E)
    starts = [current_RS]
    if total > num_e:  # spare slots: also try the forecast's replica counts
        target_E = replica_counts_for(load_E, ranks, total)
        starts.append(adjust_replicas(current_RS, target_E, load_E, cost_ER))
    held_ER = holders(current_RS, num_e)
    for start_RS in starts:
        start_cost = float(cost_ER[holders(start_RS, num_e) & ~held_ER].sum())
        yield priced_local_search(start_RS, load_E, cost_ER, start_cost_s=start_cost, **search)


def canonical_slots(slots_RS: np.ndarray) -> np.ndarray:
    """The same table with each rank's experts in ascending order, in the slots that hold
    experts (free and absent slots stay where they are)."""
    out = np.array(slots_RS, dtype=np.int64, copy=True)
    for row in out:
        held = row >= 0
        row[held] = np.sort(row[held])
    return out


def piper(
    current_RS: np.ndarray, history_TE: np.ndarray, costs: LayerCosts, opts: MigrationOptions
) -> np.ndarray:
    """Forecast, then priced search from several starts; keep the current placement unless
    the best start's predicted gain over the interval exceeds its move cost and margins.
    Reads the newest opts.history_intervals intervals of the history (the runtime's window).
    The decision depends on which experts each rank holds, not on their slot order
    (canonical_slots): a replay and a run whose tables list them differently decide alike."""
    current_RS = canonical_slots(current_RS)
    history_TE = recent(history_TE, opts)
    load_E = forecast_interval(history_TE, opts.rows_per_interval, opts.forecast)
    ranks = current_RS.shape[0]
    num_e = len(load_E)
    mean = float(load_E.sum()) / ranks
    if mean <= 0:
        return current_RS.copy()
    scale_s = costs.balanced_s / mean
    cost_ER = placement_cost_ER(current_RS, num_e, costs.move_s_RR)
    held_ER = holders(current_RS, num_e)
    sigma = opts.noise_scale * rank_error(
        current_RS, history_TE, opts.forecast, opts.rows_per_interval
    )
    # per moved expert: the fixed floor; per move set of n experts: k sqrt(n) standard
    # errors of a mean expert's count
    cost_ER = cost_ER + np.where(held_ER, 0.0, opts.move_margin * costs.balanced_s)
    noise_s = opts.margin_sigmas * scale_s * np.sqrt(float(load_E.sum()) / num_e)
    # temperature that makes sigma*log(sum exp) match E[max] of R Gaussian errors
    temp = sigma * np.sqrt(2.0 / np.log(ranks)) if ranks > 1 else 0.0
    search = dict(
        scale_s=scale_s, max_steps=opts.max_steps or num_e, sigma=temp, sources=opts.sources,
        exchange_slots=opts.exchange_slots, noise_s=noise_s, copy_ER=~held_ER,
    )  # fmt: skip
    current_s = scale_s * smooth_max(rank_loads(current_RS, load_E), temp)
    best_RS, best_s = current_RS, current_s - opts.min_gain * costs.balanced_s
    for found in _candidates(current_RS, load_E, cost_ER, opts, search):
        copies_ER = holders(found.slots_RS, num_e) & ~held_ER
        move_s = float(cost_ER[copies_ER].sum()) + noise_s * np.sqrt(copies_ER.sum())
        total_s = scale_s * smooth_max(rank_loads(found.slots_RS, load_E), temp) + move_s
        if total_s < best_s - 1e-12:
            best_RS, best_s = found.slots_RS, total_s
    if opts.solver is not None and int(capacity(current_RS).sum()) == num_e:
        return _exact(current_RS, best_RS, load_E, cost_ER, scale_s, noise_s, costs, opts)
    return best_RS.copy()


def _exact(current_RS, hint_RS, load_E, cost_ER, scale_s, noise_s, costs, opts) -> np.ndarray:
    """The integer program on the plain maximum with linear move prices (transfer + floor);
    keep the current placement unless the result pays, counting the noise margin
    noise_s sqrt(moved experts) too."""
    found_RS, report = solve_assignment(hint_RS, load_E, cost_ER, scale_s, opts.solver)
    log.info(
        "migration IP: %s objective %.6g bound %.6g gap %.3g in %.3f s",
        report.status, report.objective, report.bound, report.gap, report.wall_s,
    )  # fmt: skip
    num_e = len(load_E)
    copies_ER = holders(found_RS, num_e) & ~holders(current_RS, num_e)
    moved_s = float(cost_ER[copies_ER].sum()) + noise_s * np.sqrt(copies_ER.sum())
    found_s = scale_s * float(rank_loads(found_RS, load_E).max()) + moved_s
    stay_s = scale_s * float(rank_loads(current_RS, load_E).max())
    if found_s < stay_s - opts.min_gain * costs.balanced_s - 1e-12:
        return found_RS
    return current_RS.copy()


PolicyFn = Callable[[np.ndarray, np.ndarray, LayerCosts, MigrationOptions], np.ndarray]

POLICY_FNS: dict[str, PolicyFn] = {
    "none": no_migration,
    "swap": greedy_swap,
    "repack": repack,
    "piper": piper,
}
