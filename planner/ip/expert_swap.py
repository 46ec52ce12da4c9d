"""Warm starts for the expert IP: LPT with replicas, EPLB's replicate-then-pack, and swaps
between nodes while traffic pays.

`lpt_with_replicas`: hottest expert first onto the least-loaded rank with a free base slot;
then each redundant slot takes a replica of an expert of the hottest rank. `improve_by_swaps`:
starting from the LPT placement, try swapping two experts held by ranks on different nodes
(slot counts stay equal) and keep a swap when it strictly lowers the expert IP's objective in
its integer units: hottest rank's load minus the co-located pair weights (FORMULATION.md 2).
Deterministic: candidates in index order, first improvement taken, a fixed evaluation budget.

Shape letters: E = experts, R = ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_EVALS = 60_000  # swap evaluations before the search stops (about a second)


def improve_by_swaps(
    held: dict[int, list[int]],
    load_q: Sequence[int],
    node_of_rank: Sequence[int],
    pair_weight: dict[tuple[int, int], int],
    max_evals: int = MAX_EVALS,
) -> dict[int, list[int]]:
    """Local search on `held` (rank -> experts, one replica each).

    Args:
        held: the starting placement; not modified.
        load_q: E integer loads.
        node_of_rank: R node ids.
        pair_weight: (e, e2) with e < e2 -> integer saving when both sit on one node.
        max_evals: budget of swap evaluations.
    Returns:
        A placement with objective <= the start's.
    """
    rank_of = {e: r for r, experts in held.items() for e in experts}
    loads = {r: sum(load_q[e] for e in experts) for r, experts in held.items()}
    nbr: dict[int, list[tuple[int, int]]] = {e: [] for e in rank_of}
    for (e, f), w in pair_weight.items():
        nbr[e].append((f, w))
        nbr[f].append((e, w))
    top = _top3(loads)
    evals, improved = 0, True
    while improved and evals < max_evals:
        improved = False
        for e in sorted(rank_of):
            for f in sorted(rank_of):
                a, b = rank_of[e], rank_of[f]
                if f <= e or node_of_rank[a] == node_of_rank[b]:
                    continue
                evals += 1
                if _gain(e, f, a, b, loads, top, load_q, rank_of, node_of_rank, nbr) > 0:
                    loads[a] += load_q[f] - load_q[e]
                    loads[b] += load_q[e] - load_q[f]
                    rank_of[e], rank_of[f] = b, a
                    top = _top3(loads)
                    improved = True
                if evals >= max_evals:
                    break
            if evals >= max_evals:
                break
    out: dict[int, list[int]] = {r: [] for r in held}
    for e in sorted(rank_of):
        out[rank_of[e]].append(e)
    return out


def lpt_with_replicas(
    load_E: Sequence[float], slots_R: Sequence[int], redundant_slots: int, max_replicas: int
) -> dict[int, list[int]]:
    """LPT placement (rank -> experts) with `redundant_slots` replicas on top.

    Each redundant slot takes a replica of the expert of the hottest rank whose split
    relieves that rank most, on the least-loaded rank with a free slot that lacks it (the
    hottest rank chosen among ties by having a free slot). With equal loads this pairs up
    the ranks with a redundant slot, each pair sharing two experts, so every rank carries
    the mean load. Rank r ends with slots_R[r] experts unless no replica fits anywhere.
    """
    num_e, ep = len(load_E), len(slots_R)
    base = num_e // ep
    loads, held = [0.0] * ep, {r: [] for r in range(ep)}
    order = sorted(range(num_e), key=lambda e: (-load_E[e], e))
    for e in order:
        r = min((r for r in range(ep) if len(held[r]) < base), key=lambda r: (loads[r], r))
        held[r].append(e)
        loads[r] += load_E[e]
    copies = {e: 1 for e in range(num_e)}
    for _ in range(redundant_slots):
        if not _add_replica(load_E, slots_R, max_replicas, held, copies):
            break
    return held


def replicate_then_pack(
    load_E: Sequence[float], slots_R: Sequence[int], redundant_slots: int, max_replicas: int
) -> dict[int, list[int]] | None:
    """EPLB's two steps (deepseek-ai/EPLB eplb.py: `replicate_experts`, then
    `balanced_packing`; planner/migration/replicate.py is the same rule for migration):
    each redundant slot goes to the expert with the highest load per replica (at most
    max_replicas copies), then the replicas, heaviest share first (ties: lower expert id),
    go to the least-loaded rank with a free slot that lacks that expert (ties: lower rank).
    None when the distinct-rank rule leaves a replica nowhere to go."""
    num_e, ep = len(load_E), len(slots_R)
    count = [1] * num_e
    for _ in range(redundant_slots):
        open_e = [e for e in range(num_e) if count[e] < max_replicas]
        if not open_e:
            break
        count[max(open_e, key=lambda e: (load_E[e] / count[e], -e))] += 1
    pieces = sorted(((e, load_E[e] / count[e]) for e in range(num_e) for _ in range(count[e])),
                    key=lambda p: (-p[1], p[0]))  # fmt: skip
    held: dict[int, list[int]] = {r: [] for r in range(ep)}
    loads = [0.0] * ep
    for e, share in pieces:
        free = [r for r in range(ep) if len(held[r]) < slots_R[r] and e not in held[r]]
        if not free:
            return None
        r = min(free, key=lambda r: (loads[r], r))
        held[r].append(e)
        loads[r] += share
    return held


def _add_replica(load_E, slots_R, max_replicas, held, copies) -> bool:
    """One replica (see lpt_with_replicas); False when no rank has room for any expert."""
    share = [load_E[e] / copies[e] for e in range(len(load_E))]
    load = {r: sum(share[e] for e in held[r]) for r in held}
    free = [r for r in held if len(held[r]) < slots_R[r]]
    for h in sorted(held, key=lambda r: (-load[r], r not in free, r)):
        gains = sorted(
            (e for e in held[h] if copies[e] < max_replicas),
            key=lambda e: (-(share[e] - load_E[e] / (copies[e] + 1)), e),
        )
        for e in gains:
            dest = [r for r in free if e not in held[r]]
            if dest:
                held[min(dest, key=lambda r: (load[r], r))].append(e)
                copies[e] += 1
                return True
    return False


def _top3(loads: dict[int, int]) -> list[tuple[int, int]]:
    """The three hottest (load, rank), hottest first."""
    return sorted(((v, r) for r, v in loads.items()), key=lambda t: (-t[0], t[1]))[:3]


def _gain(e, f, a, b, loads, top, load_q, rank_of, node_of_rank, nbr) -> int:
    """Objective decrease (integer units) of swapping expert e (rank a) with f (rank b)."""
    delta = load_q[f] - load_q[e]
    new_a, new_b = loads[a] + delta, loads[b] - delta
    old_max = top[0][0]
    others = next((v for v, r in top if r not in (a, b)), 0)
    new_max = max(others, new_a, new_b)
    na, nb = node_of_rank[a], node_of_rank[b]
    together = 0
    for x, old_node, new_node, partner in ((e, na, nb, f), (f, nb, na, e)):
        for g, w in nbr[x]:
            if g == partner:
                continue  # the pair (e, f) stays split across the two nodes
            node_g = node_of_rank[rank_of[g]]
            together += w * ((node_g == new_node) - (node_g == old_node))
    return (old_max - new_max) + together
