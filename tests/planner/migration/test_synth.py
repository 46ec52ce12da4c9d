"""Synthetic traces: shape, top-k distinct picks, Plackett-Luce probabilities, determinism."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from planner.cli import main
from planner.migration.synth import SynthOptions, _topk_counts, synth_trace
from planner.migration.trace import load_trace
from planner.specs import SpecError


def _inclusion_brute_force(p_E: np.ndarray, k: int) -> np.ndarray:
    """P(expert in a token's k picks) under sequential sampling without replacement."""
    out = np.zeros(len(p_E))
    for order in itertools.permutations(range(len(p_E)), k):
        prob, left = 1.0, 1.0
        for e in order:
            prob *= p_E[e] / left
            left -= p_E[e]
        out[list(order)] += prob
    return out


def test_topk_counts_match_plackett_luce_inclusion():
    logits_E = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    tokens = 200_000
    counts = _topk_counts(logits_E, tokens, 2, np.random.default_rng(0))
    expected = _inclusion_brute_force(np.exp(logits_E), 2) * tokens
    assert counts.sum() == 2 * tokens
    # binomial standard error is at most sqrt(tokens / 4) ~ 224 tokens; allow 5 of them
    assert np.abs(counts - expected).max() < 5 * np.sqrt(tokens / 4)


def test_picks_are_distinct_per_token_even_when_one_expert_dominates():
    logits_E = np.array([20.0, 0.0, 0.0, 0.0, 0.0])  # the hot expert gets every token once
    counts = _topk_counts(logits_E, 1000, 3, np.random.default_rng(1))
    assert counts[0] == 1000 and counts.sum() == 3000


def test_trace_shape_totals_and_determinism():
    opts = SynthOptions(layers=2, experts=16, intervals=5, tokens=500, top_k=4, seed=3)
    a, b = synth_trace(opts), synth_trace(opts)
    assert a.tokens_ILE.shape == (5, 2, 16)
    assert (a.tokens_ILE.sum(axis=2) == 500 * 4).all()
    assert (a.tokens_ILE <= 500).all()
    assert np.array_equal(a.tokens_ILE, b.tokens_ILE)
    other = synth_trace(SynthOptions(**{**opts.__dict__, "seed": 4}))
    assert not np.array_equal(a.tokens_ILE, other.tokens_ILE)


def test_skew_makes_the_hot_expert_hotter():
    flat = synth_trace(SynthOptions(layers=1, experts=32, intervals=1, tokens=4000, skew=0.0))
    skewed = synth_trace(SynthOptions(layers=1, experts=32, intervals=1, tokens=4000, skew=1.0))
    assert skewed.tokens_ILE.max() > 2 * flat.tokens_ILE.max()


def test_bad_options():
    with pytest.raises(SpecError, match="--topk 9 exceeds --experts 8"):
        SynthOptions(experts=8, top_k=9)
    with pytest.raises(SpecError, match="positive"):
        SynthOptions(tokens=0)
    for name, flag in (("skew", "skew"), ("drift", "drift"), ("revert", "revert"),
                       ("shift_prob", "shift-prob")):  # fmt: skip
        for bad in (float("nan"), float("inf")):
            with pytest.raises(SpecError, match=f"--{flag} {bad}: give a finite number"):
                SynthOptions(**{name: bad})


def test_cli_writes_a_valid_trace(tmp_path):
    out = tmp_path / "t.csv"
    args = ["trace", "synth", "--layers", "2", "--experts", "8", "--intervals", "3"]
    assert main([*args, "--tokens", "100", "--topk", "2", "--seed", "5", "--out", str(out)]) == 0
    trace = load_trace(out)
    assert trace.tokens_ILE.shape == (3, 2, 8) and (trace.tokens_ILE.sum(axis=2) == 200).all()
