"""Measured efficiency tables: lookup by name and interpolation by size.

Table names (written by `piper profile`, read here; nothing else is agreed):
    gemm_<dtype>       x = tokens (rows M) of one GEMM at the model's K/N, y = achieved TFLOPS
    attention_<dtype>  x = sequence length, y = achieved TFLOPS
    a2a_<level>        x = bytes sent per rank, y = GB/s per rank (bytes per rank / time)
    p2p_<level>        x = message bytes, y = GB/s
Interpolation is linear in log(x) and clamps at both ends (no extrapolation).
"""

from __future__ import annotations

import bisect
import math

from planner.specs import ClusterSpec, EfficiencyTable


def interpolate(table: EfficiencyTable, x: float) -> float:
    """y at `x`, linear in log(x) between the two neighbouring points, clamped at the ends."""
    xs, ys = table.x, table.y
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    hi = bisect.bisect_right(xs, x)
    lo = hi - 1
    t = (math.log(x) - math.log(xs[lo])) / (math.log(xs[hi]) - math.log(xs[lo]))
    return ys[lo] + t * (ys[hi] - ys[lo])


def lookup(cluster: ClusterSpec, name: str, x: float) -> float | None:
    """Interpolated value of table `name` at `x`, or None when the cluster has no such table."""
    table = cluster.table(name)
    return None if table is None else interpolate(table, x)
