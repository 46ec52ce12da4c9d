"""Fine-grained activation offloading: submodule inputs kept in host memory between forward
and backward.

Megatron-Core's --fine-grained-activation-offloading --offload-modules M...
(`docs/user-guide/features/fine_grained_activation_offloading.md`): each named submodule's
INPUT goes to the host during forward and is reloaded before its backward. Against the
activation components of planner.resources.memory (what the layer keeps after recompute and
low-precision saving), each module removes:

| module | its input | component, bytes removed |
|---|---|---|
| attn_norm | the layer input | attn_norm: up to a T d (the norm's input half) |
| qkv_linear | the attention norm's output | attn_norm: what is kept beyond a T d |
| core_attn | q, k, v | qkv: all but MLA's latents (a T latent) |
| attn_proj | the attention context | context: all |
| mlp_norm | the MLP norm's input | mlp_norm: up to a T d |
| expert_fc1 | the routed copies | dispatch: all |
| moe_act | the fc1 outputs (gate, up) | experts: up to (mats - 1) / mats of the layer's full term |

While a layer runs, its offloaded inputs are on the device (the forward's copy out, the
backward's reload ahead of use): the stage reserves one layer's offloaded bytes as the
`activation_offload` workspace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.specs import LayerSpec, TrainingSpec


def offload_modules(training: TrainingSpec) -> tuple[str, ...]:
    """The module names of training.activation_offload_modules."""
    return tuple(n for n in training.activation_offload_modules.split(",") if n)


def offloaded(
    layer: LayerSpec,
    training: TrainingSpec,
    parts: Sequence[tuple[str, float]],
    full: Mapping[str, float],
    bytes_per_token_elem: float,
    hidden: int,
) -> dict[str, float]:
    """Bytes each component sends to the host (table above).

    Args:
        parts: the layer's kept components (name, bytes) after recompute and FP8 saving.
        full: the layer's components without recompute (for the expert intermediates' split).
        bytes_per_token_elem: a T, one element per token of the rank (bytes).
        hidden: d.
    """
    modules = set(offload_modules(training))
    norm_bytes = bytes_per_token_elem * hidden
    kept = dict(parts)
    out: dict[str, float] = {}

    def move(name: str, nbytes: float) -> None:
        if name in kept and nbytes > 0:
            out[name] = out.get(name, 0.0) + min(nbytes, kept[name] - out.get(name, 0.0))

    att, moe = layer.attention, layer.moe
    if "attn_norm" in modules:
        move("attn_norm", norm_bytes)
    if "qkv_linear" in modules:
        move("attn_norm", kept.get("attn_norm", 0.0) - norm_bytes)
    if "core_attn" in modules:
        mla = att.kind == "mla"
        latent = att.q_lora_rank + att.kv_lora_rank + att.qk_rope_head_dim if mla else 0
        move("qkv", kept.get("qkv", 0.0) - bytes_per_token_elem * latent)
    if "attn_proj" in modules:
        move("context", kept.get("context", 0.0))
    if "mlp_norm" in modules:
        move("mlp_norm", norm_bytes)
    if moe is not None and "expert_fc1" in modules:
        move("dispatch", kept.get("dispatch", 0.0))
    if moe is not None and "moe_act" in modules:
        mats = 3 if moe.gated else 2
        move("experts", full.get("experts", 0.0) * (mats - 1) / mats)
    return out

