"""The runtime's entry point: a pure function from placement + load history to the next move.

Called between training steps (runtime/migrate.py). No I/O, no global state; the same
inputs give the same decision. Shape letters: T past intervals (or steps), L MoE layers,
E experts, R expert-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.migration.forecast import forecast_loads
from planner.migration.placement import (
    Move,
    diff_moves,
    imbalance,
    initial_slots,
    rank_of_expert,
)
from planner.migration.policies import LayerCosts, MigrationOptions, piper
from planner.migration.pricing import MoveCosts
from planner.specs import SpecError


@dataclass(frozen=True, eq=False)
class MigrationDecision:
    """The placement for the next interval and the moves that reach it.

    placement_LE: int array (L, E), EP rank of each expert per layer.
    moves: every expert whose rank changes, with bytes and seconds from the costs.
    predicted_gain_s: forecast hottest-rank expert seconds saved over the next interval,
        minus the transfer seconds of the moves (>= 0; 0 when nothing moves).
    """

    placement_LE: np.ndarray
    moves: tuple[Move, ...]
    predicted_gain_s: float


def uniform_costs(layers: int, ranks: int) -> MoveCosts:
    """Prices when the caller has none: free moves, 1 s of balanced expert compute per
    interval; only the margins (MigrationOptions.move_margin, margin_sigmas) then limit moves."""
    return MoveCosts(
        expert_bytes_L=np.zeros(layers, dtype=np.int64),
        move_s_LRR=np.zeros((layers, ranks, ranks)),
        level_LRR=np.where(np.eye(ranks, dtype=bool), -1, 0)[None].repeat(layers, axis=0),
        balanced_s_L=np.ones(layers),
    )


def _check(current_LE: np.ndarray, history_TLE: np.ndarray, costs: MoveCosts) -> None:
    if current_LE.ndim != 2 or history_TLE.ndim != 3:
        raise SpecError("next_placement: current must be (L, E) and load history (T, L, E)")
    if history_TLE.shape[1:] != current_LE.shape:
        raise SpecError(
            f"next_placement: load history has (L, E) = {history_TLE.shape[1:]}, the placement "
            f"{current_LE.shape}; pass the same layers and experts"
        )
    ranks = costs.num_ranks
    counts = np.stack([np.bincount(row, minlength=ranks) for row in current_LE])
    if current_LE.min() < 0 or current_LE.max() >= ranks or (counts != counts[0, 0]).any():
        raise SpecError(
            f"next_placement: every one of the {ranks} EP ranks must hold E/R experts per layer"
        )


def next_placement(
    current_rank_of_expert_LE: Sequence[Sequence[int]] | np.ndarray,
    load_history_TLE: Sequence[Sequence[Sequence[float]]] | np.ndarray,
    costs: MoveCosts | None = None,
    options: MigrationOptions | None = None,
    layer_ids: Sequence[int] | None = None,
) -> MigrationDecision:
    """Piper's policy for every layer: the placement for the next interval and its moves.

    Args:
        current_rank_of_expert_LE: (L, E) EP rank of each expert, the placement in force.
        load_history_TLE: (T, L, E) tokens per expert in past intervals (or steps), oldest
            first; only these are used (never the future). T = 0 keeps the placement.
        costs: move and imbalance prices (pricing.build_move_costs); None = uniform_costs.
        options: policy knobs; None = the documented defaults.
        layer_ids: transformer layer id per row, written into each Move.layer (default
            0..L-1, the row position).
    Returns:
        MigrationDecision; applying `moves` to the current placement gives `placement_LE`.
    """
    current_LE = np.asarray(current_rank_of_expert_LE, dtype=np.int64)
    history_TLE = np.asarray(load_history_TLE, dtype=float)
    if history_TLE.size == 0:
        history_TLE = np.zeros((0, *current_LE.shape))
    num_l, num_e = current_LE.shape
    ranks = costs.num_ranks if costs is not None else int(current_LE.max()) + 1
    costs = costs or uniform_costs(num_l, ranks)
    _check(current_LE, history_TLE, costs)
    options = options or MigrationOptions()
    ids = tuple(layer_ids) if layer_ids is not None else tuple(range(num_l))
    placement_LE = current_LE.copy()
    moves: list[Move] = []
    gain_s = 0.0
    if history_TLE.shape[0] == 0:
        return MigrationDecision(placement_LE, (), 0.0)
    for lj in range(num_l):
        old_RS = initial_slots(current_LE[lj], ranks)
        layer = LayerCosts(costs.move_s_LRR[lj], float(costs.balanced_s_L[lj]))
        new_RS = piper(old_RS, history_TLE[:, lj, :], layer, options)
        placement_LE[lj] = rank_of_expert(new_RS, num_e)
        step = diff_moves(
            old_RS, new_RS, ids[lj], int(costs.expert_bytes_L[lj]), costs.move_s_LRR[lj]
        )
        moves.extend(step)
        if step:
            load_E = forecast_loads(history_TLE[:, lj, :], options.forecast)
            saved = imbalance(old_RS, load_E) - imbalance(new_RS, load_E)
            gain_s += layer.balanced_s * saved - sum(m.seconds for m in step)
    return MigrationDecision(placement_LE, tuple(moves), max(gain_s, 0.0))
