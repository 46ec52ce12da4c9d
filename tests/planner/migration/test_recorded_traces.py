"""The traces recorded by piper run (profiles/traces/): each is what its README says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner.migration.placement import default_rank_of_expert, initial_slots, rank_loads
from planner.migration.trace import interval_trace, load_trace

TRACES = Path(__file__).resolve().parents[3] / "profiles" / "traces"
# setting: (experts, layer ids, steps, tokens per step x top-k, EP, steps per interval)
SETTINGS = {
    "olmoe-64e": (64, (0, 8), 600, 1024 * 8, 8, 10),
    "tiny-256e": (256, (1, 2), 400, 4096 * 8, 64, 20),
}
SEEDS = ("", "-seed1", "-seed2")


def _trace(setting: str, bias: str, seed: str):
    """The run's per-step trace (one row per step)."""
    return load_trace(TRACES / f"{setting}-{bias}{seed}.csv.gz")


def _mean_imbalance(trace, ranks: int) -> float:
    """Realized max / mean rank load without migration, over every interval and layer."""
    slots_RS = initial_slots(default_rank_of_expert(trace.num_experts, ranks), ranks)
    imb = [
        rank_loads(slots_RS, load_E).max() * ranks / load_E.sum()
        for load_E in trace.tokens_ILE.reshape(-1, trace.num_experts)
    ]
    return float(np.mean(imb))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("bias", ["bias0", "bias1e-3"])
def test_each_seed_has_the_shape_and_token_count_of_its_run(setting, bias):
    experts, layers, steps, per_step, _, _ = SETTINGS[setting]
    traces = [_trace(setting, bias, seed) for seed in SEEDS]
    for trace in traces:
        assert trace.num_experts == experts and trace.layer_ids == layers
        assert trace.num_intervals == steps
        # every token of every step picks top-k experts: each step sums exactly
        assert (trace.tokens_ILE.sum(axis=2) == per_step).all()
    for a, b in zip(traces, traces[1:], strict=False):  # the seeds are different runs
        assert not np.array_equal(a.tokens_ILE, b.tokens_ILE)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("seed", SEEDS)
def test_the_router_bias_keeps_loads_nearer_balance(setting, seed):
    """Aux-loss-free balancing (rate 1e-3) against none: lower imbalance in every run."""
    ranks, k = SETTINGS[setting][4:]
    off = _mean_imbalance(interval_trace(_trace(setting, "bias0", seed), k), ranks)
    on = _mean_imbalance(interval_trace(_trace(setting, "bias1e-3", seed), k), ranks)
    assert on < off
    assert on < 1.8
