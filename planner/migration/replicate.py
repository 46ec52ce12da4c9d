"""Replica counts and from-scratch packing (the EPLB building blocks).

With spare slots, hot experts get extra replicas and their tokens are split evenly among
them. `replica_counts_for` hands each spare slot, one at a time, to the expert with the
highest load per replica (EPLB's `replicate_experts`); `pack` places the replicas
heaviest first on the least-loaded rank that has a free slot and does not already hold
that expert (EPLB's `balanced_packing`, with the distinct-rank rule added).

Shape letters: E experts, R ranks, S slots per rank (EMPTY / ABSENT: placement.py).
"""

from __future__ import annotations

import numpy as np

from planner.migration.placement import ABSENT, EMPTY, holders, rank_loads, replica_counts


def replica_counts_for(load_E: np.ndarray, ranks: int, total_slots: int) -> np.ndarray:
    """Replicas per expert (E,) filling `total_slots` slots; at most one replica per rank."""
    num_e = len(load_E)
    counts_E = np.ones(num_e, dtype=np.int64)
    for _ in range(min(total_slots, num_e * ranks) - num_e):
        per_replica_E = np.where(counts_E < ranks, load_E / counts_E, -np.inf)
        counts_E[int(np.argmax(per_replica_E))] += 1
    return counts_E


def pack(load_E: np.ndarray, counts_E: np.ndarray, capacity_R: np.ndarray) -> np.ndarray:
    """Greedy re-pack from scratch: heaviest replica first onto the least-loaded allowed rank
    (one with a free slot that lacks the expert); rank r has capacity_R[r] slots.

    Ties go to the lower expert id and the lower rank, so the result is deterministic.
    """
    share_E = load_E / np.maximum(counts_E, 1)
    replicas = [(e, c) for e in range(len(load_E)) for c in range(int(counts_E[e]))]
    replicas.sort(key=lambda ec: (-share_E[ec[0]], ec[0], ec[1]))
    ranks = len(capacity_R)
    slots_RS = np.full((ranks, int(capacity_R.max())), ABSENT, dtype=np.int64)
    slots_RS[np.arange(slots_RS.shape[1])[None, :] < capacity_R[:, None]] = EMPTY
    fill_R = np.zeros(ranks, dtype=np.int64)
    load_R = np.zeros(ranks)
    held_ER = np.zeros((len(load_E), ranks), dtype=bool)
    for e, _ in replicas:
        allowed_R = (fill_R < capacity_R) & ~held_ER[e]
        r = int(np.argmin(np.where(allowed_R, load_R, np.inf)))
        slots_RS[r, fill_R[r]] = e
        held_ER[e, r] = True
        fill_R[r] += 1
        load_R[r] += share_E[e]
    return slots_RS


def adjust_replicas(
    slots_RS: np.ndarray, target_E: np.ndarray, load_E: np.ndarray, cost_ER: np.ndarray
) -> np.ndarray:
    """Change replica counts to `target_E` with as little disturbance as possible.

    Surplus replicas leave the most loaded ranks holding them; missing ones go to the least
    loaded rank with an empty slot that lacks the expert (ties: cheaper copy, lower rank).
    Loads are per replica under the target counts.
    """
    out_RS = slots_RS.copy()
    num_e = len(load_E)
    share_E = load_E / np.maximum(target_E, 1)
    for e in np.nonzero(replica_counts(out_RS, num_e) > target_E)[0]:
        while replica_counts(out_RS, num_e)[e] > target_E[e]:
            load_R = rank_loads(out_RS, load_E)
            rs = np.argwhere(out_RS == e)
            r, s = rs[np.argmax(load_R[rs[:, 0]])]
            out_RS[r, s] = EMPTY
    for e in range(num_e):
        while replica_counts(out_RS, num_e)[e] < target_E[e]:
            load_R = np.where(out_RS >= 0, share_E[np.maximum(out_RS, 0)], 0).sum(axis=1)
            free_R = (out_RS == EMPTY).any(axis=1) & ~holders(out_RS, num_e)[e]
            key = np.lexsort((np.arange(len(load_R)), cost_ER[e], load_R))
            r = next((int(x) for x in key if free_R[x]), None)
            if r is None:  # every free slot sits on a rank that already holds e
                break
            out_RS[r, int(np.argmax(out_RS[r] == EMPTY))] = e
    return out_RS
