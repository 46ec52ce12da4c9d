"""config.json is read strictly: a key the family needs is never replaced by a fallback, a
near-miss of a key Piper reads is an error with the suggestion, a generic fallback is a loud
WARNING showing what was read; HF keys Piper does not need stay ignored."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from planner.cli import main
from planner.inputs import hf_config
from planner.inputs.config_keys import (
    IGNORED_KEYS,
    NESTED_IGNORED_KEYS,
    READ_KEYS,
    check_key_typos,
)
from planner.inputs.models import (
    list_model_presets,
    load_model,
    model_from_config,
    resolve_model,
)
from planner.resources.params import count_params

# every committed preset: total parameters as counted before the strict reading (unchanged)
PRESET_TOTALS = {
    "arctic": 478584608768, "dbrx": 131596523520, "deepseek-v2": 235741434880,
    "deepseek-v2-lite": 15706484224, "deepseek-v3": 671026419200,
    "deepseek-v3-nomtp": 671026419200, "gpt-oss-120b": 116829156672,
    "gpt-oss-20b": 20914757184, "grok-1": 315684820992, "kimi-k2": 1026408232448,
    "llama3-8b": 8030261248, "llama4-maverick": 400711848960, "llama4-scout": 107769861120,
    "mixtral-8x22b": 140630071296, "mixtral-8x7b": 46702792704, "olmoe-1b-7b": 6919161856,
    "phi-3.5-moe": 41873117184, "qwen1.5-moe-a2.7b": 14315784192,
    "qwen2-57b-a14b": 57408658944, "qwen3-235b-a22b": 235093634560,
    "qwen3-30b-a3b": 30532122624, "tiny-moe": 440384, "tiny-moe-deep": 934464,
    "weak-128e": 862885319680, "weak-16e": 111247692800, "weak-256e": 1721899750400,
    "xmoe-large": 216980929536, "xmoe-medium": 59841213440, "xmoe-small": 11014359040,
    "xmoe-super": 586480448512,
}  # fmt: skip
USER_MOE = {
    "model_type": "mymoe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "vocab_size": 100, "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip


def _preset(name: str) -> dict:
    return resolve_model(name)[0]


def _write(tmp_path, cfg: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def _model_info(capsys, path) -> tuple[int, str]:
    code = main(["model-info", str(path)])
    return code, capsys.readouterr().err


def test_every_committed_preset_loads_unchanged_and_quietly(caplog):
    caplog.set_level(logging.WARNING)
    assert sorted(PRESET_TOTALS) == list_model_presets()
    for name, total in PRESET_TOTALS.items():
        assert count_params(load_model(name)).total == total, name
    assert caplog.records == []  # no preset falls back to the generic keys


def test_every_key_of_every_preset_is_read_or_known_to_be_ignored():
    for name in list_model_presets():
        cfg = _preset(name)
        sections = [cfg, cfg.get("text_config") or {}]
        keys = {k for section in sections for k in section}
        assert keys <= READ_KEYS | IGNORED_KEYS, (name, keys - READ_KEYS - IGNORED_KEYS)
        nested = {k for s in ("attn_config", "ffn_config") for k in cfg.get(s) or {}}
        assert nested <= {"kv_n_heads", "ffn_hidden_size", "moe_num_experts", "moe_top_k"} | (
            NESTED_IGNORED_KEYS
        )


def test_read_keys_name_every_key_the_families_read(monkeypatch):
    """READ_KEYS (the near-miss targets) is complete: the reader reads no key outside it."""
    seen: set[str] = set()
    took, default = hf_config.ConfigReader._took, hf_config.ConfigReader._default

    def record_took(self, key, value):
        seen.add(self._name(key))
        return took(self, key, value)

    def record_default(self, keys, value):
        seen.update(self._name(k) for k in keys)
        return default(self, keys, value)

    monkeypatch.setattr(hf_config.ConfigReader, "_took", record_took)
    monkeypatch.setattr(hf_config.ConfigReader, "_default", record_default)
    for name in list_model_presets():
        load_model(name)
    top_level = {k for k in seen if "." not in k and not k.startswith("_piper")}
    assert len(top_level) > 40
    assert top_level <= READ_KEYS, top_level - READ_KEYS


def test_misspelt_expert_width_is_an_error_with_the_suggestion(tmp_path, capsys):
    cfg = _preset("qwen3-30b-a3b")
    cfg["moe_intermediate_sise"] = cfg.pop("moe_intermediate_size")
    path = _write(tmp_path, cfg)
    code, err = _model_info(capsys, path)
    assert code == 2
    assert err == (
        f"piper model-info: error: {path}: unknown key 'moe_intermediate_sise'; did you mean "
        "'moe_intermediate_size'? rename it (an unknown key is ignored)\n"
    )


def test_misspelt_expert_count_in_a_user_config_is_an_error(tmp_path, capsys):
    cfg = dict(USER_MOE)
    cfg["num_expert"] = cfg.pop("num_experts")
    path = _write(tmp_path, cfg)
    code, err = _model_info(capsys, path)
    assert code == 2
    assert err == (
        f"piper model-info: error: {path}: unknown key 'num_expert'; did you mean "
        "'num_experts'? rename it (an unknown key is ignored)\n"
    )


def test_misspelt_key_inside_dbrx_ffn_config_is_an_error(tmp_path, capsys):
    cfg = _preset("dbrx")
    cfg["ffn_config"]["moe_top_kk"] = cfg["ffn_config"].pop("moe_top_k")
    code, err = _model_info(capsys, _write(tmp_path, cfg))
    assert code == 2
    assert "unknown key 'ffn_config.moe_top_kk'; did you mean 'ffn_config.moe_top_k'?" in err


@pytest.mark.parametrize(
    ("preset", "key"),
    [
        ("qwen3-30b-a3b", "moe_intermediate_size"),  # was: experts as wide as the dense MLP
        ("deepseek-v2-lite", "moe_intermediate_size"),
        ("llama4-maverick", "intermediate_size_mlp"),  # was: dense layers as wide as experts
    ],
)
def test_a_missing_width_the_family_needs_is_an_error_naming_it(tmp_path, capsys, preset, key):
    cfg = _preset(preset)
    (cfg.get("text_config") or cfg).pop(key)
    path = _write(tmp_path, cfg)
    code, err = _model_info(capsys, path)
    assert code == 2
    assert err == (
        f"piper model-info: error: {path}: missing key '{key}'; add it (an integer >= 1)\n"
    )


def test_unrelated_hf_keys_stay_ignored(tmp_path):
    cfg = _preset("mixtral-8x7b")
    cfg.update(
        transformers_version="4.46.0", use_cache=True, rope_scaling=None, top_p=0.9,
        output_router_logits=False, router_jitter_noise=0.0, max_window_layers=28,
        quantization_config={"quant_method": "fp8"}, my_team_note="v2 run",
    )  # fmt: skip
    model = load_model(str(_write(tmp_path, cfg)))
    assert count_params(model).total == PRESET_TOTALS["mixtral-8x7b"]


# the fields of transformers' config classes (src/transformers/models/<family>/configuration_*.py:
# Qwen3MoeConfig, DeepseekV3Config.__init__, GptOssConfig, Llama4TextConfig, Llama4Config) and
# keys of other families' real configs that resemble a key Piper reads
HF_KEYS = {
    "qwen3_moe": "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads hidden_act max_position_embeddings initializer_range rms_norm_eps "
    "use_cache tie_word_embeddings rope_parameters attention_bias use_sliding_window "
    "sliding_window attention_dropout decoder_sparse_step moe_intermediate_size "
    "num_experts_per_tok num_experts norm_topk_prob output_router_logits router_aux_loss_coef "
    "mlp_only_layers pad_token_id bos_token_id eos_token_id",
    "deepseek_v3": "moe_intermediate_size n_shared_experts n_routed_experts routed_scaling_factor "
    "kv_lora_rank q_lora_rank qk_rope_head_dim v_head_dim qk_nope_head_dim n_group topk_group "
    "first_k_dense_replace norm_topk_prob pretraining_tp rope_interleave head_dim",
    "gpt_oss": "num_local_experts head_dim sliding_window swiglu_alpha swiglu_limit layer_types",
    "llama4": "intermediate_size_mlp moe_layers interleave_moe_layer_step use_qk_norm "
    "no_rope_layers no_rope_layer_interval attention_chunk_size layer_types "
    "attn_temperature_tuning floor_scale attn_scale router_jitter_noise vision_config "
    "text_config boi_token_index eoi_token_index image_token_index",
    "other families": "n_layer num_layers n_head num_heads ffn_hidden_size mlp_intermediate_size "
    "dense_intermediate_size tie_embedding qk_head_dim q_head_dim o_lora_rank "
    "sliding_window_size sliding_window_period swa_num_attention_heads swa_num_key_value_heads "
    "swa_head_dim num_global_key_value_heads num_experts_per_token moe_topk "
    "moe_shared_expert_intermediate_size shared_intermediate_size expert_intermediate_size "
    "num_dense_layers moe_layers_enum moe_layer_offset mlp_layer_types mtp_num_hidden_layers",
}


@pytest.mark.parametrize("family", sorted(HF_KEYS))
def test_real_hf_config_keys_are_never_taken_for_typos(family):
    cfg = {key: 1 for key in HF_KEYS[family].split()}
    check_key_typos(cfg, "config.json")  # raises on a near miss
    assert set(cfg) <= READ_KEYS | IGNORED_KEYS


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from planner.cli import main; sys.exit(main())", *args],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_generic_fallback_is_one_warning_line_showing_what_was_read(tmp_path):
    path = _write(tmp_path, {**USER_MOE, "model_type": "qwen3moe"})
    proc = _run_cli("model-info", str(path), "--json")
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["total_params"] > 0
    assert proc.stderr == (
        f"WARNING planner.inputs.families: {path}: model_type 'qwen3moe' is not a supported "
        "family; read it as a generic MoE model with Piper's generic keys: took hidden_size=64, "
        "vocab_size=100, num_hidden_layers=2, num_attention_heads=4, num_experts=8, "
        "num_experts_per_tok=2, intermediate_size=128; defaults max_position_embeddings=4096, "
        "mlp_gated=True, num_key_value_heads=4, head_dim=16, attention_bias=False, "
        "n_shared_experts=0, first_k_dense_replace=0, moe_layer_freq=1, decoder_sparse_step=1, "
        "interleave_moe_layer_step=1, moe_layer_frequency=1, tie_word_embeddings=False, "
        "num_nextn_predict_layers=0; if the model is 'qwen3_moe', set model_type to it\n"
    )


def test_a_config_without_model_type_warns_too(caplog):
    caplog.set_level(logging.WARNING)
    cfg = {k: v for k, v in USER_MOE.items() if k != "model_type"}
    model = model_from_config(cfg, "m", "m.json")
    assert model.family == "moe"
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage().startswith("m.json: no model_type; read it as a generic MoE model")
    assert "took hidden_size=64," in record.getMessage()


def test_misspelt_published_count_is_an_error(tmp_path, capsys):
    cfg = _preset("mixtral-8x7b")
    cfg["_piper"]["published_total_param"] = cfg["_piper"].pop("published_total_params")
    path = _write(tmp_path, cfg)
    code, err = _model_info(capsys, path)
    assert code == 2
    assert err == (
        f"piper model-info: error: {path}: unknown key '_piper.published_total_param'; did you "
        "mean '_piper.published_total_params'? rename it (an unknown key is ignored)\n"
    )


@pytest.mark.parametrize(
    ("preset", "key"),
    [("qwen3-30b-a3b", "num_experts"), ("deepseek-v3", "n_routed_experts"),
     ("mixtral-8x7b", "num_local_experts")],
)  # fmt: skip
def test_a_missing_expert_count_names_the_familys_own_key_first(tmp_path, capsys, preset, key):
    cfg = _preset(preset)
    cfg.pop(key)
    code, err = _model_info(capsys, _write(tmp_path, cfg))
    assert code == 2
    assert err.split(": missing key ")[1].startswith(f"'{key}' or ")
