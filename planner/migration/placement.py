"""Slot placements of one MoE layer: which expert sits in each slot of each EP rank.

A placement is `slots_RS`, an int array (R ranks x S slots) of expert ids. Without
replication every rank has E / R slots and every expert appears once. With redundant slots
(a total over the EP group, `slot_counts`) hot experts may appear on several ranks, their
tokens split evenly among the replicas; a slot not yet filled is EMPTY, and a rank with
fewer slots than S pads its row with ABSENT (never filled: that memory was not planned).
Slot order inside a rank carries no meaning here (plan.json lists a rank's slots
ascending). Shape letters: R ranks, S slots per rank, E experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.ip.expert_ip import slot_counts as expert_slot_counts
from planner.parallel import default_placement

EMPTY = -1  # a slot that holds no expert yet
ABSENT = -2  # padding of a rank with fewer than S slots


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
    """Slots per EP rank (R,) for a total of redundant slots (planner.ip.expert_ip.slot_counts:
    32 over 64 ranks land on every other rank)."""
    return np.asarray(expert_slot_counts(experts, ranks, redundant_slots), dtype=np.int64)


def initial_slots(rank_of_expert_E: np.ndarray, ranks: int, redundant_slots: int = 0):
    """Slots from a rank-per-expert vector; the redundant slots (a total, spread by
    slot_counts) start EMPTY."""
    num_e = len(rank_of_expert_E)
    counts_R = slot_counts(num_e, ranks, redundant_slots)
    slots_RS = np.full((ranks, int(counts_R.max())), ABSENT, dtype=np.int64)
    slots_RS[np.arange(slots_RS.shape[1])[None, :] < counts_R[:, None]] = EMPTY
    fill_R = np.zeros(ranks, dtype=np.int64)
    for e, r in enumerate(rank_of_expert_E):
        slots_RS[r, fill_R[r]] = e
        fill_R[r] += 1
    return slots_RS


def slots_of_ranks(rank_slots: Sequence[Sequence[int]]) -> np.ndarray:
    """slots_RS from each rank's expert ids (plan.json's `slots`), padded with ABSENT."""
    width = max(len(held) for held in rank_slots)
    slots_RS = np.full((len(rank_slots), width), ABSENT, dtype=np.int64)
    for r, held in enumerate(rank_slots):
        slots_RS[r, : len(held)] = sorted(held)
    return slots_RS


def rank_slots_of(slots_RS: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Each rank's expert ids, ascending (plan.json's `slots`); EMPTY slots are left out."""
    return tuple(tuple(sorted(int(e) for e in row if e >= 0)) for row in slots_RS)


def capacity(slots_RS: np.ndarray) -> np.ndarray:
    """Slots of each rank (R,), filled or EMPTY."""
    return (slots_RS != ABSENT).sum(axis=1)


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
    e_N, dst_N = np.nonzero(new_ER & ~old_ER)
    # per copy, the old holders' link seconds to its destination (inf: not a holder)
    from_NR = np.where(old_ER[e_N], move_s_RR[:, dst_N].T, np.inf)
    src_N = np.argmin(from_NR, axis=1)  # ties: the lowest rank
    seconds_N = move_s_RR[src_N, dst_N]
    return tuple(
        Move(layer, e, src, dst, int(expert_bytes), s)
        for e, src, dst, s in zip(
            e_N.tolist(), src_N.tolist(), dst_N.tolist(), seconds_N.tolist(), strict=True
        )
    )


def lowest_holder(slots_RS: np.ndarray, experts: int) -> np.ndarray:
    """The lowest rank holding each expert (E,): plan.json's rank_of_expert."""
    held_ER = holders(slots_RS, experts)
    return np.where(held_ER.any(axis=1), np.argmax(held_ER, axis=1), EMPTY).astype(np.int64)


def rank_of_expert(slots_RS: np.ndarray, experts: int) -> np.ndarray:
    """Rank per expert (E,) for a placement without replicas."""
    out_E = np.full(experts, EMPTY, dtype=np.int64)
    r_idx, s_idx = np.nonzero(slots_RS >= 0)
    out_E[slots_RS[r_idx, s_idx]] = r_idx
    return out_E
