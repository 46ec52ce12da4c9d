"""Piper's priced assignment for one MoE layer and one interval.

Problem: every rank keeps its slots; choose which expert fills each slot to minimize

    J = scale_s * M(load_R)  +  sum of move seconds                (seconds over the interval)

where load_R is the FORECAST load per rank, scale_s converts one token of hottest-rank load
into seconds (balanced expert seconds / mean rank load) and M is the expected maximum of
the rank loads when each is off by a forecast error of about sigma tokens, smoothed as
M = sigma * log(sum_r exp(load_r / sigma)) (M = max when sigma = 0). The smoothing makes
the second- and third-hottest ranks count too: the forecast is not exact, and a placement
whose other ranks sit just under the maximum realizes a worse maximum than one that
leaves them room. Move seconds are priced from the placement in force (cost_ER), so
moving an expert back home is free again.

Method (bounded exchange search, exact pricing): starting from a placement, repeatedly
take the `sources` hottest ranks and apply the best exchange of k slots of such a rank h
for k slots of any other rank (k = 1 .. exchange_slots: a swap, or with exchange_slots = 2
also two experts traded for two), scored by scale_s * (decrease of M) - (change of move
seconds), among exchanges that lower h's load; stop when none does, after `patience`
exchanges in a row without a new best J, or after `max_steps`. Every prefix of the
exchange sequence is a candidate; the best J wins. A trade of two for two relieves a rank
where no single swap can (loads 20 5 27 11 | 28 6 2 25: no swap lowers the 63, trading
{5, 27} for {6, 25} gives 62 / 62). Cost per step: O(sources * C * R * C) for C groups of
up to exchange_slots slots per rank (S, plus S (S - 1) / 2 with pairs).

Shape letters: R ranks, S slots per rank, C slot groups per rank, k slots per group,
E experts (index E stands for an empty slot, E + 1 for an absent one, placement.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from planner.migration.placement import ABSENT, EMPTY, holders, replica_counts

_TOL = 1e-9


@dataclass(frozen=True)
class SearchResult:
    slots_RS: np.ndarray
    objective_s: float  # predicted J of the returned placement
    start_objective_s: float  # predicted J of the starting placement
    steps: int  # exchanges in the returned prefix


@dataclass(frozen=True)
class _Best:
    """The best exchange of one step: its score and which groups of which ranks."""

    score: float
    h: int
    r: int
    slots_h: tuple[int, ...]
    slots_r: tuple[int, ...]
    dcost_s: float


def smooth_max(load_R: np.ndarray, sigma: float) -> float:
    """sigma * log(sum exp(load / sigma)); the plain maximum when sigma == 0."""
    top = float(load_R.max())
    if sigma <= 0:
        return top
    return top + sigma * float(np.log(np.exp((load_R - top) / sigma).sum()))


def _extended(slots_RS: np.ndarray, load_E: np.ndarray, cost_ER: np.ndarray):
    """Per-replica load, cost and holders with two zero rows: index E (empty slot) and
    E + 1 (absent slot); the slot ids in that numbering."""
    num_e, num_r = len(load_E), slots_RS.shape[0]
    share_E = load_E / np.maximum(replica_counts(slots_RS, num_e), 1)
    w_X = np.append(share_E, [0.0, 0.0])
    cost_XR = np.vstack([cost_ER, np.zeros((2, num_r))])
    held_XR = np.vstack([holders(slots_RS, num_e), np.zeros((2, num_r), dtype=bool)])
    ids_RS = np.where(slots_RS == EMPTY, num_e, np.where(slots_RS == ABSENT, num_e + 1, slots_RS))
    return w_X, cost_XR, held_XR, ids_RS


def _gain(load_R, h_H, new_h, new_r, sigma):
    """Decrease of M when each source h_H and each partner rank take new_h and new_r.

    new_h, new_r: (H, C, R, C) as in _best_of_size.
    """
    top = float(load_R.max())
    if sigma <= 0:
        return _plain_gain(load_R, h_H, new_h, new_r, top)
    z_R = np.exp((load_R - top) / sigma)
    z = z_R.sum()
    rest = z - z_R[h_H][:, None, None, None] - z_R[None, None, :, None]
    # invalid exchanges may overshoot far above `top`; they are masked later, keep exp finite
    up_h = np.minimum((new_h - top) / sigma, 700.0)
    up_r = np.minimum((new_r - top) / sigma, 700.0)
    return sigma * (np.log(z) - np.log(np.maximum(rest, 0.0) + np.exp(up_h) + np.exp(up_r)))


def _plain_gain(load_R, h_H, new_h, new_r, top):
    """Decrease of the plain maximum, (H, C, R, C). Where several ranks share the maximum,
    no single exchange lowers it, so a rank at the maximum is credited with its own relief
    (ties still progress); any other rank only with what the maximum loses (nothing)."""
    num_r = load_R.shape[0]
    top3_K = np.argsort(-load_R, kind="stable")[: min(3, num_r)]
    r_R = np.arange(num_r)
    rest_HR = np.full((len(h_H), num_r), -np.inf)
    for k in top3_K[::-1]:  # the first of the three that is neither h nor r
        free_HR = (h_H[:, None] != k) & (r_R[None, :] != k)
        rest_HR = np.where(free_HR, load_R[k], rest_HR)
    new_top = np.maximum(rest_HR[:, None, :, None], np.maximum(new_h, new_r))
    tied = (load_R >= top - _TOL).sum() > 1
    at_top_H = load_R[h_H] >= top - _TOL
    relief = load_R[h_H][:, None, None, None] - np.maximum(new_h, new_r)
    return np.where(tied & at_top_H[:, None, None, None], relief, top - new_top)


def _best_of_size(ids_RS, load_R, w_X, cost_XR, held_XR, scale_s, sigma, h_H, combo_Ck, noise):
    """The best exchange of k slots of a source rank h_H for k slots of another rank.

    Arrays over (source, its group, partner rank, partner group) are (H, C, R, C).
    noise: (copy_XR, copies, noise_s) or None: which (expert, rank) pairs are copies, how
    many the placement has, and the margin per square root of that count.
    """
    num_r = ids_RS.shape[0]
    absent = w_X.shape[0] - 1
    g_RCk = ids_RS[:, combo_Ck]
    usable_RC = ~(g_RCk == absent).any(axis=2)
    w_RC = w_X[g_RCk].sum(axis=2)
    cost_RCQ = cost_XR[g_RCk].sum(axis=2)  # seconds to have the group on rank q
    real_RCk = g_RCk < absent - 1
    clash_RCQ = (held_XR[g_RCk] & real_RCk[..., None]).any(axis=2)  # q already holds one
    r_R, c_C = np.arange(num_r), np.arange(combo_Ck.shape[0])
    at_RC = cost_RCQ[r_R[:, None], c_C[None, :], r_R[:, None]]  # where the group sits
    w_a = w_RC[h_H][:, :, None, None]
    lh = load_R[h_H][:, None, None, None]
    new_h = lh - w_a + w_RC[None, None]
    new_r = load_R[None, None, :, None] + w_a - w_RC[None, None]
    dcost = (
        cost_RCQ[h_H][:, :, :, None]
        - at_RC[h_H][:, :, None, None]
        + cost_RCQ[:, :, h_H].transpose(2, 0, 1)[:, None, :, :]
        - at_RC[None, None]
    )
    valid = (usable_RC[h_H][:, :, None, None] & usable_RC[None, None]) & (
        r_R[None, :] != h_H[:, None]
    )[:, None, :, None]
    valid &= ~clash_RCQ[h_H][:, :, :, None]  # a rank never holds two replicas of one expert
    valid &= ~clash_RCQ[:, :, h_H].transpose(2, 0, 1)[:, None, :, :]
    valid &= lh - np.maximum(new_h, new_r) > _TOL
    if noise is not None:
        copy_XR, copies, noise_s = noise
        dn = _exchange_delta(copy_XR[g_RCk].sum(axis=2), h_H, r_R, c_C)
        dcost = dcost + noise_s * (np.sqrt(np.maximum(copies + dn, 0)) - np.sqrt(copies))
    score = np.where(valid, scale_s * _gain(load_R, h_H, new_h, new_r, sigma) - dcost, -np.inf)
    hi, ca, r, cb = np.unravel_index(int(np.argmax(score)), score.shape)
    h = int(h_H[hi])
    return _Best(
        float(score[hi, ca, r, cb]),
        h,
        int(r),
        tuple(int(s) for s in combo_Ck[ca]),
        tuple(int(s) for s in combo_Ck[cb]),
        float(dcost[hi, ca, r, cb]),
    )


def _exchange_delta(v_RCQ, h_H, r_R, c_C):
    """Change of a per-(group, rank) quantity when group ca of h_H and group cb of r trade
    ranks, (H, C, R, C): v_RCQ[r, c, q] is that quantity with group c of rank r on rank q."""
    at_RC = v_RCQ[r_R[:, None], c_C[None, :], r_R[:, None]]
    return (
        v_RCQ[h_H][:, :, :, None]
        - at_RC[h_H][:, :, None, None]
        + v_RCQ[:, :, h_H].transpose(2, 0, 1)[:, None, :, :]
        - at_RC[None, None]
    )


def priced_local_search(
    slots_RS: np.ndarray,
    load_E: np.ndarray,
    cost_ER: np.ndarray,
    scale_s: float,
    max_steps: int,
    start_cost_s: float = 0.0,
    sigma: float = 0.0,
    sources: int = 1,
    patience: int = 4,
    exchange_slots: int = 1,
    noise_s: float = 0.0,
    copy_ER: np.ndarray | None = None,
) -> SearchResult:
    """Minimize scale_s * M(rank loads) + move seconds by exchanges from `slots_RS`.

    Args:
        slots_RS: starting placement (R, S); EMPTY slots may be filled, ABSENT ones never.
        load_E: forecast tokens per expert; split evenly over replicas.
        cost_ER: seconds to have expert e on rank r, relative to the placement in force.
        scale_s: seconds per token of hottest-rank load.
        max_steps: bound on the number of exchanges tried.
        start_cost_s: move seconds already spent to reach `slots_RS`.
        sigma: smoothing of the maximum, tokens (0 = plain maximum).
        sources: how many of the hottest ranks may give up slots in one exchange.
        patience: stop after this many exchanges in a row without a new best objective.
        exchange_slots: the most slots traded per side in one exchange (1 = swaps only).
        noise_s: margin, seconds, per square root of the number of copies (the counting
            noise of a move set's realized gain adds in quadrature over its experts).
        copy_ER: where having expert e on rank r is a copy (not held by the placement in
            force); needed with noise_s > 0.
    """
    num_s = slots_RS.shape[1]
    w_X, cost_XR, held_XR, ids_RS = _extended(slots_RS, load_E, cost_ER)
    combos = [_combos(num_s, k) for k in range(1, min(exchange_slots, num_s) + 1)]
    load_R = w_X[ids_RS].sum(axis=1)
    noise = None
    if noise_s > 0 and copy_ER is not None:
        copy_XR = np.vstack([copy_ER, np.zeros((2, copy_ER.shape[1]), dtype=bool)]).astype(float)
        copies = float(copy_XR[ids_RS, np.arange(ids_RS.shape[0])[:, None]].sum())
        noise = (copy_XR, copies, noise_s)
    cost_s = start_cost_s + (noise_s * np.sqrt(noise[1]) if noise else 0.0)
    start = scale_s * smooth_max(load_R, sigma) + cost_s
    best, best_ids, best_steps = start, ids_RS.copy(), 0
    for step in range(max_steps):
        if step - best_steps >= patience:
            break
        hot_H = np.argsort(-load_R, kind="stable")[: max(1, sources)]
        found = max(
            (
                _best_of_size(
                    ids_RS, load_R, w_X, cost_XR, held_XR, scale_s, sigma, hot_H, c, noise
                )
                for c in combos
            ),
            key=lambda b: b.score,
        )
        if found.score == -np.inf:
            break
        _apply(found, ids_RS, load_R, w_X, held_XR)
        cost_s += found.dcost_s
        if noise is not None:
            copies = float(noise[0][ids_RS, np.arange(ids_RS.shape[0])[:, None]].sum())
            noise = (noise[0], copies, noise_s)
        objective = scale_s * smooth_max(load_R, sigma) + cost_s
        if objective < best - _TOL:
            best, best_ids, best_steps = objective, ids_RS.copy(), step + 1
    num_e = len(load_E)
    out_RS = np.where(best_ids == num_e, EMPTY, np.where(best_ids == num_e + 1, ABSENT, best_ids))
    return SearchResult(out_RS, best, start, best_steps)


def _apply(found: _Best, ids_RS, load_R, w_X, held_XR) -> None:
    """Carry out one exchange in place: ids, rank loads and holders."""
    h, r = found.h, found.r
    give, take = ids_RS[h, list(found.slots_h)].copy(), ids_RS[r, list(found.slots_r)].copy()
    ids_RS[h, list(found.slots_h)], ids_RS[r, list(found.slots_r)] = take, give
    load_R[h] += w_X[take].sum() - w_X[give].sum()
    load_R[r] += w_X[give].sum() - w_X[take].sum()
    held_XR[give, h], held_XR[take, r] = False, False
    held_XR[give, r], held_XR[take, h] = True, True
    held_XR[-2:] = False  # empty and absent slots belong to no rank


def _combos(slots: int, k: int) -> np.ndarray:
    """Every set of k slot indices out of `slots`, (C, k)."""
    return np.array(list(itertools.combinations(range(slots), k)), dtype=np.int64).reshape(-1, k)
