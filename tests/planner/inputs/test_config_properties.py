"""Property tests (hypothesis) for model configs: valid ones load and count consistently,
invalid ones fail with one SpecError line and never any other exception."""

from __future__ import annotations

import copy
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.inputs.models import model_config, model_from_config
from planner.resources.flops import flops_per_token, padded_vocab
from planner.resources.params import count_params
from planner.specs import SpecError

SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "phimoe", "grok-1",
            "arctic", "llama4", "moe", "deepseek_v2", "deepseek_v3", "llama", "dbrx")  # fmt: skip


@st.composite
def valid_configs(draw) -> dict:
    """A random, valid HF-style config of one of the supported families (tiny sizes)."""
    family = draw(st.sampled_from(FAMILIES))
    kv = draw(st.integers(1, 4))
    heads = kv * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    layers = draw(st.integers(1, 6))
    experts = draw(st.integers(1, 12))
    cfg = {
        "model_type": family,
        "hidden_size": heads * head_dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": draw(st.integers(1, 300)),
        "intermediate_size": draw(st.integers(1, 48)),
        "tie_word_embeddings": draw(st.booleans()),
        "mlp_gated": draw(st.booleans()),
    }
    if family != "llama":
        cfg.update(num_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)))
    if family in ("qwen2_moe", "qwen3_moe", "moe", "deepseek_v2", "deepseek_v3"):
        cfg["moe_intermediate_size"] = draw(st.integers(1, 32))
        cfg["first_k_dense_replace"] = draw(st.integers(0, layers))
    if family == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = draw(st.integers(0, 32))
    if family.startswith("deepseek"):
        cfg.update(
            n_shared_experts=draw(st.integers(0, 2)), q_lora_rank=draw(st.sampled_from([None, 4])),
            kv_lora_rank=draw(st.integers(1, 8)), qk_nope_head_dim=draw(st.integers(1, 8)),
            qk_rope_head_dim=draw(st.integers(1, 4)), v_head_dim=draw(st.integers(1, 8)),
            num_nextn_predict_layers=draw(st.integers(0, 1)),
        )  # fmt: skip
    if family == "llama4":
        cfg["interleave_moe_layer_step"] = draw(st.integers(1, 3))
        cfg["intermediate_size_mlp"] = draw(st.integers(1, 48))
    if family == "arctic":
        cfg["use_residual"] = draw(st.booleans())
    if family == "gpt_oss" and draw(st.booleans()):
        cfg["sliding_window"] = draw(st.integers(1, 64))
        cfg["layer_types"] = [draw(st.sampled_from(["sliding_attention", "full_attention"]))
                              for _ in range(layers)]  # fmt: skip
    if family == "dbrx":
        cfg = _as_dbrx(cfg)
    return cfg


def _as_dbrx(cfg: dict) -> dict:
    return {
        "model_type": "dbrx", "d_model": cfg["hidden_size"], "n_heads": cfg["num_attention_heads"],
        "n_layers": cfg["num_hidden_layers"], "vocab_size": cfg["vocab_size"],
        "attn_config": {"kv_n_heads": cfg["num_key_value_heads"]},
        "ffn_config": {"ffn_hidden_size": cfg["intermediate_size"], "moe_num_experts":
                       cfg["num_experts"], "moe_top_k": cfg["num_experts_per_tok"]},
    }  # fmt: skip


@SETTINGS
@given(valid_configs())
def test_valid_configs_load_and_count_consistently(cfg):
    model = model_from_config(cfg, "m", "random.json")
    c = count_params(model)
    assert c.total == c.embedding + c.head + sum(p.total for p in c.per_layer)
    assert 0 < c.active <= c.total
    all_experts_used = all(p.top_k == p.num_experts for p in c.per_layer)
    assert (c.active == c.total) == all_experts_used
    again = model_from_config(json.loads(json.dumps(model_config(model))), "m", "random.json")
    assert again == model
    short, long = flops_per_token(model, 8), flops_per_token(model, 64)
    assert 0 < short.total <= long.total
    # Megatron-Core's count: token-linear FLOPs never exceed 6 x the active weights (its MLA
    # terms include the latent norms) plus the vocabulary padding of the head
    pad = (padded_vocab(model.vocab_size) - model.vocab_size) * model.hidden_size
    linear = short.total - short.attention_core - short.mtp
    assert linear <= 6 * (c.active + pad)
    assert long.total - short.total == long.attention_core - short.attention_core + (
        long.mtp - short.mtp
    )  # only attention grows with the sequence


@st.composite
def faulty_configs(draw) -> tuple[dict, str, object]:
    """A valid config with one key changed to junk (or removed): (config, key, value)."""
    cfg = draw(valid_configs())
    target = cfg
    if cfg.get("model_type") == "dbrx" and draw(st.booleans()):
        target = cfg[draw(st.sampled_from(["attn_config", "ffn_config"]))]
    key = draw(st.sampled_from(sorted(target)))
    value = draw(st.sampled_from([
        "<removed>", 0, -1, -7, 1.5, "12", "", None, True, [1], {"a": 1}, 10**6,
    ]))  # fmt: skip
    if value == "<removed>":
        del target[key]
    else:
        target[key] = value
    return cfg, key, value


BAD_PIPER = st.sampled_from([
    {"published_total_params": "x"}, {"count_unit": "bytes"}, {"tolerance_pct": "wide"}, [],
    {"published_total_params": -1.0}, {"count_basis": "everything"}, {"active_basis": 3},
    {"published_active_params": True}, {"tolerance_pct": 0},
])  # fmt: skip


@SETTINGS
@given(valid_configs(), BAD_PIPER)
def test_bad_piper_metadata_is_a_spec_error(cfg, meta):
    try:
        model_from_config({**cfg, "_piper": meta}, "m", "bad.json")
    except SpecError as exc:
        assert "'_piper" in str(exc) or "_piper" in str(exc)
    else:
        raise AssertionError(f"_piper={meta!r} was accepted")


@SETTINGS
@given(faulty_configs())
def test_faulty_configs_fail_cleanly_or_load(case):
    cfg, key, value = case
    try:
        model = model_from_config(copy.deepcopy(cfg), "m", "bad.json")
    except SpecError as exc:
        msg = str(exc)
        assert msg.startswith("bad.json") and "\n" not in msg
        return
    # accepted: then it must be a sound model
    c = count_params(model)
    assert 0 < c.active <= c.total


REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
            "num_experts", "num_experts_per_tok")  # fmt: skip


@SETTINGS
@given(
    st.sampled_from(REQUIRED),
    st.sampled_from(["<removed>", 0, -3, "8", 2.5, None, [4]]),
    st.sampled_from(["mixtral", "qwen3_moe", "moe", "olmoe"]),
)
def test_required_key_faults_are_rejected_naming_the_key(key, value, family):
    cfg = {"model_type": family, "hidden_size": 16, "num_hidden_layers": 2, "vocab_size": 32,
           "num_attention_heads": 4, "intermediate_size": 8, "num_experts": 4,
           "num_experts_per_tok": 2}  # fmt: skip
    if value == "<removed>" or value is None:
        cfg.pop(key)
    else:
        cfg[key] = value
    try:
        model_from_config(cfg, "m", "bad.json")
    except SpecError as exc:
        assert f"'{key}'" in str(exc) and "\n" not in str(exc)
    else:
        raise AssertionError(f"{key}={value!r} was accepted")
