"""What `piper run --scale F` shrinks, so a plan for a large model runs on a small machine.

What `--scale F` (0 < F < 1) changes, and what it keeps:
- kept: pp, dp, tp, ep, edp, the number of experts (so experts per rank), top-k, gating,
  shared experts, the expert placement of every kept MoE layer, the rank -> node layout.
- widths: hidden size, head dim, every FFN width (dense, routed, shared) are multiplied by F
  and rounded to a multiple of 8 (at least 8); key/value heads by F (at least 1) with the
  query/kv head ratio kept; MLA becomes GQA of the same (scaled) head count; attention sinks
  are kept and a sliding window shrinks by F (at least 1 token).
- depth: stage s keeps max(1, round(n_s * F)) of its n_s layers, evenly spaced from its first
  layer, and at least one MoE layer if it had one, so stage boundaries stay in proportion.
- sequence length: max(16, round(seq_len * F)); micro-batches per step: max(pp, round(m * F));
  the micro-batch size is kept. Vocabulary becomes 256 (the data is bytes).
F = 1 runs the plan as is (the vocabulary must then hold 256 byte ids).
Sequence length, micro-batches and vocabulary are set where the RunSpec is built
(planner.run.spec.run_spec_from_plan).
"""

from __future__ import annotations

from dataclasses import replace

from planner.specs import AttentionSpec, LayerSpec, ModelSpec


def scale_width(x: int, factor: float) -> int:
    """A width (hidden size, FFN width) times `factor`, rounded to a multiple of 8, at least 8;
    0 (absent) stays 0 and factor >= 1 keeps it."""
    if x <= 0 or factor >= 1.0:
        return x
    return max(8, int(round(x * factor / 8.0)) * 8)


def scale_attention(att: AttentionSpec, factor: float, tp: int = 1) -> AttentionSpec:
    """Shrink one attention block; MLA becomes GQA with the same head count (see module doc).
    Shrunk key/value heads stay a multiple of tp, so tensor parallelism can split them.
    factor >= 1 keeps the block as it is (MLA, sinks, sliding window)."""
    if factor >= 1.0:
        return att
    head_dim = att.head_dim or (att.qk_nope_head_dim + att.qk_rope_head_dim)
    kv = att.num_kv_heads if att.kind != "mla" else att.num_heads
    group = max(1, att.num_heads // max(1, kv))
    if factor < 1.0:
        head_dim = max(8, 2 * int(round(head_dim * factor / 2.0)))
        kv = tp * max(1, int(round(kv * factor / tp)))
    kind = "gqa" if att.kind == "mla" else att.kind
    return AttentionSpec(
        kind=kind,
        num_heads=kv * group,
        num_kv_heads=kv,
        head_dim=head_dim,
        bias=att.bias,
        o_bias=att.o_bias,
        qk_norm=att.qk_norm,
        sinks=att.sinks,
        sliding_window=None
        if att.sliding_window is None
        else max(1, int(round(att.sliding_window * factor))),
    )


def scale_layer(layer: LayerSpec, factor: float, tp: int = 1) -> LayerSpec:
    """One layer with its attention and every FFN width (dense, routed, shared) shrunk."""
    moe = layer.moe
    if moe is not None:
        moe = replace(
            moe,
            expert_ffn=scale_width(moe.expert_ffn, factor),
            shared_ffn=scale_width(moe.shared_ffn, factor),
        )
    return replace(
        layer,
        attention=scale_attention(layer.attention, factor, tp),
        dense_ffn=scale_width(layer.dense_ffn, factor),
        moe=moe,
    )


def keep_layers(
    stage_layers: list[tuple[int, ...]], model: ModelSpec, factor: float
) -> list[tuple[int, ...]]:
    """Plan layer indices kept per stage: evenly spaced, at least one MoE layer if any."""
    kept = []
    for layers in stage_layers:
        n = len(layers)
        n_new = n if factor >= 1.0 else max(1, int(round(n * factor)))
        pick = [layers[(i * n) // n_new] for i in range(n_new)]
        moe = [i for i in layers if model.layers[i].kind == "moe"]
        if moe and not any(model.layers[i].kind == "moe" for i in pick):
            pick[-1] = moe[-1]
        kept.append(tuple(pick))
    return kept
