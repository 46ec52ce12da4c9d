"""Fluid (flow-level) network model: max-min fair link sharing and flow completion times.

A network is a set of links with capacities; a flow class is a group of identical flows
that all cross the same kinds of links. `usage_LC[l, c]` is how many flows of class c cross
ONE link l. With one flow per class and 0/1 usage this is the textbook per-flow model; with
counts it is the same model aggregated over a symmetric topology (every link of a kind
carries the same number of flows of every class), which is exact when the symmetry holds.

Shape letters: L = links (or link kinds), C = flow classes.
"""

from __future__ import annotations

import numpy as np

_REL_TOL = 1e-9


def max_min_rates(
    capacity_L: np.ndarray, usage_LC: np.ndarray, active_C: np.ndarray | None = None
) -> np.ndarray:
    """Max-min fair rate of one flow of every class, by progressive filling.

    All unfrozen classes grow their per-flow rate together; when a link fills, every class
    crossing it freezes at its current rate. Repeats until every class is frozen.

    Args:
        capacity_L: capacity of one link of each kind (bytes/s), shape (L,).
        usage_LC: flows of class c crossing one link of kind l, shape (L, C), >= 0.
        active_C: which classes currently send (default all), shape (C,).

    Returns:
        rate_C: bytes/s of ONE flow of each class; 0 for inactive classes, +inf for active
        classes that cross no link (they are not limited by the network).
    """
    cap_L = np.asarray(capacity_L, dtype=float)
    use_LC = np.asarray(usage_LC, dtype=float)
    n_classes = use_LC.shape[1]
    active = np.ones(n_classes, bool) if active_C is None else np.asarray(active_C, bool)
    rate_C = np.zeros(n_classes)
    unlimited = active & (use_LC.sum(axis=0) == 0)
    rate_C[unlimited] = np.inf
    finite = active & ~unlimited
    free = finite.copy()
    while free.any():
        load_L = use_LC[:, finite] @ rate_C[finite]
        growing_L = use_LC[:, free].sum(axis=1)
        crossed = growing_L > 0
        slack_L = cap_L - load_L
        headroom_L = np.where(crossed, slack_L / np.where(crossed, growing_L, 1.0), np.inf)
        step = max(float(np.min(headroom_L)), 0.0)
        rate_C[free] += step
        # the link that set the step is full by construction; others within rounding too
        full_L = crossed & (headroom_L <= step * (1 + _REL_TOL) + _REL_TOL * cap_L)
        frozen_C = (use_LC[full_L] > 0).any(axis=0)
        free &= ~frozen_C
    return rate_C


def fluid_finish_times(
    capacity_L: np.ndarray, usage_LC: np.ndarray, size_C: np.ndarray
) -> np.ndarray:
    """Completion time of every flow class when all start at t = 0 (event-driven fluid model).

    Between events the rates are max-min fair among unfinished classes; when a class
    finishes, its links are re-shared among the rest.

    Args:
        capacity_L: capacity of one link of each kind (bytes/s), shape (L,).
        usage_LC: flows of class c crossing one link of kind l, shape (L, C).
        size_C: bytes of ONE flow of each class, shape (C,).

    Returns:
        finish_C: seconds until the flows of each class are done (0 for empty classes).
    """
    size = np.asarray(size_C, dtype=float)
    remaining = size.copy()
    finish_C = np.zeros(size.shape)
    active = remaining > 0
    now = 0.0
    while active.any():
        rate_C = max_min_rates(capacity_L, usage_LC, active)
        with np.errstate(divide="ignore", invalid="ignore"):
            left_s = np.where(active, remaining / rate_C, np.inf)
        dt = float(np.min(left_s))
        now += dt
        remaining = np.where(active, remaining - rate_C * dt, remaining)
        done = active & ((left_s <= dt * (1 + 1e-9)) | (remaining <= _REL_TOL * size))
        finish_C[done] = now
        remaining[done] = 0.0
        active &= ~done
    return finish_C
