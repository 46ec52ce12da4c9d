"""Flat all-to-all vs HALO vs HALO-dedup on a modeled topology (flow-level simulation).

Every rank sends `bytes_per_rank` in total, spread uniformly over all P ranks (its own
share stays local). The algorithms, for Q scale-up domains of g ranks (P = Q g):
- flat: one message to each of the P - 1 other ranks, B / P bytes each;
- HALO: Phase I, an all-to-all inside the domain (g - 1 messages of B / P); Phase II, one
  message per remote domain to the rail peer (same local index), g B / P bytes, leaving
  through the rank's own NIC; Phase III, after Phase II, the rail peer forwards to each of
  its g - 1 local peers the (Q - 1) B / P bytes it received for them. Phase I runs
  concurrently with Phase II -> III;
- HALO-dedup: HALO whose Phase II bytes are scaled by the dedup ratio (planner.sim.routing).

Time of a phase (a LogGP-style fluid model): messages are posted one after another at the
sender, `overhead_s` each, while posted data drains at the max-min fair fluid rates; the
phase ends when both are done, plus the latency of the slowest level it crosses:
    T = latency + max(m * overhead_s, overhead_s + t_fluid).
HALO posts Phase II before Phase I; Phase III starts when Phase II has arrived and the
sender has posted Phases I and II, and is simulated on its own.

Shape letters: L = link kinds, C = flow classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from planner.sim.fluid import fluid_finish_times
from planner.sim.network import SimNetwork

Algo = Literal["flat", "halo", "halo-dedup"]
ALGOS: tuple[str, ...] = ("flat", "halo", "halo-dedup")


@dataclass(frozen=True)
class FlowClass:
    """Identical flows: every device sends `flows_per_device` of them across level `level`."""

    phase: str  # "a2a" (flat), "I", "II", "III"
    level: int  # index into SimNetwork.levels
    flows_per_device: float
    bytes_per_flow: float


@dataclass(frozen=True)
class PhaseTiming:
    name: str
    messages_per_rank: float
    bytes_per_message: float  # mean over the phase's messages
    fluid_s: float  # data transfer alone, all messages posted at once
    end_s: float  # when the phase ends, from the start of the all-to-all


def flow_classes(net: SimNetwork, algo: str, bytes_per_rank: float, ratio: float = 1.0):
    """The flow classes of one all-to-all; `ratio` scales HALO-dedup's Phase II bytes."""
    p, g, q = net.ranks, net.domain_ranks, net.domains
    share = bytes_per_rank / p
    out: list[FlowClass] = []
    for v, peers in net.crossing_levels():
        scale_up = net.levels[v].scale_up
        if algo == "flat":
            out.append(FlowClass("a2a", v, peers, share))
        elif scale_up:
            out.append(FlowClass("I", v, peers, share))
            if q > 1:
                out.append(FlowClass("III", v, peers, (q - 1) * share))
        else:
            out.append(FlowClass("II", v, peers / g, g * share * ratio))
    return out


def _fluid(net: SimNetwork, classes: list[FlowClass]) -> np.ndarray:
    kinds = net.link_kinds()
    index = {k.name: i for i, k in enumerate(kinds)}
    usage_LC = np.zeros((len(kinds), len(classes)))
    for c, fc in enumerate(classes):
        for name, flows in net.usage(fc.level, fc.flows_per_device).items():
            usage_LC[index[name], c] = flows
    capacity_L = np.array([k.capacity_bytes_s for k in kinds])
    size_C = np.array([fc.bytes_per_flow for fc in classes])
    return fluid_finish_times(capacity_L, usage_LC, size_C)


def _phase(net, classes, finish_C, name, posted_before, overhead_s, start_s) -> PhaseTiming:
    sel = [c for c, fc in enumerate(classes) if fc.phase == name]
    msgs = sum(classes[c].flows_per_device for c in sel)
    if not sel or msgs == 0:
        return PhaseTiming(name, 0.0, 0.0, 0.0, start_s)
    fluid_s = max(float(finish_C[c]) for c in sel)
    latency_s = max(net.levels[classes[c].level].latency_s for c in sel)
    volume = sum(classes[c].flows_per_device * classes[c].bytes_per_flow for c in sel)
    post_s = (posted_before + msgs) * overhead_s
    end = start_s + latency_s + max(post_s, overhead_s + fluid_s)
    return PhaseTiming(name, msgs, volume / msgs, fluid_s, end)


def phase_timings(
    net: SimNetwork, algo: str, bytes_per_rank: float, overhead_s: float, ratio: float = 1.0
) -> tuple[list[FlowClass], tuple[PhaseTiming, ...]]:
    """Flow classes and phase timings of one all-to-all (see the module docstring)."""
    classes = flow_classes(net, algo, bytes_per_rank, ratio)
    if algo == "flat":
        finish = _fluid(net, classes)
        return classes, (_phase(net, classes, finish, "a2a", 0, overhead_s, 0.0),)
    concurrent = [fc for fc in classes if fc.phase in ("I", "II")]
    finish = _fluid(net, concurrent)
    p2 = _phase(net, concurrent, finish, "II", 0, overhead_s, 0.0)
    p1 = _phase(net, concurrent, finish, "I", p2.messages_per_rank, overhead_s, 0.0)
    third = [fc for fc in classes if fc.phase == "III"]
    # one sender posts every phase: Phase III's posts wait for Phase II's and Phase I's
    posted_s = (p1.messages_per_rank + p2.messages_per_rank) * overhead_s
    p3 = _phase(net, third, _fluid(net, third), "III", 0, overhead_s, max(p2.end_s, posted_s))
    return classes, (p1, p2, p3)
