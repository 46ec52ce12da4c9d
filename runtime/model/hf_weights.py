"""Hugging Face checkpoints into the runtime model: config.json -> (ModelSpec, ModelArch), and
safetensors weights into whatever part of the model one rank holds.

A checkpoint is a directory with `config.json` and `model.safetensors` (or shards listed by
`model.safetensors.index.json`), in the layout `save_pretrained` writes and the Hub serves:
per-expert matrices for Mixtral (`block_sparse_moe.experts.{e}.w1/w3/w2` = gate/up/down),
Qwen3-MoE and DeepSeek-V3 (`mlp.experts.{e}.gate_proj/up_proj/down_proj`), and GPT-OSS's
fused `mlp.experts.gate_up_proj` [E, D, 2F] with gate and up interleaved on the last axis
(modeling_gpt_oss.py:83). `load_hf_weights` copies every tensor the module holds: its layers,
the experts of its slots (an empty slot stays zero), this TP rank's slice of a head-split
weight and its vocabulary rows of the embedding and head (zero-padded, tensor_parallel.py);
DeepSeek's `e_score_correction_bias` becomes the router's selection bias `bias_E`.
Load before expert TP or FSDP reshape the parameters (the Trainer does both).

MTP modules (runtime/model/mtp.py) read DeepSeek-V3's names for them,
`model.layers.<num_hidden_layers + k>.`: `enorm`, `hnorm`, `eh_proj` ([D, 2D], embedding half
first), the layer's own names, and `shared_head.norm` as the module's final norm;
`shared_head.head` and the layer's `embed_tokens` are not read (the runtime's MTP modules use
the model's head and embedding, of which the released checkpoints store copies there). A
checkpoint without them (transformers' `save_pretrained` drops them: its DeepSeek-V3 has no
MTP) leaves the modules at their seeded initial weights, and says so in the log.

Runtime weights are [out, in] for nn.Linear (as in HF) and [X, D, F] / [X, F, D] for the
stacked experts (x @ W), so HF's per-expert [F, D] matrices are transposed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from planner.inputs.models import model_from_config
from planner.inputs.safe_read import read_input_bytes
from planner.run.hf_checkpoint import CONFIG, weight_files
from planner.run.spec import EMPTY
from planner.specs import ModelSpec, SpecError
from runtime.model.arch import ModelArch, arch_from_hf_config
from runtime.model.attention import MLAttention
from runtime.model.transformer import Block, StageModule
from runtime.parallel.tensor_parallel import vocab_shard

log = logging.getLogger(__name__)


# expert matrices per family: (gate, up, down) names under the layer's MoE prefix
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}
_DEFAULT_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")


def read_hf_config(path: str | Path) -> dict:
    """config.json of checkpoint directory `path` as a dict (SpecError if missing or bad)."""
    file = Path(path) / CONFIG
    if not file.exists():
        raise SpecError(f"{path}: no {CONFIG}; point at a save_pretrained directory")
    try:
        cfg = json.loads(read_input_bytes(file, CONFIG))
    except json.JSONDecodeError as exc:
        raise SpecError(f"{file}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise SpecError(f"{file}: must be a JSON object")
    return cfg


def hf_model(path: str | Path) -> tuple[ModelSpec, ModelArch]:
    """The ModelSpec (the planner's parser) and ModelArch of checkpoint directory `path`."""
    cfg = read_hf_config(path)
    where = str(Path(path) / CONFIG)
    return model_from_config(cfg, Path(path).name, where), arch_from_hf_config(cfg, where)


class _Tensors:
    """Lazy access to the named tensors of a checkpoint's safetensors file(s)."""

    def __init__(self, path: Path) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise SpecError(
                "reading HF weights needs safetensors; pip install safetensors"
            ) from None
        files = weight_files(path, str(path))  # shards inside the folder, regular files
        self.path, self.where = path, {}
        self.last: tuple[str, torch.Tensor] | None = None  # GPT-OSS reads a fused one per slot
        self.handles = [safe_open(str(path / f), framework="pt") for f in files]
        for handle in self.handles:
            for key in handle.keys():
                self.where[key] = handle

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise SpecError(f"{self.path}: the checkpoint has no tensor '{key}'")
        if self.last is None or self.last[0] != key:
            self.last = (key, self.where[key].get_tensor(key).float())
        return self.last[1]


def _copy(param: torch.Tensor, whole: torch.Tensor, key: str, tp_index: int, tp_size: int):
    """Copy `whole` into `param`, or this TP rank's equal slice of it along the one axis whose
    size differs (a head-split weight or sink vector)."""
    if whole.shape != param.shape:
        axes = [a for a in range(whole.dim()) if whole.shape[a] != param.shape[a]]
        ok = whole.dim() == param.dim() and len(axes) == 1
        ok = ok and whole.shape[axes[0]] == param.shape[axes[0]] * tp_size
        if not ok:
            raise SpecError(
                f"tensor '{key}' has shape {tuple(whole.shape)}, the model built from "
                f"config.json wants {tuple(param.shape)}; the weights and config differ"
            )
        whole = whole.narrow(axes[0], tp_index * param.shape[axes[0]], param.shape[axes[0]])
    with torch.no_grad():
        param.copy_(whole.to(param.dtype))


def load_hf_weights(module: StageModule, path: str | Path, family: str) -> None:
    """Copy checkpoint `path`'s weights into `module` (the layers, slots and TP slice it holds).

    family: the config's model_type (ModelSpec.family). Raises SpecError naming a missing or
    misshapen tensor.
    """
    tensors = _Tensors(Path(path))
    tp_index, tp_size = (module.tp.index, module.tp.size) if module.tp is not None else (0, 1)

    def load(param: torch.Tensor | None, key: str, transform: Callable | None = None) -> None:
        if param is None:
            return
        whole = tensors.get(key)
        _copy(param, transform(whole) if transform else whole, key, tp_index, tp_size)

    def rows(whole_VD: torch.Tensor) -> torch.Tensor:  # the vocabulary-parallel slice
        return whole_VD if module.tp is None else vocab_shard(whole_VD, module.tp)

    if module.embed is not None:
        load(module.embed.weight, "model.embed_tokens.weight", rows)
    if module.head is not None:
        load(module.norm.weight, "model.norm.weight")
        tied = "lm_head.weight" not in tensors
        load(module.head.weight, "model.embed_tokens.weight" if tied else "lm_head.weight", rows)
    for layer, block in zip(module.layer_ids, module.blocks, strict=True):
        _load_block(block, f"model.layers.{layer}.", family, load, tensors)
    if module.mtp is None:
        return
    if module.mtp_embed is not None:  # the last stage's copy (a tied head's weight is it)
        load(module.mtp_embed.weight, "model.embed_tokens.weight", rows)
    for layer, mtp in zip(module.mtp_layer_ids, module.mtp, strict=True):
        pre = f"model.layers.{layer}."
        if f"{pre}eh_proj.weight" not in tensors:
            log.warning("%s: no MTP weights %s*; MTP module %s keeps its initial weights",
                        path, pre, layer)  # fmt: skip
            continue
        load(mtp.enorm.weight, f"{pre}enorm.weight")
        load(mtp.hnorm.weight, f"{pre}hnorm.weight")
        load(mtp.eh_proj.weight, f"{pre}eh_proj.weight")
        load(mtp.final_norm.weight, f"{pre}shared_head.norm.weight")
        _load_block(mtp.block, pre, family, load, tensors)


def _linear(load, lin: nn.Module | None, key: str) -> None:
    if lin is None:
        return
    load(lin.weight, f"{key}.weight")
    if getattr(lin, "bias", None) is not None:
        load(lin.bias, f"{key}.bias")


def _load_block(block: Block, pre: str, family: str, load, tensors: _Tensors) -> None:
    load(block.attn_norm.weight, f"{pre}input_layernorm.weight")
    load(block.ffn_norm.weight, f"{pre}post_attention_layernorm.weight")
    att, a = block.attn, f"{pre}self_attn."
    if isinstance(att, MLAttention):
        names = {"q": "q_proj", "q_a": "q_a_proj", "q_b": "q_b_proj"}
        names |= {"kv_a": "kv_a_proj_with_mqa", "kv_b": "kv_b_proj", "o": "o_proj"}
        for ours, theirs in names.items():
            _linear(load, getattr(att, ours), a + theirs)
        if att.q_a_norm is not None:
            load(att.q_a_norm.weight, f"{a}q_a_layernorm.weight")
        load(att.kv_a_norm.weight, f"{a}kv_a_layernorm.weight")
    else:
        for ours in ("q", "k", "v", "o"):
            _linear(load, getattr(att, ours), f"{a}{ours}_proj")
        if att.q_norm is not None:
            load(att.q_norm.weight, f"{a}q_norm.weight")
            load(att.k_norm.weight, f"{a}k_norm.weight")
        load(att.sinks, f"{a}sinks")
    if block.mlp is not None:
        for ours in ("gate", "up", "down"):
            _linear(load, getattr(block.mlp, ours), f"{pre}mlp.{ours}_proj")
    if block.shared is not None:
        for ours in ("gate", "up", "down"):
            _linear(load, getattr(block.shared, ours), f"{pre}mlp.shared_experts.{ours}_proj")
    if block.moe is not None:
        _load_moe(block.moe, pre, family, load, tensors)


def _load_moe(moe, pre: str, family: str, load, tensors: _Tensors) -> None:
    box, gate, up, down = _EXPERT_NAMES.get(family, _DEFAULT_EXPERTS)
    router = "router" if family == "gpt_oss" else "gate"
    _linear(load, moe.router, f"{pre}{box}.{router}")
    bias_key = f"{pre}{box}.gate.e_score_correction_bias"
    if bias_key in tensors:
        load(moe.router.bias_E, bias_key)
    ex, base = moe.experts, f"{pre}{box}.experts."
    for slot, e in enumerate(ex.expert_ids):
        if e == EMPTY:
            continue
        if family == "gpt_oss":
            _load_fused_expert(load, ex, slot, e, base)
            continue
        if ex.w_gate is not None:
            load(ex.w_gate[slot], f"{base}{e}.{gate}.weight", torch.t)
        load(ex.w_in[slot], f"{base}{e}.{up}.weight", torch.t)
        load(ex.w_out[slot], f"{base}{e}.{down}.weight", torch.t)


def _load_fused_expert(load, ex, slot: int, e: int, base: str) -> None:
    """GPT-OSS: gate_up_proj [E, D, 2F] with gate at even and up at odd columns, x @ W."""

    def gate(t: torch.Tensor) -> torch.Tensor:
        return t[e][..., 0::2]

    def up(t: torch.Tensor) -> torch.Tensor:
        return t[e][..., 1::2]

    def own(t: torch.Tensor) -> torch.Tensor:
        return t[e]

    load(ex.w_gate[slot], f"{base}gate_up_proj", gate)
    load(ex.w_in[slot], f"{base}gate_up_proj", up)
    load(ex.w_out[slot], f"{base}down_proj", own)
    if ex.b_in is not None:
        load(ex.b_gate[slot], f"{base}gate_up_proj_bias", gate)
        load(ex.b_in[slot], f"{base}gate_up_proj_bias", up)
        load(ex.b_out[slot], f"{base}down_proj_bias", own)
