"""`piper size`'s inputs (tokens, durations, sizes, the batch rule), flags and Pareto set."""

from __future__ import annotations

import pytest

from planner.plan.schema import Interval
from planner.size.request import (
    SizeRequest,
    batch_at,
    parse_duration_s,
    parse_gpus,
    parse_tokens,
)
from planner.size.rows import SizeRow, flags_of, pareto
from planner.specs import SpecError


@pytest.mark.parametrize(
    "text, tokens",
    [("15T", 15e12), ("14.8T", 14.8e12), ("500B", 500e9), ("2e12", 2e12), ("8.1t", 8.1e12)],
)
def test_tokens(text, tokens):
    assert parse_tokens(text) == pytest.approx(tokens, 1e-12)


@pytest.mark.parametrize("text", ["15Q", "T", "-1T", "0", "1.5.2T", ""])
def test_bad_tokens_name_the_flag_and_the_form(text):
    with pytest.raises(SpecError, match=r"--tokens .*K, M, B or T"):
        parse_tokens(text)


def test_durations():
    assert parse_duration_s("60d") == 60 * 86400
    assert parse_duration_s("12h") == 12 * 3600
    assert parse_duration_s("2w") == 14 * 86400
    with pytest.raises(SpecError, match=r"--deadline '3x'.*s, m, h, d or w"):
        parse_duration_s("3x")


def test_gpu_ranges_and_lists():
    assert parse_gpus("256..16384") == (256, 512, 1024, 2048, 4096, 8192, 16384)
    assert parse_gpus("512,256,512") == (256, 512)
    for bad in ("300..1024", "1024..256", "0,8", "a", "8..", "8,,16"):
        with pytest.raises(SpecError, match="--gpus"):
            parse_gpus(bad)


def test_batch_rules():
    fixed = SizeRequest("m", ("c",), 1e12, global_batch=512)
    assert batch_at(fixed, 4096, 256) == (512, False)
    sqrt = SizeRequest(
        "m", ("c",), 1e12, global_batch=512, batch_rule="sqrt", critical_batch_tokens=4096 * 4096
    )
    assert batch_at(sqrt, 256, 256) == (512, False)
    assert batch_at(sqrt, 1024, 256) == (1024, False)  # sqrt(4) = 2
    assert batch_at(sqrt, 512, 256) == (768, False)  # 724 rounded to 3 significant bits
    assert batch_at(sqrt, 65536, 256) == (4096, True)  # 8192 capped at the critical batch


def _row(cluster, gpus, days=None, cost=None, hours=None, **kw) -> SizeRow:
    iv = lambda x: None if x is None else Interval(x * 0.8, x, x * 1.2)  # noqa: E731
    return SizeRow(
        cluster,
        gpus,
        kw.pop("batch", 1024),
        days=iv(days),
        cost_usd=iv(cost),
        gpu_hours=iv(hours if hours is not None else days),
        **kw,
    )


def test_pareto_set_of_days_vs_cost_on_a_hand_case():
    rows = [
        _row("a", 64, days=10, cost=100),  # on the set
        _row("a", 128, days=5, cost=150),  # on the set: faster, dearer
        _row("a", 256, days=12, cost=120),  # slower and dearer than 64: off
        _row("b", 64, days=5, cost=200),  # as fast as a/128, dearer: off
        _row("b", 128, days=4, cost=400),  # fastest: on
        _row("b", 256),  # no plan: off
    ]
    assert [r.pareto for r in pareto(rows)] == [True, True, False, False, True, False]


def test_pareto_weighs_gpu_hours_when_a_row_has_no_price():
    rows = [_row("a", 64, days=10, cost=100, hours=50), _row("b", 64, days=10, hours=40)]
    assert [r.pareto for r in pareto(rows)] == [False, True]


def test_flags_batch_past_the_rule_capped_and_low_mfu():
    rows = [
        _row("a", 64, days=10, model_parallel=8, mfu=0.3, batch=16),  # dp 8 <= 16
        _row("a", 128, days=6, model_parallel=8, mfu=0.2, batch=16),  # dp 16 <= 16
        _row("a", 256, days=5, model_parallel=32, mfu=0.1, batch=16),  # 32 ranks > 16: batch
        _row("a", 512, batch=16, batch_capped=True),  # no plan, past the rule, capped
    ]
    flags = [r.flags for r in flags_of(rows, 0.15)]
    assert flags == [(), (), ("batch", "mfu"), ("no-plan", "batch", "capped")]
