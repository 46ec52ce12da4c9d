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

from dataclasses import dataclass

import numpy as np

from planner.migration.trace import Trace
from planner.specs import SpecError

_CHUNK_TOKENS = 4096  # tokens sampled per Gumbel block; bounds memory to CHUNK x E floats


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
        if self.top_k > self.experts:
            raise SpecError(
                f"trace synth: --topk {self.top_k} exceeds --experts {self.experts}; "
                f"a token picks distinct experts"
            )
        if self.skew < 0 or self.drift < 0:
            raise SpecError("trace synth: --skew and --drift must be >= 0")
        if not (0 <= self.shift_prob <= 1 and 0 <= self.revert <= 1):
            raise SpecError("trace synth: --shift-prob and --revert must be in [0, 1]")


def _topk_counts(logits_E: np.ndarray, tokens: int, top_k: int, rng: np.random.Generator):
    """Count picks of `tokens` tokens each choosing top_k distinct experts.

    Successive sampling: each token draws candidates with probabilities softmax(logits) and
    keeps the first top_k distinct ones, which is exactly sampling without replacement
    (Plackett-Luce). Tokens that drew too few distinct candidates fall back to Gumbel top-k.
    """
    num_e = logits_E.shape[0]
    p_E = np.exp(logits_E - logits_E.max())
    p_E /= p_E.sum()
    cdf_E = np.cumsum(p_E)
    cdf_E[-1] = 1.0
    counts_E = np.zeros(num_e, dtype=np.int64)
    draws = 2 * top_k
    done = 0
    while done < tokens:
        n = min(_CHUNK_TOKENS, tokens - done)
        cand_NM = np.searchsorted(cdf_E, rng.random((n, draws)), side="right")
        cand_NM = np.minimum(cand_NM, num_e - 1)
        dup_NM = (cand_NM[:, :, None] == cand_NM[:, None, :]) & np.tri(draws, k=-1, dtype=bool)
        keep_NM = ~dup_NM.any(axis=2)
        keep_NM &= np.cumsum(keep_NM, axis=1) <= top_k
        short = keep_NM.sum(axis=1) < top_k
        counts_E += np.bincount(cand_NM[keep_NM & ~short[:, None]], minlength=num_e)
        if short.any():
            keys = logits_E[None, :] + rng.gumbel(size=(int(short.sum()), num_e))
            picks = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
            counts_E += np.bincount(picks.ravel(), minlength=num_e)
        done += n
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
