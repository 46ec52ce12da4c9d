"""torchtitan's per-op selective AC ("op"): the bytes a layer keeps and the forward FLOPs it
reruns, against oracles written here from the shapes and torchtitan's save policy (every
second mm recomputed, SDPA / topk / all-to-all outputs kept, grouped experts and the router
gate recomputed)."""

from __future__ import annotations

import pytest

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.parallel import ParallelConfig
from planner.resources.compute import layer_work
from planner.resources.memory import layer_activations
from planner.resources.recompute import work_share
from planner.specs import TrainingSpec

S, B = 4096, 2
TRAINING = TrainingSpec(seq_len=S, global_batch=64)


def _par(ep: int = 1, tp: int = 1, recompute: str = "selective") -> ParallelConfig:
    modules = ("op",) if recompute == "selective" else ()
    return ParallelConfig(pp=1, dp=8, tp=tp, ep=ep, micro_batch=B, recompute=recompute,
                          recompute_modules=modules)  # fmt: skip


def _acts(model, layer, par, policy):
    return layer_activations(model, layer, TRAINING, par, policy).total


def _oracle(model, layer, ep: int, tp: int = 1) -> float:
    """Kept bytes of one layer under op-SAC, written out per tensor (bf16: 2 B)."""
    d, att, moe = model.hidden_size, layer.attention, layer.moe
    T = B * S / tp  # tokens of the rank (sequence parallel)
    a = 2.0
    if att.kind == "mla":
        qk = att.qk_nope_head_dim + att.qk_rope_head_dim
        # wq (1st, kept), wkv_a (2nd, recomputed), wkv_b (3rd, kept), wo (4th, recomputed)
        qkv = att.num_heads * qk + att.num_heads * (att.qk_nope_head_dim + att.v_head_dim)
        context = att.num_heads * att.v_head_dim
    else:
        q, kv = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
        qkv = q + 2 * kv  # the fused wqkv (1st) kept, wo (2nd) recomputed
        context = q
    lse = 4.0 * B * att.num_heads / tp * S  # flash attention's fp32 log-sum-exp
    kept = a * T * d + a * T * qkv + a * T * context + lse
    ffn = layer.dense_ffn or (moe.num_shared_experts * moe.shared_ffn if moe else 0)
    if ffn:  # w1 kept, w3 recomputed, w2 kept (an even number of attention matmuls before)
        kept += a * T * ffn + a * T * d * tp
    if tp > 1:  # the reduce-scatters after wo and w2 are always kept
        kept += a * T * d * (2 if ffn else 1)
    if moe is not None:
        kept += 12.0 * T * moe.top_k  # topk values (fp32) and indices (int64)
        if ep > 1:  # dispatch and combine all-to-all outputs
            kept += 2 * a * T * moe.top_k * d
    return kept


@pytest.mark.parametrize(
    ("name", "index", "ep", "tp"),
    [
        ("qwen3-30b-a3b", 0, 8, 1),  # GQA MoE, no shared experts
        ("qwen3-30b-a3b", 0, 1, 1),  # no EP: dispatch and combine are local permutes
        ("llama3-8b", 0, 1, 1),  # dense GQA
        ("llama3-8b", 0, 1, 2),  # tensor parallel: row-parallel outputs and reduce-scatters
        ("deepseek-v2-lite", 0, 1, 1),  # MLA, dense first layer
        ("deepseek-v2-lite", 5, 8, 1),  # MLA MoE with shared experts
    ],
)
def test_op_sac_keeps_the_per_tensor_sum_between_none_and_full(name, index, ep, tp):
    model = load_model(name)
    layer = model.layers[index]
    got = _acts(model, layer, _par(ep, tp), "selective")
    assert got == pytest.approx(_oracle(model, layer, ep, tp), rel=1e-12)
    none = _acts(model, layer, _par(ep, tp, "none"), "none")
    full = _acts(model, layer, _par(ep, tp, "full"), "full")
    assert full < got < none


def test_op_sac_on_qwen3_keeps_the_all_to_all_outputs():
    """The numbers: Qwen3-30B-A3B, b=2, s=4096, ep=8, one layer (MiB): none 1077.75; op-SAC
    689.75 = input 32 + wqkv 80 + context 64 + lse 1 + topk 0.75 + dispatch and combine
    256 each (the expert intermediates, 288, and both norms' outputs are dropped); full 32."""
    model = load_model("qwen3-30b-a3b")
    layer = model.layers[0]
    mib = [_acts(model, layer, _par(8, 1, p), p) / 2**20 for p in ("none", "selective", "full")]
    assert mib == pytest.approx([1077.75, 689.75, 32.0], abs=1e-9)


def _oracle_share(model, layer) -> dict[str, float]:
    """Forward FLOPs share rerun per Work: the recomputed matmuls' weights over all."""
    d, att, moe = model.hidden_size, layer.attention, layer.moe
    if att.kind == "mla":
        qk = att.qk_nope_head_dim + att.qk_rope_head_dim
        wq = d * att.num_heads * qk
        wkv_a = d * (att.kv_lora_rank + att.qk_rope_head_dim)
        wkv_b = att.kv_lora_rank * att.num_heads * (att.qk_nope_head_dim + att.v_head_dim)
        wo = att.num_heads * att.v_head_dim * d
        share = {"attn_proj": (wkv_a + wo) / (wq + wkv_a + wkv_b + wo)}
    else:
        q, kv = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
        share = {"attn_proj": q * d / (2 * d * q + 2 * d * kv)}  # wo of wqkv, wo
    if layer.dense_ffn:
        share["dense_mlp"] = 1 / 3  # w3 of w1, w3, w2
    if moe is not None:
        share.update(router=1.0, experts=1.0)
        if moe.num_shared_experts:
            share["shared"] = 1 / 3
    return share


@pytest.mark.parametrize(
    ("name", "index"),
    [("qwen3-30b-a3b", 0), ("llama3-8b", 0), ("deepseek-v2-lite", 0), ("deepseek-v2-lite", 5)],
)
def test_op_sac_reruns_every_second_matmul_and_the_experts(name, index):
    model = load_model(name)
    layer = model.layers[index]
    share = work_share(layer, ("op",), model.hidden_size)
    assert share == pytest.approx(_oracle_share(model, layer), rel=1e-12)
    assert "attn_core" not in share  # SDPA's output is kept


def test_op_sac_recompute_flops_of_a_qwen3_layer():
    """Rerun forward FLOPs = 2 T wo weights + router + all routed-expert GEMMs."""
    model, cluster = load_model("qwen3-30b-a3b"), load_cluster("h100")
    layer, par = model.layers[0], _par(8)
    work = {w.name: w for w in layer_work(model, layer, cluster, TRAINING, par)}
    share = work_share(layer, ("op",), model.hidden_size)
    rerun = sum(work[n].flops / 3 * s for n, s in share.items())
    d, T, moe = model.hidden_size, B * S, layer.moe
    oracle = 2 * T * 32 * 128 * d  # wo (32 heads of 128)
    oracle += 2 * T * d * moe.num_experts + 2 * T * moe.top_k * 3 * d * moe.expert_ffn
    # attention_params adds the qk-norm weights to the projections' Work: a 1e-4 share
    assert rerun == pytest.approx(oracle, rel=1e-3)
    full = sum(w.flops / 3 for w in work.values())
    assert 0 < rerun < full


def test_op_sac_keeps_no_more_than_no_recompute():
    """Llama-3 8B at tp = 16: torchtitan's policy would keep w2's partial sums (16 a T d) and
    two reduce-scatter outputs, more than the layer keeps without AC; priced at that bound."""
    model = load_model("llama3-8b")
    layer = model.layers[0]
    assert _oracle(model, layer, 1, 16) > _acts(model, layer, _par(1, 16, "none"), "none")
    got = _acts(model, layer, _par(1, 16), "selective")
    assert got == pytest.approx(_acts(model, layer, _par(1, 16, "none"), "none"), rel=1e-12)
