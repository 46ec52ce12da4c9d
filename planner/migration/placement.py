"""Slot placements of one MoE layer: which expert sits in each slot of each EP rank.

A placement is `slots_RS`, an int array (R ranks x S slots per rank) of expert ids, -1 for
an empty slot. Without replication S = E / R and every expert appears once; with
`redundant_slots` N each rank has E / R + N slots and hot experts may appear on several
ranks, their tokens split evenly among the replicas. Slot order inside a rank carries no
meaning. Shape letters: R ranks, S slots per rank, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.parallel import default_placement

EMPTY = -1


@dataclass(frozen=True)
class Move:
    """One expert copied from `src_rank` to `dst_rank` (its weights and optimizer state)."""

    layer: int  # transformer layer id
    expert: int
    src_rank: int
    dst_rank: int
    bytes: int
    seconds: float


def slot_counts(experts: int, ranks: int, redundant_slots: int = 0) -> np.ndarray:
    """Slots per EP rank (R,): E / R each, plus `redundant_slots` spread as evenly as the
    ranks allow (rank r gets one more when floor((r + 1) k / R) > floor(r k / R) for the
    remainder k, so 32 over 64 ranks land on every other rank)."""
    base, k = divmod(redundant_slots, ranks)
    r_R = np.arange(ranks)
    extra_R = ((r_R + 1) * k) // ranks - (r_R * k) // ranks
    return experts // ranks + base + extra_R


def initial_slots(rank_of_expert_E: np.ndarray, ranks: int, redundant_slots: int = 0):
    """Slots from a rank-per-expert vector; spare replica slots start empty."""
    num_e = len(rank_of_expert_E)
    slots_RS = np.full((ranks, num_e // ranks + redundant_slots), EMPTY, dtype=np.int64)
    fill_R = np.zeros(ranks, dtype=np.int64)
    for e, r in enumerate(rank_of_expert_E):
        slots_RS[r, fill_R[r]] = e
        fill_R[r] += 1
    return slots_RS


def default_rank_of_expert(experts: int, ranks: int) -> np.ndarray:
    """planner.parallel.default_placement as an array (E,)."""
    return np.asarray(default_placement(experts, ranks), dtype=np.int64)


def replica_counts(slots_RS: np.ndarray, experts: int) -> np.ndarray:
    """Number of ranks holding each expert (E,)."""
    held = slots_RS[slots_RS >= 0]
    return np.bincount(held, minlength=experts)


def rank_loads(slots_RS: np.ndarray, load_E: np.ndarray) -> np.ndarray:
    """Load of each rank (R,): each expert's load split evenly over its replicas."""
    counts_E = replica_counts(slots_RS, len(load_E))
    share_E = load_E / np.maximum(counts_E, 1)
    return np.where(slots_RS >= 0, share_E[np.maximum(slots_RS, 0)], 0.0).sum(axis=1)


def imbalance(slots_RS: np.ndarray, load_E: np.ndarray) -> float:
    """Max rank load / mean rank load (1.0 for an all-zero load)."""
    total = float(load_E.sum())
    if total <= 0:
        return 1.0
    return float(rank_loads(slots_RS, load_E).max() * slots_RS.shape[0] / total)


def holders(slots_RS: np.ndarray, experts: int) -> np.ndarray:
    """Boolean (E, R): expert e is held by rank r."""
    held_ER = np.zeros((experts, slots_RS.shape[0]), dtype=bool)
    r_idx, s_idx = np.nonzero(slots_RS >= 0)
    held_ER[slots_RS[r_idx, s_idx], r_idx] = True
    return held_ER


def placement_cost_ER(old_slots_RS: np.ndarray, experts: int, move_s_RR: np.ndarray):
    """Seconds to have expert e on rank r starting from `old_slots_RS` (0 where it already is).

    A new copy comes from the old holder with the cheapest link to r; an expert held
    nowhere costs nothing to place.
    """
    cost_ER = np.full((experts, move_s_RR.shape[0]), np.inf)
    r_idx, s_idx = np.nonzero(old_slots_RS >= 0)
    np.minimum.at(cost_ER, old_slots_RS[r_idx, s_idx], move_s_RR[r_idx])
    cost_ER[~np.isfinite(cost_ER)] = 0.0
    return cost_ER


def diff_moves(
    old_slots_RS: np.ndarray,
    new_slots_RS: np.ndarray,
    layer: int,
    expert_bytes: int,
    move_s_RR: np.ndarray,
) -> tuple[Move, ...]:
    """Moves that turn the old placement into the new one, sorted by (expert, dst).

    Every (expert, rank) of the new placement that the old one lacks is a copy from the old
    holder with the cheapest link (ties: lowest rank). Dropped replicas cost nothing.
    """
    experts = int(max(old_slots_RS.max(), new_slots_RS.max())) + 1
    old_ER, new_ER = holders(old_slots_RS, experts), holders(new_slots_RS, experts)
    moves = []
    for e, dst in zip(*np.nonzero(new_ER & ~old_ER), strict=True):
        srcs = np.nonzero(old_ER[e])[0]
        src = int(srcs[np.argmin(move_s_RR[srcs, dst])])
        moves.append(
            Move(layer, int(e), src, int(dst), int(expert_bytes), float(move_s_RR[src, dst]))
        )
    return tuple(moves)


def rank_of_expert(slots_RS: np.ndarray, experts: int) -> np.ndarray:
    """Rank per expert (E,) for a placement without replicas."""
    out_E = np.full(experts, EMPTY, dtype=np.int64)
    r_idx, s_idx = np.nonzero(slots_RS >= 0)
    out_E[slots_RS[r_idx, s_idx]] = r_idx
    return out_E
