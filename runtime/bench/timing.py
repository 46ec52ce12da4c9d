"""Timing of one operation on a device: the median wall time over repeated runs, with the
device synchronised around each (runtime/bench/profile.py, runtime/bench/comm_bench.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn` over `iters` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
