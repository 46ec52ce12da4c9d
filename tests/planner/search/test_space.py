"""The search space: enumeration against a brute force of the documented rules, fixed knobs,
the all-to-all overlap and context-parallel rules, and the bad-flag messages."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from planner.parallel import divisors
from planner.search import space as sp
from planner.search.enumerate import enumerate_families
from planner.search.space import make_space, sharding_choices
from planner.specs import SpecError
from tests.planner.search.plan_stubs import (
    enumerate_layouts,
    toy_cluster,
    toy_model,
    toy_training,
)

LIGHT = ("layernorm", "moe_act")


def _key(c) -> tuple:
    p, k = c.parallel, c.knobs
    sizes = (p.pp, p.dp, p.tp, p.cp, p.ep, p.etp, p.vp, p.micro_batch, p.num_microbatches)
    return (*sizes, p.recompute, p.recompute_modules, k.sharding, k.a2a_overlap, k.dispatcher)


def _brute(gpus: int, g: int, layers: int, experts: int, heads: int, batch: int) -> set:
    """Every tuple the rules of planner/search/space.py and enumerate.py allow (seq 1024: no
    cp; no MTP)."""
    want = set()
    policies = (("none", ()), ("full", ()), ("selective", LIGHT))
    for pp, tp, dp in itertools.product(range(1, gpus + 1), (1, 2, 4, 8), range(1, gpus + 1)):
        if pp * tp * dp != gpus or pp > layers or tp > g or heads % tp or batch % dp:
            continue
        for etp, ep, mb in itertools.product(divisors(tp), range(1, gpus + 1), range(1, batch + 1)):
            if (tp * dp) % (etp * ep) or experts % ep or (etp > 1 and ep != experts):
                continue
            if (batch // dp) % mb:
                continue
            m = batch // dp // mb
            vps = [1] + [v for v in (2, 4) if pp > 1 and m % pp == 0 and pp * v <= layers]
            dispatchers = ["flat"] if ep == 1 else ["flat", "halo", "halo-dedup", "deepep"]
            if ep * etp <= g and ep > 1:
                dispatchers = ["flat", "deepep"]
            for vp, d, (rc, mods) in itertools.product(vps, dispatchers, policies):
                halo = d.startswith("halo")
                overlap_ok = ep > 1 and not halo and rc != "full" and (pp == 1 or vp > 1)
                for sharding in ("zero", "fsdp") if pp == 1 else ("zero",):
                    for overlap in (False, True) if overlap_ok else (False,):
                        want.add((pp, dp, tp, 1, ep, etp, vp, mb, m, rc, mods, sharding,
                                  overlap, d))  # fmt: skip
    return want


def test_enumeration_equals_a_brute_force_of_the_rules():
    model, cluster, training = toy_model(layers=6, experts=8), toy_cluster(), toy_training()
    got = [_key(c) for c in enumerate_layouts(model, cluster, training, make_space(16))]
    assert len(got) == len(set(got))
    assert set(got) == _brute(16, 4, 6, 8, 8, 32)
    # folded expert meshes are searched: ep up to tp*dp, etp = 2 with ep = experts
    assert any(k[4] == 8 and k[5] == 2 for k in got)


def test_families_start_with_their_fastest_member():
    fams = enumerate_families(toy_model(), toy_cluster(), toy_training(), make_space(16))
    for fam in fams:
        first = fam.members[0]
        assert first.parallel.recompute == "none"
        assert first.knobs.sharding == "zero"
        assert first.knobs.a2a_overlap == any(c.knobs.a2a_overlap for c in fam.members)
        assert len({(c.parallel.pp, c.parallel.vp, c.knobs.dispatcher) for c in fam.members}) == 1
    orders = [f.first_order + i for f in fams for i in range(len(f.members))]
    assert orders == list(range(len(orders)))


def test_fixed_knobs_are_honoured():
    model, cluster, training = toy_model(), toy_cluster(), toy_training()
    space = make_space(
        16,
        {"pp": 2, "vp": 2, "etp": 2, "ep": 4},
        recompute_modules=["moe", "layernorm"],
        sharding=("fsdp",),
        a2a_overlap=False,
        dispatchers=["halo"],
    )
    got = enumerate_layouts(model, cluster, training, space)
    assert got and all(
        (c.parallel.pp, c.parallel.vp, c.parallel.etp, c.parallel.ep) == (2, 2, 2, 4)
        and c.parallel.recompute_modules == ("layernorm", "moe")  # Megatron-Core's order
        and c.knobs == sp.Knobs("fsdp", False, "halo")  # fixed FSDP with pipelining too
        for c in got
    )


def test_a2a_overlap_only_where_megatron_allows_it():
    model, cluster, training = toy_model(), toy_cluster(), toy_training()
    got = enumerate_layouts(model, cluster, training, make_space(16, a2a_overlap=True))
    assert got and all(c.knobs.a2a_overlap for c in got)
    for c in got:
        p = c.parallel
        assert p.ep > 1 and p.recompute != "full" and (p.pp == 1 or p.vp > 1)
        assert c.knobs.dispatcher != "halo"
    ok, why = sp.a2a_overlap_allowed(got[0].parallel, "flat", mtp=2)
    assert not ok and "at most 1 MTP layer" in why
    # Megatron-LM: "Pipeline model parallel size must be larger than 1 when enabling
    # overlap_moe_expert_parallel_comm with MTP layer"
    flat_pp = replace(got[0].parallel, pp=1, vp=1)
    ok, why = sp.a2a_overlap_allowed(flat_pp, "flat", mtp=1)
    assert not ok and "pp > 1" in why
    assert sp.a2a_overlap_allowed(flat_pp, "flat", mtp=0)[0]
    with pytest.raises(SpecError, match="--a2a-overlap"):
        enumerate_layouts(model, cluster, training, make_space(16, {"ep": 1}, a2a_overlap=True))


def test_cp_only_for_long_sequences_and_never_with_mtp():
    model, cluster = toy_model(), toy_cluster()
    short = enumerate_layouts(model, cluster, toy_training(seq_len=8192), make_space(16))
    assert {c.parallel.cp for c in short} == {1}
    long = toy_training(seq_len=32768, global_batch=16)
    cps = {c.parallel.cp for c in enumerate_layouts(model, cluster, long, make_space(16))}
    assert cps == {1, 2, 4}  # each rank keeps >= 8192 tokens
    mtp = toy_training(seq_len=32768, global_batch=16, mtp_layers=1)
    assert {c.parallel.cp for c in enumerate_layouts(model, cluster, mtp, make_space(16))} == {1}
    space = make_space(16)
    assert sp.cp_fallback(space, model, toy_training(seq_len=4096), 4) == (2, 4)
    assert sp.cp_fallback(make_space(16, {"cp": 1}), model, toy_training(), 4) == ()


def test_sharding_flags():
    assert sharding_choices(None, None) == ("zero", "fsdp")
    assert sharding_choices(True, None) == ("zero",)
    assert sharding_choices(None, True) == ("fsdp",)
    assert sharding_choices(False, None) == ("none", "fsdp")
    assert sharding_choices(None, False) == ("zero",)
    assert sharding_choices(False, False) == ("none",)
    with pytest.raises(SpecError, match="give one of them"):
        sharding_choices(True, True)


def test_bad_fixed_values_name_the_flag_and_the_fix():
    model, cluster, training = toy_model(), toy_cluster(), toy_training()
    with pytest.raises(SpecError, match="--pp 3"):
        enumerate_layouts(model, cluster, training, make_space(16, {"pp": 3}))
    with pytest.raises(SpecError, match="--ep 3"):
        enumerate_layouts(model, cluster, training, make_space(16, {"ep": 3}))
    with pytest.raises(SpecError, match="no valid layout"):
        enumerate_layouts(model, cluster, training, make_space(16, {"pp": 2, "dp": 2, "tp": 2}))
    with pytest.raises(SpecError, match="vp > 1: pp > 1"):
        enumerate_layouts(model, cluster, training, make_space(16, {"pp": 1, "vp": 2}))
    with pytest.raises(SpecError, match="--recompute-modules"):
        make_space(16, recompute_modules=["attention"])
    with pytest.raises(SpecError, match="needs --recompute selective"):
        make_space(16, recompute=["full"], recompute_modules=["moe"])
    with pytest.raises(SpecError, match="--dispatcher"):
        make_space(16, dispatchers=["nccl"])
    with pytest.raises(SpecError, match="cannot fix 'bogus'"):
        make_space(16, {"bogus": 2})
