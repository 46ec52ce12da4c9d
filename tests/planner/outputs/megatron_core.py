"""Megatron-Core's own checks for an exported MEGATRON_ARGS, without a Megatron-LM checkout.

Megatron-LM turns its parsed arguments into a TransformerConfig in
`megatron/training/arguments.py::core_transformer_config_from_args`: every argument whose
name is a config field is passed through, plus a few renamed ones. `transformer_config(args)`
does the same for the flags Piper exports (their argparse destinations as Megatron-LM names
them) and builds the config, whose `__post_init__` runs Megatron-Core's validation. The
checks that need Transformer Engine or a GPU (its version gates, the fused RoPE kernel) are
stubbed as present: a CPU machine has neither, a training machine has both.
"""

from __future__ import annotations

import argparse
import ast
from typing import Any

import pytest

# Flag -> (argparse destination in Megatron-LM, kind); kinds: int, float, str, true (a switch),
# list (nargs), freq (an int or a Python list expression), tuple ("W,0").
FLAGS: dict[str, tuple[str, str]] = {}
for _kind, _names in {
    "int": "tensor-model-parallel-size pipeline-model-parallel-size context-parallel-size "
    "expert-model-parallel-size expert-tensor-parallel-size micro-batch-size global-batch-size "
    "num-layers hidden-size ffn-hidden-size seq-length max-position-embeddings "
    "num-attention-heads num-query-groups kv-channels num-experts moe-router-topk "
    "moe-ffn-hidden-size moe-shared-expert-intermediate-size decoder-first-pipeline-num-layers "
    "decoder-last-pipeline-num-layers recompute-num-layers mtp-num-layers q-lora-rank "
    "kv-lora-rank qk-head-dim qk-pos-emb-head-dim v-head-dim rotary-base "
    "moe-router-num-groups moe-router-group-topk num-layers-per-virtual-pipeline-stage "
    "rotary-seq-len-interpolation-factor save-interval",
    "float": "norm-epsilon moe-router-topk-scaling-factor moe-aux-loss-coeff "
    "rotary-scaling-factor mscale mscale-all-dim rope-scaling-factor glu-linear-offset "
    "activation-func-clamp-value",
    "str": "pipeline-model-parallel-layout recompute-granularity recompute-method "
    "moe-token-dispatcher-type moe-flex-dispatcher-backend position-embedding-type "
    "normalization moe-router-score-function moe-router-dtype rope-type fp8-format "
    "fp8-recipe data-parallel-sharding-strategy ckpt-format exp-avg-dtype exp-avg-sq-dtype "
    "softmax-type cuda-graph-impl",
    "true": "group-query-attention swiglu quick-geglu untie-embeddings-and-output-weights "
    "disable-bias-linear bf16 fp16 use-distributed-optimizer moe-grouped-gemm "
    "multi-latent-attention qk-layernorm qk-l2-norm add-qkv-bias "
    "moe-router-enable-expert-bias moe-router-pre-softmax moe-apply-probs-on-input "
    "moe-shared-expert-gate sequence-parallel use-megatron-fsdp use-precision-aware-optimizer "
    "overlap-moe-expert-parallel-comm delay-wgrad-compute use-rope-scaling rotary-interleaved "
    "overlap-grad-reduce overlap-param-gather",
    "list": "recompute-modules moe-router-load-balancing-type cuda-graph-scope",
    "freq": "moe-layer-freq no-rope-freq window-attn-skip-freq",
    "tuple": "window-size",
}.items():
    for _name in _names.split():
        FLAGS[f"--{_name}"] = (_name.replace("-", "_"), _kind)
FLAGS["--norm-epsilon"] = ("layernorm_epsilon", "float")
FLAGS["--fp8-format"] = ("fp8", "str")


def _freq(text: str) -> Any:
    """Megatron-LM's moe_freq_type / no_rope_freq_type: an int or a list expression."""
    value = ast.literal_eval(text)
    return list(value) if isinstance(value, list | tuple) else int(value)


def megatron_namespace(args: list[str]) -> argparse.Namespace:
    """Parse exported flags as Megatron-LM's parser would (only these flags; any other is an
    error, so an unknown flag fails the test)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    types = {"int": int, "float": float, "str": str, "freq": _freq}
    parser.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false")
    for flag, (dest, kind) in FLAGS.items():
        if kind == "true":
            parser.add_argument(flag, dest=dest, action="store_true")
        elif kind == "list":
            parser.add_argument(flag, dest=dest, nargs="+")
        elif kind == "tuple":
            parser.add_argument(flag, dest=dest, type=lambda x: tuple(map(int, x.split(","))))
        else:
            parser.add_argument(flag, dest=dest, type=types[kind])
    return parser.parse_args(args)


def transformer_config(args: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Megatron-Core's TransformerConfig (MLATransformerConfig with MLA) of exported flags."""
    import torch
    import torch.nn.functional as F
    from megatron.core.activations import quick_gelu
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer import transformer_config as tc_module

    monkeypatch.setattr(tc_module, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    ns = megatron_namespace(args)
    cls = MLATransformerConfig if ns.multi_latent_attention else TransformerConfig
    fields = set(cls.__dataclass_fields__)
    kw = {k: v for k, v in vars(ns).items() if k in fields and v is not None}
    # core_transformer_config_from_args's renames and derived values
    dtype = torch.bfloat16 if ns.bf16 else torch.float16 if ns.fp16 else torch.float32
    kw.update(params_dtype=dtype, pipeline_dtype=dtype, apply_rope_fusion=ns.apply_rope_fusion)
    kw["num_moe_experts"] = ns.num_experts
    kw["num_layers_in_first_pipeline_stage"] = ns.decoder_first_pipeline_num_layers
    kw["num_layers_in_last_pipeline_stage"] = ns.decoder_last_pipeline_num_layers
    kw["num_query_groups"] = ns.num_query_groups if ns.group_query_attention else None
    kw["add_bias_linear"] = not ns.disable_bias_linear
    if ns.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    if ns.quick_geglu:
        kw.update(activation_func=quick_gelu, gated_linear_unit=True)
    if ns.tensor_model_parallel_size == 1:  # validate_args turns it off without TP
        kw["sequence_parallel"] = False
    for key in ("moe_router_load_balancing_type",):
        if isinstance(kw.get(key), list) and len(kw[key]) == 1:
            kw[key] = kw[key][0]
    if ns.num_layers_per_virtual_pipeline_stage:  # validate_args derives vp from it
        per_rank = ns.num_layers // ns.pipeline_model_parallel_size
        kw["virtual_pipeline_model_parallel_size"] = (
            per_rank // ns.num_layers_per_virtual_pipeline_stage
        )
    return cls(**kw)
