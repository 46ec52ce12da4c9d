"""ModelSpec from HF configs and presets: families, round trip, published totals, errors."""

from __future__ import annotations

import json

import pytest
import yaml

from planner.cli import main
from planner.inputs.models import (
    list_model_presets,
    load_model,
    model_config,
    model_from_config,
    published_counts,
    resolve_model,
)
from planner.resources.model_info import counts_on_basis, describe_model
from planner.resources.params import count_params
from planner.specs import SpecError

PRESETS = list_model_presets()
REQUIRED_PRESETS = (
    "mixtral-8x7b mixtral-8x22b qwen2-57b-a14b qwen1.5-moe-a2.7b qwen3-30b-a3b qwen3-235b-a22b "
    "deepseek-v2 deepseek-v2-lite deepseek-v3 kimi-k2 dbrx olmoe-1b-7b gpt-oss-20b gpt-oss-120b "
    "phi-3.5-moe arctic llama4-scout llama4-maverick grok-1 llama3-8b xmoe-small xmoe-medium "
    "xmoe-large xmoe-super weak-16e weak-128e weak-256e tiny-moe tiny-moe-deep"
).split()

MIXTRAL_TINY = {
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


def test_every_required_preset_exists():
    assert set(REQUIRED_PRESETS) <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_round_trips_through_model_config(name):
    model = load_model(name)
    cfg = model_config(model)
    again = model_from_config(json.loads(json.dumps(cfg)), model.name, model.source)
    assert again == model


@pytest.mark.parametrize("name", PRESETS)
def test_published_totals_reproduced(name):
    cfg, _, source = resolve_model(name)
    pub = published_counts(cfg, source)
    if pub is None or pub.total_params is None:
        pytest.skip("no published total")
    # a tolerance wider than 1% must say why in the preset
    assert pub.tolerance_pct <= 1.5
    assert pub.tolerance_pct == 1.0 or pub.note
    model = load_model(name)
    counts = count_params(model)
    computed = counts_on_basis(model, counts, pub.total_basis)
    assert abs(computed / pub.total_params - 1) * 100 <= pub.tolerance_pct
    if pub.active_params is not None:  # published active figures are rounded to 2 digits
        active = counts_on_basis(model, counts, pub.active_basis)
        assert abs(active / pub.active_params - 1) <= 0.05


def test_xmoe_sizes_follow_the_papers_formula():
    # the paper: per layer experts 2 E d ffn + attention 4 d^2, no embeddings, 2**30 units
    table = {"xmoe-small": 10.1, "xmoe-medium": 55.2, "xmoe-large": 201.4, "xmoe-super": 545.4}
    for name, size in table.items():
        m = load_model(name)
        moe = m.first_moe
        d = m.hidden_size
        paper = m.num_layers * (2 * moe.num_experts * d * moe.expert_ffn + 4 * d * d) / 2**30
        assert abs(paper - size) < 0.06
        counts = count_params(m)
        ours = counts_on_basis(m, counts, "no_embeddings") / 2**30
        assert abs(ours / paper - 1) < 0.002  # routers and norms only


def test_tiny_moe_shape():
    m = load_model("tiny-moe")
    assert (m.hidden_size, m.vocab_size, m.num_layers, m.max_position_embeddings) == (
        64,
        256,
        4,
        256,
    )
    assert [layer.kind for layer in m.layers] == ["dense", "moe", "moe", "moe"]
    assert m.layers[0].dense_ffn == 128
    att = m.layers[0].attention
    assert (att.num_heads, att.num_kv_heads, att.head_dim) == (4, 2, 16)
    moe = m.layers[1].moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn) == (8, 2, 64)
    assert (moe.num_shared_experts, moe.shared_ffn) == (1, 64)
    deep = load_model("tiny-moe-deep")
    assert deep.num_layers == 8 and deep.moe_layers == tuple(range(1, 8))


def test_deepseek_dense_layers_mla_and_mtp():
    m = load_model("deepseek-v3")
    assert m.moe_layers == tuple(range(3, 61))
    att = m.layers[0].attention
    assert att.kind == "mla" and (att.q_lora_rank, att.kv_lora_rank) == (1536, 512)
    assert m.num_mtp_layers == 1 and m.layers[5].moe.router_bias  # noaux_tc correction bias
    lite = load_model("deepseek-v2-lite")
    assert lite.layers[0].attention.q_lora_rank == 0  # null in the config = full-rank q
    assert lite.moe_layers == tuple(range(1, 27))
    cfg = {**resolve_model("deepseek-v2-lite")[0], "moe_layer_freq": 2}
    assert model_from_config(cfg, "x").moe_layers == tuple(range(2, 27, 2))


def test_qwen_sparse_step_mlp_only_and_shared_gate():
    cfg = dict(resolve_model("qwen1.5-moe-a2.7b")[0])
    cfg.update(decoder_sparse_step=2, mlp_only_layers=[3])
    m = model_from_config(cfg, "q")
    assert m.moe_layers == tuple(i for i in range(1, 24, 2) if i != 3)
    assert m.layers[0].dense_ffn == 5632
    moe = m.layers[1].moe
    assert moe.shared_gate and moe.num_shared_experts == 1 and moe.shared_ffn == 5632
    assert m.layers[1].attention.bias and not m.layers[1].attention.o_bias
    assert load_model("qwen3-30b-a3b").layers[0].attention.qk_norm


def test_llama4_interleave_shared_and_dense_width():
    mav = load_model("llama4-maverick")
    assert mav.moe_layers == tuple(range(1, 48, 2))
    assert mav.layers[0].dense_ffn == 16384 and mav.layers[1].moe.expert_ffn == 8192
    assert mav.layers[1].moe.num_shared_experts == 1 and mav.layers[1].moe.top_k == 1
    assert load_model("llama4-scout").moe_layers == tuple(range(48))


def test_arctic_residual_mlp_beside_moe():
    m = load_model("arctic")
    assert all(layer.kind == "moe" and layer.dense_ffn == 7168 for layer in m.layers)
    cfg = {**resolve_model("arctic")[0], "use_residual": False, "parallel_attn_mlp_res": False}
    assert model_from_config(cfg, "a").layers[0].dense_ffn == 0


def test_gpt_oss_biases_sinks_and_alternating_window():
    m = load_model("gpt-oss-20b")
    windows = [layer.attention.sliding_window for layer in m.layers]
    assert windows == [128 if i % 2 == 0 else None for i in range(24)]
    att, moe = m.layers[0].attention, m.layers[0].moe
    assert att.bias and att.o_bias and att.sinks and moe.expert_bias and moe.router_bias


def test_dbrx_nested_equals_flat_equivalent():
    dbrx = load_model("dbrx")
    flat = {
        "model_type": "mixtral", "hidden_size": 6144, "num_attention_heads": 48,
        "num_hidden_layers": 40, "vocab_size": 100352, "max_position_embeddings": 32768,
        "num_key_value_heads": 8, "intermediate_size": 10752, "num_local_experts": 16,
        "num_experts_per_tok": 4,
    }  # fmt: skip
    assert dbrx.layers == model_from_config(flat, "f").layers
    assert count_params(dbrx).total == count_params(model_from_config(flat, "f")).total


def test_yaml_and_directory_inputs(tmp_path):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(MIXTRAL_TINY))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(MIXTRAL_TINY))
    a = load_model(str(tmp_path / "m.yaml"))
    b = load_model(str(tmp_path / "ckpt"))
    assert a.layers == b.layers and b.name == "ckpt" and a.name == "m"


def test_mlp_gated_false_gives_two_matrix_experts():
    m = model_from_config({**MIXTRAL_TINY, "mlp_gated": False}, "t")
    assert not m.layers[0].moe.gated
    # 2 layers x 4 experts x 2 d ffn fewer than gated 3 d ffn
    gated = count_params(model_from_config(MIXTRAL_TINY, "t")).total
    assert gated - count_params(m).total == 2 * 4 * 8 * 16


def test_unknown_keys_ignored():
    m = model_from_config({**MIXTRAL_TINY, "rope_scaling": {"x": 1}, "foo": "bar"}, "t")
    assert m.layers == model_from_config(MIXTRAL_TINY, "t").layers


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"hidden_size": None}, "'hidden_size'"),
        ({"num_local_experts": 0}, "'num_local_experts' must be >= 1"),
        ({"intermediate_size": -4}, "'intermediate_size' must be >= 1"),
        ({"vocab_size": "10"}, "'vocab_size' must be an integer"),
        ({"num_experts_per_tok": 5}, "exceeds the 4 experts"),
        ({"num_attention_heads": 3}, "must divide hidden_size"),
        ({"num_key_value_heads": 2, "num_attention_heads": 1}, "must divide num_attention_heads"),
        ({"tie_word_embeddings": "yes"}, "must be true or false"),
    ],
)
def test_invalid_configs_give_one_line_naming_file_and_key(tmp_path, change, needle):
    cfg = {k: v for k, v in {**MIXTRAL_TINY, **change}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(SpecError) as exc:
        load_model(str(path))
    msg = str(exc.value)
    assert needle in msg and str(path) in msg and "\n" not in msg


def test_dbrx_missing_nested_key_is_named():
    cfg = json.loads(json.dumps(resolve_model("dbrx")[0]))
    del cfg["ffn_config"]["moe_top_k"]
    with pytest.raises(SpecError, match=r"'ffn_config\.moe_top_k'"):
        model_from_config(cfg, "dbrx", "dbrx.json")


def test_preset_names_are_case_insensitive(capsys):
    assert load_model("Mixtral-8x7B") == load_model("mixtral-8x7b")
    assert main(["model-info", "--list"]) == 0
    assert capsys.readouterr().out.split() == PRESETS
    assert main(["model-info", "--list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == PRESETS


def test_a_tied_head_is_shown_as_the_embedding_plus_its_final_norm(capsys):
    assert main(["model-info", "grok-1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("embedding"))
    assert "/ tied to the embedding (its final norm: 6,144)" in line
    assert main(["model-info", "deepseek-v3"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("embedding"))
    assert "0.93 B / 0.93 B" in line and "tied" not in line


def test_unknown_preset_suggests_closest():
    with pytest.raises(SpecError, match="did you mean mixtral-8x7b"):
        load_model("mixtral-8x7")


def test_bad_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 8,')
    with pytest.raises(SpecError) as err:
        load_model(str(path))
    assert str(err.value) == (
        f"{path}: invalid JSON at line 1 column 19: expecting property name enclosed in double "
        "quotes (fix: repair it, or take the model's config.json again)"
    )


def test_piper_format_rejects_inconsistent_layer_count():
    cfg = model_config(load_model("tiny-moe"))
    cfg["num_hidden_layers"] = 5
    with pytest.raises(SpecError, match="layer_groups hold 4"):
        model_from_config(cfg, "t")


def test_describe_model_reports_published_error():
    info = describe_model("mixtral-8x7b")
    assert info["total_params"] == count_params(load_model("mixtral-8x7b")).total
    assert abs(info["published"]["total"]["error_pct"]) < 1
    kinds = info["layers"]
    assert kinds == [{"layers": "0-31", "count": 32, "kind": kinds[0]["kind"]}]
    assert "E=8 k=2" in kinds[0]["kind"]


def test_cli_model_info_json_and_error_exit_code(capsys):
    assert main(["model-info", "tiny-moe", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["total_params"] == count_params(load_model("tiny-moe")).total
    assert main(["model-info", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_model_info_table(capsys):
    assert main(["model-info", "deepseek-v3", "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert "671.03 B" in out and "0-2 " in out and "3-60" in out and "seq_len 2048" in out
