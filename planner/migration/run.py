"""The interval loop: replay a trace under each policy and measure what it realizes.

For interval t = 1..I-1 and each layer, a policy sees the loads of intervals < t only and
returns the placement in force during t; interval 0 runs the initial placement. Realized
imbalance is max rank load / mean rank load on the interval's ACTUAL loads. Costs:
transfer seconds of the moves (each move serialized, a conservative bound) and the expert
compute of the hottest rank, imbalance x balanced seconds (pricing.py).

Shape letters: I intervals, L trace layers, R ranks, S slots, E experts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from planner.migration.placement import Move, diff_moves, imbalance
from planner.migration.policies import POLICY_FNS, LayerCosts, MigrationOptions
from planner.migration.pricing import MoveCosts
from planner.migration.trace import Trace, interval_trace


@dataclass(frozen=True, eq=False)
class PolicyRun:
    """One policy replayed over a trace.

    slots_ILRS: placement in force per interval and layer.
    moves: (interval, Move) for every expert copy made before that interval.
    imbalance_IL: realized max/mean rank load.
    compute_s_IL: hottest-rank expert compute seconds over the interval.
    solve_s_IL: wall-clock seconds of each decision (0 for interval 0); not deterministic.
    """

    name: str
    slots_ILRS: np.ndarray
    moves: tuple[tuple[int, Move], ...]
    imbalance_IL: np.ndarray
    compute_s_IL: np.ndarray
    solve_s_IL: np.ndarray

    def _scored(self) -> np.ndarray:
        """Realized imbalances of the intervals a policy decided (all if only one)."""
        return self.imbalance_IL[1:] if len(self.imbalance_IL) > 1 else self.imbalance_IL

    @property
    def mean_imbalance(self) -> float:
        return float(self._scored().mean())

    @property
    def p95_imbalance(self) -> float:
        return float(np.percentile(self._scored(), 95))

    @property
    def experts_moved(self) -> int:
        return len(self.moves)

    @property
    def bytes_moved(self) -> int:
        return sum(m.bytes for _, m in self.moves)

    @property
    def transfer_s(self) -> float:
        return float(sum(m.seconds for _, m in self.moves))

    @property
    def total_cost_s(self) -> float:
        """Hottest-rank expert compute over all intervals and layers plus transfer time."""
        return float(self.compute_s_IL.sum()) + self.transfer_s

    @property
    def solve_ms_per_layer(self) -> float:
        """Median wall-clock milliseconds per (interval, layer) decision."""
        decided = self.solve_s_IL[1:]
        return float(np.median(decided) * 1e3) if decided.size else 0.0


def replay(
    trace: Trace,
    initial_LRS: np.ndarray,
    costs: MoveCosts,
    policy: str,
    opts: MigrationOptions | None = None,
    rows_per_interval: int = 1,
) -> PolicyRun:
    """Replay `trace` under one policy from the initial placement (L, R, S).

    rows_per_interval: 1 when each row of the trace is an interval; K when each row is a
    step (`piper run --trace-every 1`) and an interval K steps: every policy then sees the
    steps before the interval it places (opts.rows_per_interval = K), and imbalance is
    measured on each interval's sum.
    Each decision reads the newest opts.history_intervals intervals before it, as the
    runtime's policy does, so the work per interval is bounded and the replay linear in the
    trace's length.
    """
    opts = replace(opts or MigrationOptions(), rows_per_interval=rows_per_interval)
    fn, window = POLICY_FNS[policy], opts.window_rows()
    rows_ILE, k = trace.tokens_ILE, rows_per_interval
    tokens_ILE = interval_trace(trace, k, "rows_per_interval").tokens_ILE
    num_i, num_l, _ = tokens_ILE.shape
    slots_ILRS = np.empty((num_i, *initial_LRS.shape), dtype=np.int64)
    slots_ILRS[0] = initial_LRS
    solve_s_IL = np.zeros((num_i, num_l))
    moves: list[tuple[int, Move]] = []
    for t in range(1, num_i):
        for lj in range(num_l):
            layer_costs = LayerCosts(costs.move_s_LRR[lj], float(costs.balanced_s_L[lj]))
            # the past only, the rows before interval t, in the runtime's window
            history_TE = rows_ILE[max(0, t * k - window) : t * k, lj, :]
            start = time.perf_counter()
            new_RS = fn(slots_ILRS[t - 1, lj], history_TE, layer_costs, opts)
            solve_s_IL[t, lj] = time.perf_counter() - start
            slots_ILRS[t, lj] = new_RS
            step = diff_moves(
                slots_ILRS[t - 1, lj],
                new_RS,
                trace.layer_ids[lj],
                int(costs.expert_bytes_L[lj]),
                costs.move_s_LRR[lj],
            )
            moves.extend((t, m) for m in step)
    imbalance_IL = np.array(
        [
            [imbalance(slots_ILRS[t, lj], tokens_ILE[t, lj]) for lj in range(num_l)]
            for t in range(num_i)
        ]
    )
    compute_s_IL = imbalance_IL * costs.balanced_s_L[None, :]
    return PolicyRun(policy, slots_ILRS, tuple(moves), imbalance_IL, compute_s_IL, solve_s_IL)


def replay_all(
    trace: Trace,
    initial_LRS: np.ndarray,
    costs: MoveCosts,
    policies: Sequence[str],
    opts: MigrationOptions | None = None,
    rows_per_interval: int = 1,
) -> dict[str, PolicyRun]:
    """Replay several policies side by side on the same trace and prices."""
    return {
        name: replay(trace, initial_LRS, costs, name, opts, rows_per_interval) for name in policies
    }
