"""Parameter counts and FLOPs per token against hand computation on tiny configs."""

from __future__ import annotations

from planner.inputs.models import model_from_config
from planner.resources.flops import flops_per_token
from planner.resources.params import attention_params, count_params, mtp_params
from planner.specs import AttentionSpec

# d 8, ffn 16, 2 layers, 2 heads (head_dim 4), 1 kv head, 4 experts top-2, vocab 10
TINY = {
    "model_type": "mixtral",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 10,
}


def test_tiny_mixtral_by_hand():
    c = count_params(model_from_config(TINY, "t"))
    attention = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8  # q, k, v, o
    expert = 3 * 8 * 16
    router, norms = 8 * 4, 2 * 8
    layer_total = attention + 4 * expert + router + norms
    layer_active = attention + 2 * expert + router + norms
    emb, head = 10 * 8, 10 * 8 + 8  # head = projection + final norm
    assert c.per_layer[0].attention == attention == 192
    assert c.total == 2 * layer_total + emb + head == 3720
    assert c.active == 2 * layer_active + emb + head == 2184
    assert c.mtp == 0


def test_tied_embeddings_drop_the_head_projection():
    untied = count_params(model_from_config(TINY, "t")).total
    tied = count_params(model_from_config({**TINY, "tie_word_embeddings": True}, "t")).total
    assert untied - tied == 10 * 8


def test_mla_attention_by_hand():
    att = AttentionSpec(
        kind="mla", num_heads=2, num_kv_heads=2, head_dim=5, q_lora_rank=4, kv_lora_rank=6,
        qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=5,
    )  # fmt: skip
    q = 16 * 4 + 4 + 4 * 2 * (3 + 2)  # down, q_a norm, up
    kv_down = 16 * (6 + 2) + 6  # joint kv + rope key, kv_a norm
    kv_up = 6 * 2 * (3 + 5)
    o = 2 * 5 * 16
    assert attention_params(att, 16) == q + kv_down + kv_up + o == 498


def test_shared_expert_with_gate_by_hand():
    cfg = {**TINY, "model_type": "qwen2_moe", "moe_intermediate_size": 16,
           "shared_expert_intermediate_size": 12}  # fmt: skip
    base = count_params(model_from_config({**cfg, "shared_expert_intermediate_size": 0}, "t"))
    with_shared = count_params(model_from_config(cfg, "t"))
    per_layer = 3 * 8 * 12 + 8  # shared MLP + sigmoid gate d -> 1
    assert with_shared.total - base.total == 2 * per_layer
    assert with_shared.active - base.active == 2 * per_layer  # shared experts are always active


def test_gpt_oss_biases_sinks_by_hand():
    cfg = {**TINY, "model_type": "gpt_oss", "attention_bias": True}
    p = count_params(model_from_config(cfg, "t")).per_layer[0]
    assert p.attention == 192 + 8 + 4 + 4 + 8 + 2  # q, k, v, o biases, 2 sinks
    assert p.expert == 3 * 8 * 16 + 2 * 16 + 8  # gate_up bias 2f, down bias d
    assert p.router == 8 * 4 + 4


def test_mtp_module_by_hand():
    cfg = {**TINY, "model_type": "deepseek_v3", "q_lora_rank": None, "kv_lora_rank": 4,
           "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 4,
           "num_nextn_predict_layers": 2, "moe_intermediate_size": 16}  # fmt: skip
    m = model_from_config(cfg, "t")
    c = count_params(m)
    per_module = 2 * 8 + 2 * 8 * 8 + c.per_layer[-1].total + 8
    assert c.mtp == mtp_params(m) == 2 * per_module
    assert c.total == c.embedding + c.head + sum(p.total for p in c.per_layer)  # MTP excluded


def test_active_equals_total_when_every_expert_is_used():
    m = model_from_config({**TINY, "num_experts_per_tok": 4}, "t")
    c = count_params(m)
    assert c.active == c.total


def test_flops_per_token_by_hand():
    # Megatron-Core's convention (flops.py): no router, causal half of the attention square,
    # vocabulary padded to 128, sliding windows not discounted.
    f = flops_per_token(model_from_config(TINY, "t"), seq_len=6)
    assert f.mlp == 2 * 6 * 8 * 3 * (2 * 16)  # layers x 6 d x 3 matrices x top_k f
    assert f.attention_linear == 2 * 6 * (8 * (8 + 2 * 4) + 8 * 8)  # d (q + 2 kv) + q d
    assert f.attention_core == 2 * 3 * 2 * (4 + 4) * 6  # layers x 3 H (d_qk + d_v) s
    assert f.logits == 6 * 8 * 128  # vocab 10 padded to 128
    assert f.mtp == 0 and f.total == f.main == 9216 + 2304 + 576 + 6144
    windowed = flops_per_token(model_from_config({**TINY, "sliding_window": 4}, "t"), seq_len=6)
    assert windowed == f


def test_dense_flops_match_six_n_plus_attention():
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 256}  # fmt: skip
    m = model_from_config(cfg, "dense")
    c = count_params(m)
    f = flops_per_token(m, seq_len=16)
    non_matmul = c.embedding + 3 * 2 * 64 + 64  # embedding gather, norms, final norm
    assert f.main - f.attention_core == 6 * (c.total - non_matmul)  # 6 N
    assert f.attention_core == 6 * 3 * 4 * 16 * 16  # PaLM's 12 L H Q T, halved for causal
