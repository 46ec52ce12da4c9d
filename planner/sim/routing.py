"""Routing model for HALO-dedup: how many scale-up domains one token's top-k copies reach.

Uniform random routing: each token picks k distinct experts out of E uniformly; experts are
spread evenly, e = E / Q per domain over Q domains. A domain receives the token at least
once with probability p = 1 - C(E - e, k) / C(E, k) (hypergeometric: none of its e experts
among the k picks). Flat all-to-all and plain HALO send every copy, k (Q - 1) / Q copies per
token to remote domains on average; HALO-dedup sends one per remote domain hit,
(Q - 1) p. Their ratio, Q p / k, scales the bytes HALO-dedup puts on the network.
"""

from __future__ import annotations

from math import comb

from planner.specs import SpecError


def _check(experts: int, domains: int, topk: int) -> None:
    if topk < 1 or topk > experts:
        raise SpecError(f"--topk {topk}: must be between 1 and the number of experts ({experts})")
    if domains < 1 or experts % domains:
        raise SpecError(
            f"--experts {experts}: must be a multiple of the {domains} scale-up domains so "
            "experts spread evenly"
        )


def domain_hit_probability(experts: int, domains: int, topk: int) -> float:
    """p: probability that a given domain holds at least one of a token's top-k experts."""
    _check(experts, domains, topk)
    per_domain = experts // domains
    return 1.0 - comb(experts - per_domain, topk) / comb(experts, topk)


def expected_distinct_domains(experts: int, domains: int, topk: int) -> float:
    """Expected number of distinct domains a token's top-k copies land in (Q p)."""
    return domains * domain_hit_probability(experts, domains, topk)


def dedup_ratio(experts: int, domains: int, topk: int) -> float:
    """Remote bytes of HALO-dedup over remote bytes without dedup (Q p / k, in (0, 1]).

    1.0 for a single domain (nothing goes remote) and for top-1 routing.
    """
    if domains == 1:
        _check(experts, domains, topk)
        return 1.0
    return expected_distinct_domains(experts, domains, topk) / topk
