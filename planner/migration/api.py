"""The runtime's entry point: a pure function from placement + load history to the next move.

Called between training steps (runtime/migrate.py). No I/O, no global state; the same
inputs give the same decision. Shape letters: T past intervals (or steps), L MoE layers,
E experts, R expert-parallel ranks, S slots per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.migration.forecast import forecast_interval
from planner.migration.placement import (
    ABSENT,
    EMPTY,
    Move,
    diff_moves,
    imbalance,
    initial_slots,
    lowest_holder,
    rank_slots_of,
    replica_counts,
)
from planner.migration.policies import LayerCosts, MigrationOptions, piper, recent
from planner.migration.pricing import MoveCosts
from planner.specs import SpecError


@dataclass(frozen=True, eq=False)
class MigrationDecision:
    """The placement for the next interval and the moves that reach it.

    placement_LE: int array (L, E), EP rank of each expert per layer (with replicas: the
        lowest rank holding it, as plan.json's rank_of_expert).
    moves: every copy of an expert onto a rank that did not hold it, from the holder with
        the cheapest link, with bytes and seconds from the costs; a replica that is only
        dropped is no move.
    predicted_gain_s: forecast hottest-rank expert seconds saved over the next interval,
        minus the transfer seconds of the moves (>= 0; 0 when nothing moves).
    slots_LRS: per layer and EP rank the experts it holds next, ascending (plan.json's
        `slots`); a rank keeps its number of slots, so a rank listing fewer experts than
        it has slots leaves the rest free.
    """

    placement_LE: np.ndarray
    moves: tuple[Move, ...]
    predicted_gain_s: float
    slots_LRS: tuple[tuple[tuple[int, ...], ...], ...] = ()


def uniform_costs(layers: int, ranks: int) -> MoveCosts:
    """Prices when the caller has none: free moves, 1 s of balanced expert compute per
    interval; only the margins (MigrationOptions.move_margin, margin_sigmas) then limit moves."""
    return MoveCosts(
        expert_bytes_L=np.zeros(layers, dtype=np.int64),
        move_s_LRR=np.zeros((layers, ranks, ranks)),
        level_LRR=np.where(np.eye(ranks, dtype=bool), -1, 0)[None].repeat(layers, axis=0),
        balanced_s_L=np.ones(layers),
    )


def _slots_of(current) -> list[np.ndarray]:
    """Each layer's slots_RS from (L, E) ranks per expert or (L, R, S) slot rows (rows may
    differ in length; entries < 0 are free slots)."""
    first = current[0] if len(current) else []
    if len(first) and isinstance(first[0], Sequence | np.ndarray):  # slot rows per rank
        out = []
        for rows in current:
            width = max(len(row) for row in rows)
            slots_RS = np.full((len(rows), width), ABSENT, dtype=np.int64)
            for r, row in enumerate(rows):
                slots_RS[r, : len(row)] = [int(e) if e >= 0 else EMPTY for e in row]
            out.append(slots_RS)
        return out
    current_LE = np.asarray(current, dtype=np.int64)
    if current_LE.ndim != 2:
        raise SpecError("next_placement: the placement must be (L, E) ranks or (L, R, S) slots")
    ranks = int(current_LE.max()) + 1 if current_LE.size else 1
    counts = np.stack([np.bincount(row, minlength=ranks) for row in current_LE])
    if current_LE.min() < 0 or (counts != counts[0, 0]).any():
        raise SpecError(
            f"next_placement: every one of the {ranks} EP ranks must hold E/R experts per layer"
        )
    return [initial_slots(row, ranks) for row in current_LE]


def _check(slots_L: list[np.ndarray], history_TLE: np.ndarray, costs: MoveCosts) -> None:
    if history_TLE.ndim != 3 or history_TLE.shape[1] != len(slots_L):
        raise SpecError(
            f"next_placement: load history must be (T, L, E) with L = {len(slots_L)} layers"
        )
    num_e = history_TLE.shape[2]
    for lj, slots_RS in enumerate(slots_L):
        placed = int(slots_RS.max()) + 1
        if placed != num_e:
            raise SpecError(
                f"next_placement: the load history has E = {num_e} experts, layer {lj} of "
                f"the placement {placed}; pass the same layers and experts"
            )
        if slots_RS.shape[0] != costs.num_ranks:
            raise SpecError(
                f"next_placement: layer {lj} has {slots_RS.shape[0]} EP ranks, the prices "
                f"{costs.num_ranks}; price the placement's ranks"
            )
        twice = any(len(set(row[row >= 0])) < int((row >= 0).sum()) for row in slots_RS)
        if twice or (replica_counts(slots_RS, num_e) == 0).any():
            raise SpecError(
                f"next_placement: layer {lj} must hold every expert, at most once per rank"
            )


def next_placement(
    current: Sequence | np.ndarray,
    load_history_TLE: Sequence[Sequence[Sequence[float]]] | np.ndarray,
    costs: MoveCosts | None = None,
    options: MigrationOptions | None = None,
    layer_ids: Sequence[int] | None = None,
) -> MigrationDecision:
    """Piper's policy for every layer: the placement for the next interval and its moves.

    Args:
        current: the placement in force: (L, E) EP rank of each expert (E/R per rank), or,
            with redundant slots, (L, R, S) slot rows: per layer and EP rank the experts in
            its slots, entries < 0 free (rows may differ in length: that rank's slots).
        load_history_TLE: (T, L, E) tokens per expert in past intervals, oldest first; or
            in past steps with options.rows_per_interval = the steps of one interval (the
            runtime's way; planner.migration.forecast.forecast_interval). Only these are
            used (never the future), the newest options.history_intervals intervals of
            them; fewer rows than one interval keep the placement.
        costs: move and imbalance prices (pricing.build_move_costs); None = uniform_costs.
        options: policy knobs; None = the documented defaults.
        layer_ids: transformer layer id per row, written into each Move.layer (default
            0..L-1, the row position).
    Returns:
        MigrationDecision; applying `moves` (and dropping the replicas slots_LRS no longer
        lists) to the current placement gives `slots_LRS` and `placement_LE`.
    """
    slots_L = _slots_of(current)
    num_l = len(slots_L)
    history_TLE = np.asarray(load_history_TLE, dtype=float)
    if history_TLE.size == 0:
        num_e = 1 + max(int(s.max()) for s in slots_L)
        history_TLE = np.zeros((0, num_l, num_e))
    costs = costs or uniform_costs(num_l, slots_L[0].shape[0])
    _check(slots_L, history_TLE, costs)
    options = options or MigrationOptions()
    history_TLE = recent(history_TLE, options)  # the newest options.history_intervals
    ids = tuple(layer_ids) if layer_ids is not None else tuple(range(num_l))
    new_L, moves, gain_s = [], [], 0.0
    for lj, old_RS in enumerate(slots_L):
        if history_TLE.shape[0] < max(1, options.rows_per_interval):  # no whole interval
            new_L.append(old_RS)
            continue
        layer = LayerCosts(costs.move_s_LRR[lj], float(costs.balanced_s_L[lj]))
        new_RS = piper(old_RS, history_TLE[:, lj, :], layer, options)
        new_L.append(new_RS)
        step = diff_moves(
            old_RS, new_RS, ids[lj], int(costs.expert_bytes_L[lj]), costs.move_s_LRR[lj]
        )
        moves.extend(step)
        if step:
            load_E = forecast_interval(
                history_TLE[:, lj, :], options.rows_per_interval, options.forecast
            )
            saved = imbalance(old_RS, load_E) - imbalance(new_RS, load_E)
            gain_s += layer.balanced_s * saved - sum(m.seconds for m in step)
    num_e = history_TLE.shape[2]
    placement_LE = np.stack([lowest_holder(s, num_e) for s in new_L])
    slots_LRS = tuple(rank_slots_of(s) for s in new_L)
    return MigrationDecision(placement_LE, tuple(moves), max(gain_s, 0.0), slots_LRS)
