"""What communication hides behind which compute: the exposed part of overlapped collectives.

Three overlaps, each per layer and micro-batch (seconds in, exposed seconds out):
- the 1F1B all-to-all overlap (Megatron-Core `--overlap-moe-expert-parallel-comm`): one
  micro-batch's forward of a layer runs beside another's backward of it, on two streams
  (`megatron/core/models/common/model_chunk_schedule_plan.py`,
  `TransformerLayerSchedulePlan.run`):
      comm:    combine_bwd(B)      | dispatch_fwd(F), dispatch_bwd(B)     | combine_fwd(F)
      compute: pre_dispatch_fwd(F) | mlp_bwd(B), mlp_bwd_dw(B), mlp_fwd(F) | pre_dispatch_bwd(B)
  so the pair takes max(a_f, t) + max(m_b + m_f, 2 t) + max(a_b, t) with t one all-to-all,
  a = attention + router (pre-dispatch), m = experts + shared experts;
- context parallelism's ring (Transformer Engine `AttnFuncWithCPAndKVP2P`: "overlap
  current-step compute with next-step communication"): cp - 1 steps each way, each step's
  K/V send (backward: K/V with their gradients, twice the bytes) beside 1/cp of the
  attention compute;
- FSDP's prefetch (Megatron-FSDP, `docs/user-guide/features/megatron_fsdp.md`): a layer's
  weights are all-gathered during the previous layer's forward, again before its backward,
  and its gradients reduce-scattered during the next layer's backward;
- the data-parallel gradient reduction of the last micro-batch (Megatron-Core DDP with
  `--overlap-grad-reduce`, `megatron/core/distributed/param_and_grad_buffer.py`
  `register_grad_ready`: a bucket's reduce-scatter / all-reduce is launched as soon as the
  last micro-batch's backward has produced all of its gradients, on one communication
  stream), so only what is still queued when the backward ends is exposed.
"""

from __future__ import annotations


def imperfect_s(shown_s: float, total_s: float, efficiency: float) -> float:
    """Exposed seconds when only `efficiency` of the ideally hidden part (total - shown)
    really hides (`ClusterSpec.overlap_efficiency`): shown + (1 - efficiency) x hidden."""
    return shown_s + (1.0 - efficiency) * max(total_s - shown_s, 0.0)


def paired_a2a_exposed_s(
    attn_fwd_s: float, attn_bwd_s: float, mlp_fwd_s: float, mlp_bwd_s: float, a2a_s: float
) -> float:
    """Exposed all-to-all time of one layer in a steady-phase forward/backward pair:
    max(a_f, t) + max(m_b + m_f, 2 t) + max(a_b, t) - (a_f + a_b + m_f + m_b)."""
    pair = max(attn_fwd_s, a2a_s) + max(mlp_bwd_s + mlp_fwd_s, 2 * a2a_s)
    pair += max(attn_bwd_s, a2a_s)
    return pair - (attn_fwd_s + attn_bwd_s + mlp_fwd_s + mlp_bwd_s)


def ring_attention_exposed_s(
    cp: int, kv_step_s: float, attn_fwd_s: float, attn_bwd_s: float
) -> tuple[float, float]:
    """(exposed, forward-exposed) seconds of the cp ring of one attention layer: per step
    max(0, t_kv - a_f / cp) forward and max(0, 2 t_kv - a_b / cp) backward, cp - 1 steps."""
    steps = cp - 1
    fwd = steps * max(0.0, kv_step_s - attn_fwd_s / cp)
    bwd = steps * max(0.0, 2 * kv_step_s - attn_bwd_s / cp)
    return fwd + bwd, fwd


def prefetch_exposed_s(gather_s: float, reduce_s: float, fwd_s: float, bwd_s: float) -> float:
    """Exposed FSDP seconds of one unit: max(0, AG - forward) + max(0, AG + RS - backward)."""
    return max(0.0, gather_s - fwd_s) + max(0.0, gather_s + reduce_s - bwd_s)


def queued_reduce_exposed_s(units: list[tuple[float, float]]) -> float:
    """Exposed seconds of reductions queued on one stream after the backward ends at t = 0.

    units: (seconds, ready time <= 0 relative to the end of the backward) per bucket or
    chunk; each starts at max(its ready time, the end of the one before it, in ready order):
        end_j = max(ready_j, end_(j-1)) + seconds_j;  exposed = max(0, end_last).
    """
    end = float("-inf")
    for seconds, ready in sorted(units, key=lambda u: u[1]):
        end = max(ready, end) + seconds
    return max(0.0, end) if units else 0.0
