"""Selective recompute by module: what each Megatron-Core module drops and what rerunning it costs.

`--recompute-granularity selective --recompute-modules ...` (Megatron-LM
`megatron/core/transformer/transformer_config.py`, the recompute_modules docstring). Two
mechanisms: output-discarding (`CheckpointWithoutOutput`) for `layernorm`, `moe_act` and
`mla_up_proj` frees a module's output once its consumer has saved what it needs; a standard
checkpoint for `core_attn`, `mlp`, `moe` and `shared_experts` keeps only the block input.
Per module, on Piper's activation components (planner.resources.memory):

- core_attn (attention.py, checkpoint_core_attention): `scores`; with flash attention the
  log-sum-exp (q, k, v and the context stay as the block's inputs and linear_proj's input);
- layernorm (transformer_layer.py; gpt_layer_specs.py TENorm vs IdentityOp): the output,
  a T d, of every norm not fused into a linear: the pre-MLP norm of MoE layers and the input
  norm of MLA layers (GQA input norms and dense pre-MLP norms are fused, nothing to drop);
- moe_act (experts.py): the routed experts' activation output (fc2 input): 1 of the 3 gated
  intermediates, 1 of 2 plain;
- mla_up_proj (multi_latent_attention.py): q, k, v after the up-projections; latents stay;
- mlp (transformer_layer.py, `if not self.is_moe_layer`): a dense layer's MLP intermediates
  and its fused norm output; nothing on MoE layers;
- moe (moe_layer.py): the whole MoE block but its input: router, dispatch, experts,
  combine, shared experts;
- shared_experts (moe_layer.py): the shared experts' intermediates.

Recomputing repeats the forward of the GEMMs a module holds (`work_share`), the elementwise
passes over the bytes it dropped, and for `moe` the forward dispatch and combine
all-to-alls (and expert-TP collectives) of the layer.

"op" is torchtitan's per-op selective AC of the whole layer (planner.resources.op_sac); it
keeps the all-to-all outputs, so it repeats no dispatch. "budget:<b>" is torchtitan's
memory-budget AC (planner.resources.memory_budget): its choice depends on the sequence, the
layout and the dtype, so it is priced by `budget_kept` and `budget_rerun`, which take them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.parallel import ParallelConfig, memory_budget
from planner.resources import memory_budget as budget_ac
from planner.resources import op_sac
from planner.resources.params import attention_matmul_params
from planner.specs import LayerSpec, SpecError, TrainingSpec


def kept_components(
    layer: LayerSpec,
    parts: Sequence[tuple[str, float]],
    modules: Sequence[str],
    bytes_per_token_elem: float,
    hidden: int,
) -> list[tuple[str, float]]:
    """`parts` (the layer's activation components without recompute) after recomputing
    `modules`; `bytes_per_token_elem` = a T (bytes of one element per token of the rank),
    so one norm output (or block input) is a T d with d = `hidden`."""
    _refuse_budget(modules)
    norm_output_bytes = bytes_per_token_elem * hidden
    out = dict(parts)
    moe, mla = layer.moe, layer.attention.kind == "mla"

    def drop(name: str, keep: float = 0.0) -> None:
        if name in out:
            out[name] = min(out[name], keep)

    if "core_attn" in modules:
        drop("scores")
    if "layernorm" in modules:
        if moe is not None:
            drop("mlp_norm", out.get("mlp_norm", 0.0) - norm_output_bytes)
        if mla:
            drop("attn_norm", out.get("attn_norm", 0.0) - norm_output_bytes)
    if "moe_act" in modules and moe is not None:
        mats = 3 if moe.gated else 2
        drop("experts", out.get("experts", 0.0) * (mats - 1) / mats)
    if "mla_up_proj" in modules and mla:
        att = layer.attention
        latent = att.q_lora_rank + att.kv_lora_rank + att.qk_rope_head_dim
        drop("qkv", bytes_per_token_elem * latent)
    if "mlp" in modules and moe is None:
        drop("dense_mlp")
        drop("mlp_norm", norm_output_bytes)
    if "moe" in modules and moe is not None:
        for name in ("router", "dispatch", "experts", "combine", "shared", "dense_mlp"):
            drop(name)
    if "shared_experts" in modules and moe is not None:
        drop("shared")
    return [(name, out[name]) for name, _ in parts]


def work_share(layer: LayerSpec, modules: Sequence[str], hidden: int) -> dict[str, float]:
    """Share of each compute kind's forward (planner.resources.compute.Work names) that
    recomputing `modules` repeats: core attention, the MLA up-projections (their share of
    the attention projection weights), a dense layer's MLP, the whole MoE block, or the
    shared experts; for "op", torchtitan's recomputed matmuls (op_sac.work_share)."""
    _refuse_budget(modules)
    if op_sac.OP in modules:
        return op_sac.work_share(layer, hidden)
    share: dict[str, float] = {}
    moe, att = layer.moe, layer.attention
    if "core_attn" in modules:
        share["attn_core"] = 1.0
    if "mla_up_proj" in modules and att.kind == "mla":
        qk = att.qk_nope_head_dim + att.qk_rope_head_dim
        q_up = att.q_lora_rank * att.num_heads * qk if att.q_lora_rank else 0
        kv_up = att.kv_lora_rank * att.num_heads * (att.qk_nope_head_dim + att.v_head_dim)
        share["attn_proj"] = (q_up + kv_up) / attention_matmul_params(att, hidden)
    if "mlp" in modules and moe is None:
        share["dense_mlp"] = 1.0
    if "moe" in modules and moe is not None:
        share.update(router=1.0, experts=1.0, shared=1.0, dense_mlp=1.0)
    if "shared_experts" in modules and moe is not None:
        share["shared"] = 1.0
    return share


def repeats_dispatch(layer: LayerSpec, modules: Sequence[str]) -> bool:
    """True when recomputing `modules` reruns the layer's forward dispatch and combine."""
    return "moe" in modules and layer.moe is not None


def _refuse_budget(modules: Sequence[str]) -> None:
    if memory_budget(tuple(modules)) is not None:
        raise SpecError(
            f"parallel.recompute_modules {','.join(modules)}: memory-budget AC is priced by "
            "budget_kept / budget_rerun (planner.resources.recompute), which this pricing "
            "path does not call; re-plan with --recompute-modules op or --recompute full"
        )


@dataclass(frozen=True)
class BudgetRerun:
    """What torchtitan's memory-budget AC repeats in one layer's backward: `share`, each
    compute Work's share of its forward (Work name, share); `repeats_dispatch`, the forward
    dispatch and combine all-to-alls; `recompute_flops`, the forward FLOPs it repeats."""

    share: tuple[tuple[str, float], ...]
    repeats_dispatch: bool
    recompute_flops: float


def budget_kept(
    layer: LayerSpec,
    parts: Sequence[tuple[str, float]],
    training: TrainingSpec,
    parallel: ParallelConfig,
    hidden: int,
) -> list[tuple[str, float]] | None:
    """`parts` (the layer's components without recompute) as the memory budget of
    `parallel` keeps them (planner.resources.memory_budget); None when the layout recomputes
    no memory budget."""
    budget = memory_budget(parallel.recompute_modules)
    if budget is None or parallel.recompute != "selective":
        return None
    choice = budget_ac.layer_choice(layer, parts, training, parallel, hidden, budget)
    return budget_ac.kept_components(choice, parts)


def budget_rerun(
    layer: LayerSpec,
    parts: Sequence[tuple[str, float]],
    training: TrainingSpec,
    parallel: ParallelConfig,
    hidden: int,
    forward_flops: Mapping[str, float],
) -> BudgetRerun | None:
    """What the memory budget of `parallel` repeats in backward; `forward_flops` maps each
    compute Work of the layer to its forward FLOPs on the rank. None without a budget."""
    budget = memory_budget(parallel.recompute_modules)
    if budget is None or parallel.recompute != "selective":
        return None
    choice = budget_ac.layer_choice(layer, parts, training, parallel, hidden, budget)
    share = budget_ac.work_share(choice, dict(forward_flops))
    return BudgetRerun(
        tuple(sorted(share.items())),
        budget_ac.repeats_dispatch(choice),
        choice.recompute_flops,
    )
