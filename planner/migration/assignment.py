"""Piper's priced assignment for one MoE layer and one interval.

Problem: slots are fixed per rank; choose which expert fills each slot to minimize

    J = scale_s * M(load_R)  +  sum of move seconds                (seconds over the interval)

where load_R is the FORECAST load per rank, scale_s converts one token of hottest-rank load
into seconds (balanced expert seconds / mean rank load) and M is the expected maximum of
the rank loads when each is off by a forecast error of about sigma tokens, smoothed as
M = sigma * log(sum_r exp(load_r / sigma)) (M = max when sigma = 0). The smoothing makes
the second- and third-hottest ranks count too: the forecast is not exact, and a placement
whose other ranks sit just under the maximum realizes a worse maximum than one that
leaves them room. Move seconds are priced from the placement in force (pricing.py), so
moving an expert back home is free again.

Method (bounded local search, exact pricing): starting from a placement, repeatedly take
the `sources` hottest ranks and apply the swap, of one slot of such a rank h with a slot of
any other rank, that most improves scale_s * (decrease of M) - (change of move seconds),
among swaps that lower h's load; stop when none does, after `patience` swaps in a row
without a new best J, or after `max_swaps`. Every prefix of the swap sequence is a
candidate; the best J wins. Cost per swap: O(sources * S * R * S).

Shape letters: R ranks, S slots per rank, E experts (index E stands for an empty slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.migration.placement import EMPTY, holders, rank_loads, replica_counts

_TOL = 1e-9


@dataclass(frozen=True)
class SearchResult:
    slots_RS: np.ndarray
    objective_s: float  # predicted J of the returned placement
    start_objective_s: float  # predicted J of the starting placement
    swaps: int


def _extended(slots_RS: np.ndarray, load_E: np.ndarray, cost_ER: np.ndarray):
    """Per-replica load and cost with a trailing zero row for the empty slot (index E)."""
    num_e = len(load_E)
    share_E = load_E / np.maximum(replica_counts(slots_RS, num_e), 1)
    w_X = np.append(share_E, 0.0)
    cost_XR = np.vstack([cost_ER, np.zeros((1, cost_ER.shape[1]))])
    held_XR = np.vstack([holders(slots_RS, num_e), np.zeros((1, slots_RS.shape[0]), dtype=bool)])
    ids_RS = np.where(slots_RS == EMPTY, num_e, slots_RS)
    return w_X, cost_XR, held_XR, ids_RS


def smooth_max(load_R: np.ndarray, sigma: float) -> float:
    """sigma * log(sum exp(load / sigma)); the plain maximum when sigma == 0."""
    top = float(load_R.max())
    if sigma <= 0:
        return top
    return top + sigma * float(np.log(np.exp((load_R - top) / sigma).sum()))


def _delta_m(load_R, h_H, rb_F, new_h, new_r, sigma):
    """Decrease of M when source ranks h_H and partners rb_F take loads new_h and new_r.

    Arrays are (H, S, F): source rank, its slot, partner slot (flat over R x S).
    """
    if sigma <= 0:  # plain maximum: credit the relief of h itself, so ties still progress
        return load_R[h_H][:, None, None] - np.maximum(new_h, new_r)
    top = float(load_R.max())
    z_R = np.exp((load_R - top) / sigma)
    z = z_R.sum()
    rest = np.maximum(z - z_R[h_H][:, None, None] - z_R[rb_F][None, None, :], 0.0)
    # invalid swaps may overshoot far above `top`; they are masked later, keep exp finite
    up_h = np.minimum((new_h - top) / sigma, 700.0)
    up_r = np.minimum((new_r - top) / sigma, 700.0)
    new_z = rest + np.exp(up_h) + np.exp(up_r)
    return sigma * (np.log(z) - np.log(new_z))


def _best_swap(ids_RS, load_R, w_X, cost_XR, held_XR, scale_s, sigma, h_H):
    """(score, source rank, its slot, partner flat slot) of the best swap relieving one of
    the source ranks h_H. Arrays are (H, S, F) as in _delta_m."""
    num_r, num_s = ids_RS.shape
    empty = w_X.shape[0] - 1
    ea_HS, eb_F = ids_RS[h_H], ids_RS.ravel()
    rb_F = np.repeat(np.arange(num_r), num_s)
    wa, wb = w_X[ea_HS][:, :, None], w_X[eb_F][None, None, :]
    lh = load_R[h_H][:, None, None]
    new_h, new_r = lh - wa + wb, load_R[rb_F][None, None, :] + wa - wb
    relief = lh - np.maximum(new_h, new_r)
    cost_a = cost_XR[ea_HS]  # (H, S, R)
    dcost = (
        cost_a[:, :, rb_F]
        - np.take_along_axis(cost_a, h_H[:, None, None], axis=2)
        + cost_XR[eb_F][:, h_H].T[:, None, :]
        - cost_XR[eb_F, rb_F][None, None, :]
    )
    valid = (rb_F[None, :] != h_H[:, None])[:, None, :] & (ea_HS[:, :, None] != eb_F)
    # a rank never holds two replicas of one expert
    valid &= ~(held_XR[ea_HS][:, :, rb_F] & (ea_HS != empty)[:, :, None])
    valid &= ~(held_XR[eb_F][:, h_H].T & (eb_F != empty))[:, None, :]
    gain = _delta_m(load_R, h_H, rb_F, new_h, new_r, sigma)
    score = np.where(valid & (relief > _TOL), scale_s * gain - dcost, -np.inf)
    hi, sa, fb = np.unravel_index(int(np.argmax(score)), score.shape)
    return float(score[hi, sa, fb]), int(h_H[hi]), int(sa), int(fb)


def priced_local_search(
    slots_RS: np.ndarray,
    load_E: np.ndarray,
    cost_ER: np.ndarray,
    scale_s: float,
    max_swaps: int,
    start_cost_s: float = 0.0,
    sigma: float = 0.0,
    sources: int = 1,
    patience: int = 4,
) -> SearchResult:
    """Minimize scale_s * max rank load + move seconds by swaps from `slots_RS`.

    Args:
        slots_RS: starting placement (R, S).
        load_E: forecast tokens per expert; split evenly over replicas.
        cost_ER: seconds to have expert e on rank r, relative to the placement in force.
        scale_s: seconds per token of hottest-rank load.
        max_swaps: bound on the number of swaps tried.
        start_cost_s: move seconds already spent to reach `slots_RS`.
        sigma: forecast error of a rank load, tokens (0 = plain maximum).
        sources: how many of the hottest ranks may give up an expert in one swap.
        patience: stop after this many swaps in a row without a new best objective.
    """
    num_r, num_s = slots_RS.shape
    w_X, cost_XR, held_XR, ids_RS = _extended(slots_RS, load_E, cost_ER)
    load_R = rank_loads(slots_RS, load_E)
    cost_s = start_cost_s
    start = scale_s * smooth_max(load_R, sigma) + cost_s
    best, best_ids, best_swaps = start, ids_RS.copy(), 0
    for it in range(max_swaps):
        hot_H = np.argsort(-load_R, kind="stable")[: max(1, sources)]
        score, h, sa, fb = _best_swap(ids_RS, load_R, w_X, cost_XR, held_XR, scale_s, sigma, hot_H)
        if score == -np.inf or it - best_swaps >= patience:
            break
        rb, sb = divmod(fb, num_s)
        ea, eb = int(ids_RS[h, sa]), int(ids_RS[rb, sb])
        cost_s += cost_XR[ea, rb] - cost_XR[ea, h] + cost_XR[eb, h] - cost_XR[eb, rb]
        load_R[h] += w_X[eb] - w_X[ea]
        load_R[rb] += w_X[ea] - w_X[eb]
        ids_RS[h, sa], ids_RS[rb, sb] = eb, ea
        held_XR[ea, h], held_XR[ea, rb] = False, True
        held_XR[eb, rb], held_XR[eb, h] = False, True
        objective = scale_s * smooth_max(load_R, sigma) + cost_s
        if objective < best - _TOL:
            best, best_ids, best_swaps = objective, ids_RS.copy(), it + 1
    empty = len(load_E)
    out_RS = np.where(best_ids == empty, EMPTY, best_ids)
    return SearchResult(out_RS, best, start, best_swaps)
