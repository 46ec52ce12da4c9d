"""The straggler term (planner.resources.comm.straggler_s): a collective that crosses the
network waits for its slowest member, network_jitter_us x H_n; zero where nothing crosses the
network or the constant is 0 (the fat-tree and NVL72 presets)."""

from __future__ import annotations

import dataclasses
import random
from fractions import Fraction

import pytest

from planner.inputs.clusters import load_cluster
from planner.resources import comm
from tests.planner.resources.resource_specs import make_cluster


def test_harmonic_numbers_exact_and_asymptotic():
    # exact fractions below the switch to the series, the series past it
    for n in (1, 2, 3, 7, 64):
        assert comm.harmonic(n) == pytest.approx(
            float(sum(Fraction(1, i) for i in range(1, n + 1)))
        )
    for n in (65, 1000, 75264):
        exact = sum(1.0 / i for i in range(1, n + 1))
        assert comm.harmonic(n) == pytest.approx(exact, rel=1e-12)
    assert comm.harmonic(0) == 0.0


def test_expected_maximum_of_exponentials_is_tau_times_harmonic():
    """The oracle behind the term: the mean of the largest of n exponential delays of mean tau
    (Monte Carlo, 20,000 draws) is tau x H_n."""
    rng = random.Random(0)
    tau, n, draws = 1.0, 16, 20000
    mean_max = sum(max(rng.expovariate(1 / tau) for _ in range(n)) for _ in range(draws)) / draws
    assert mean_max == pytest.approx(tau * comm.harmonic(n), rel=0.02)


def test_straggler_by_hand_on_a_tiny_two_level_cluster():
    # node of 4 at 100 GB/s, NICs beyond: tau = 500 us
    cl = dataclasses.replace(make_cluster(gpus_per_node=4, nodes=4), network_jitter_us=500.0)
    assert comm.straggler_s(cl, 4) == 0.0  # one node: no network crossed
    assert comm.straggler_s(cl, 2, stride=2) == 0.0  # devices 0 and 2: still one node
    # 8 ranks on 2 nodes: 500 us x (1 + 1/2 + ... + 1/8) = 500 x 761/280 us
    assert comm.straggler_s(cl, 8) == pytest.approx(500e-6 * 761 / 280)
    # 2 ranks 4 apart (devices 0 and 4): two nodes, H_2 = 3/2
    assert comm.straggler_s(cl, 2, stride=4) == pytest.approx(750e-6)


def test_straggler_joins_the_all_to_all_and_the_ring_collectives():
    base = make_cluster(gpus_per_node=4, nodes=4)
    cl = dataclasses.replace(base, network_jitter_us=500.0)
    B = 1e6
    for algo in ("flat", "halo"):
        t0 = comm.a2a_time_s(base, 8, B, algo)[0]
        t1 = comm.a2a_time_s(cl, 8, B, algo)[0]
        assert t1 - t0 == pytest.approx(500e-6 * 761 / 280)
    ring0 = comm.ring_allreduce_s(base, 4, 4, 1e8)[0]  # devices 0, 4, 8, 12
    ring1 = comm.ring_allreduce_s(cl, 4, 4, 1e8)[0]
    assert ring1 - ring0 == pytest.approx(500e-6 * 25 / 12)
    # inside a node nothing changes
    assert comm.a2a_time_s(cl, 4, B, "flat") == comm.a2a_time_s(base, 4, B, "flat")
    assert comm.ring_allreduce_s(cl, 4, 1, 1e8) == comm.ring_allreduce_s(base, 4, 1, 1e8)


def test_straggler_grows_with_the_group_on_frontier():
    fr = load_cluster("frontier")
    tau = fr.network_jitter_us * 1e-6
    assert tau > 0
    assert comm.straggler_s(fr, 8) == 0.0  # one node (HALO's local domain)
    waits = [comm.straggler_s(fr, n) for n in (16, 128, 256, 1024)]
    assert waits == sorted(waits)
    assert waits[0] == pytest.approx(tau * comm.harmonic(16))
    assert waits[-1] == pytest.approx(tau * comm.harmonic(1024))


@pytest.mark.parametrize("preset", ["h100", "gb200-nvl72"])
def test_inactive_on_the_fat_tree_and_nvl72_presets(preset):
    cl = load_cluster(preset)
    assert cl.network_jitter_us == 0.0
    n = 2 * comm.local_domain_devices(cl)  # two nodes (H100) or two NVL72 racks: network
    assert comm.straggler_s(cl, n) == 0.0
    on = dataclasses.replace(cl, network_jitter_us=1000.0)
    # the group crosses the network, so only the constant keeps the term off
    assert comm.a2a_time_s(cl, n, 1e8, "flat")[0] < comm.a2a_time_s(on, n, 1e8, "flat")[0]


def test_inactive_on_a_single_level_cluster():
    one = make_cluster(gpus_per_node=8, nodes=1)
    one = dataclasses.replace(one, levels=one.levels[:1], num_nodes=1, network_jitter_us=1000.0)
    assert comm.straggler_s(one, 8) == 0.0
    assert comm.a2a_time_s(one, 8, 1e6, "flat")[0] == comm.all_to_all_time_s(one, 8, 1e6, "flat")
