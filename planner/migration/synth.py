"""Synthetic expert-load traces: skewed popularity that drifts, with occasional regime shifts.

Model, per MoE layer (shape letters: I intervals, L layers, E experts, N tokens):
- popularity logits start Zipf-like: logit of the expert with popularity rank j is
  -skew * log(j + 1), ranks randomly permuted per layer;
- every interval the logits take a Gaussian step of std `drift` and are pulled back toward
  their regime's base by a fraction `revert` (an Ornstein-Uhlenbeck walk: the load-balancing
  loss of real training keeps popularity from diverging);
- with probability `shift_prob` per interval and layer a regime shift re-permutes the base
  (and the current logits with it);
- each of the N tokens picks top_k DISTINCT experts, drawn without replacement with
  probabilities softmax(logits) (Gumbel top-k, exact), and the picks are counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.migration.trace import Trace
from planner.specs import SpecError

_CHUNK_TOKENS = 4096  # tokens sampled per Gumbel block; bounds memory to CHUNK x E floats


# Largest intervals x layers x tokens (the sampling's work, ~1 us each) and intervals x
# layers x experts (the trace's cells) a synthetic trace may have.
MAX_SYNTH_CELLS = 2**26


@dataclass(frozen=True)
class SynthOptions:
    """Knobs of the generator; all counts are per interval and layer."""

    layers: int = 4
    experts: int = 64
    intervals: int = 32
    tokens: int = 8192  # tokens routed per interval and layer (each picks top_k experts)
    top_k: int = 6
    skew: float = 0.5  # Zipf exponent of the initial popularity
    drift: float = 0.15  # std of the per-interval random-walk step of each logit
    revert: float = 0.1  # fraction of the distance to the base logits recovered per interval
    shift_prob: float = 0.05  # chance per interval and layer of a regime shift
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "experts", "intervals", "tokens", "top_k"):
            if getattr(self, name) <= 0:
                raise SpecError(f"trace synth: --{name.replace('_', '')} must be positive")
        if self.seed < 0:
            raise SpecError(f"trace synth: --seed {self.seed}: give a seed >= 0")
        cells = self.intervals * self.layers
        for what, n in (("tokens", self.tokens), ("experts", self.experts)):
            if cells * n > MAX_SYNTH_CELLS:
                raise SpecError(
                    f"trace synth: --intervals {self.intervals} x --layers {self.layers} x "
                    f"--{what} {n} = {cells * n:,} exceeds {MAX_SYNTH_CELLS:,} (about a minute "
                    f"and a GiB); give fewer"
                )
        if self.top_k > self.experts:
            raise SpecError(
                f"trace synth: --topk {self.top_k} exceeds --experts {self.experts}; "
                f"a token picks distinct experts"
            )
        for name in ("skew", "drift", "revert", "shift_prob"):
            if not math.isfinite(getattr(self, name)):
                flag = name.replace("_", "-")
                raise SpecError(
                    f"trace synth: --{flag} {getattr(self, name)}: give a finite number"
                )
        if self.skew < 0 or self.drift < 0:
            raise SpecError("trace synth: --skew and --drift must be >= 0")
        if not (0 <= self.shift_prob <= 1 and 0 <= self.revert <= 1):
            raise SpecError("trace synth: --shift-prob and --revert must be in [0, 1]")


def _first_distinct(cand_NM: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Mask of each row's first top_k distinct candidates, and which rows have top_k of them."""
    draws = cand_NM.shape[1]
    earlier = np.tri(draws, k=-1, dtype=bool)
    dup_NM = ((cand_NM[:, :, None] == cand_NM[:, None, :]) & earlier).any(axis=2)
    keep_NM = ~dup_NM
    keep_NM &= np.cumsum(keep_NM, axis=1) <= top_k
    return keep_NM, keep_NM.sum(axis=1) == top_k


def _topk_counts(logits_E: np.ndarray, tokens: int, top_k: int, rng: np.random.Generator):
    """Count picks of `tokens` tokens each choosing top_k distinct experts.

    Successive sampling: each token draws 2 top_k candidates with probabilities
    softmax(logits) and keeps the first top_k distinct ones, which is exactly sampling
    without replacement (Plackett-Luce). A token short of top_k distinct candidates keeps
    what it has and completes the rest by Gumbel top-k over the experts it lacks, which is
    the exact conditional law of the remaining picks (restarting it would bias the sample).
    """
    num_e = logits_E.shape[0]
    p_E = np.exp(logits_E - logits_E.max())
    cdf_E = np.cumsum(p_E / p_E.sum())
    counts_E = np.zeros(num_e, dtype=np.int64)
    done = 0
    while done < tokens:
        n = min(_CHUNK_TOKENS, tokens - done)
        done += n
        u_NM = rng.random((n, 2 * top_k)) * cdf_E[-1]
        cand_NM = np.minimum(np.searchsorted(cdf_E, u_NM, side="right"), num_e - 1)
        keep_NM, full_N = _first_distinct(cand_NM, top_k)
        counts_E += np.bincount(cand_NM[keep_NM], minlength=num_e)
        short = np.nonzero(~full_N)[0]
        if short.size:
            have_SE = np.zeros((short.size, num_e), dtype=bool)
            rows = np.repeat(np.arange(short.size), 2 * top_k)
            have_SE[rows[keep_NM[short].ravel()], cand_NM[short][keep_NM[short]]] = True
            keys_SE = np.where(have_SE, -np.inf, logits_E + rng.gumbel(size=have_SE.shape))
            order_SE = np.argsort(-keys_SE, axis=1, kind="stable")
            need_S = top_k - have_SE.sum(axis=1)
            take_SE = np.arange(num_e)[None, :] < need_S[:, None]
            counts_E += np.bincount(order_SE[take_SE], minlength=num_e)
    return counts_E


def synth_trace(opts: SynthOptions) -> Trace:
    """Generate a trace with drifting, skewed, top-k multinomial loads (deterministic in seed)."""
    rng = np.random.default_rng(opts.seed)
    zipf_E = -opts.skew * np.log(np.arange(opts.experts) + 1.0)
    base_LE = np.stack([rng.permutation(zipf_E) for _ in range(opts.layers)])
    logits_LE = base_LE.copy()
    tokens_ILE = np.zeros((opts.intervals, opts.layers, opts.experts), dtype=np.int64)
    for t in range(opts.intervals):
        if t > 0:
            step_LE = rng.normal(0.0, opts.drift, size=logits_LE.shape)
            logits_LE = logits_LE + step_LE - opts.revert * (logits_LE - base_LE)
            for lj in np.nonzero(rng.random(opts.layers) < opts.shift_prob)[0]:
                perm_E = rng.permutation(opts.experts)
                base_LE[lj], logits_LE[lj] = base_LE[lj, perm_E], logits_LE[lj, perm_E]
        for lj in range(opts.layers):
            tokens_ILE[t, lj] = _topk_counts(logits_LE[lj], opts.tokens, opts.top_k, rng)
    return Trace(tokens_ILE, tuple(range(opts.layers)), "synthetic")
