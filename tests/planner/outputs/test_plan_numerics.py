"""plan.json's `model.numerics`: `piper plan` writes the numerics keys of the model's config.json,
the reader checks them (one line, exit 2), and a plan without them reads and runs as before.

The oracle is the config file itself: the section holds exactly the keys the one parser
(arch_from_hf_config) reads, with the config's values, so the ModelArch of the plan is the
ModelArch of the config."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import planner.inputs.numerics as numerics
from planner.cli import main
from planner.inputs.models import list_model_presets, resolve_model
from planner.inputs.numerics import (
    NUMERICS_KEYS,
    ROPE_KEYS,
    ModelArch,
    arch_from_hf_config,
    numerics_of_config,
)
from planner.plan import load_plan
from planner.run.numerics import DEFAULT_ARCH, PLAN_ARCH
from planner.run.options import RunOptions
from planner.run.spec import checked_spec
from planner.specs import SpecError

# a tiny GPT-OSS-style config: YaRN in the older `rope_scaling` form beside a top-level theta,
# a swiglu_limit of its own, and keys the numerics leave out (low_freq_factor, the aux loss)
GPT_OSS_TINY = {
    "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
    "vocab_size": 256, "sliding_window": 4, "max_position_embeddings": 4096,
    "layer_types": ["sliding_attention", "full_attention"], "rms_norm_eps": 1e-5,
    "rope_theta": 150000, "swiglu_limit": 5.0, "router_aux_loss_coef": 0.9,
    "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 512,
                     "low_freq_factor": 1.0},
}  # fmt: skip


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """(config path, plan.json path) of `piper plan` on GPT_OSS_TINY, one CPU rank."""
    root = tmp_path_factory.mktemp("numerics")
    config = root / "config.json"
    config.write_text(json.dumps(GPT_OSS_TINY))
    out = root / "plan"
    argv = ["plan", "--model", str(config), "--cluster", "cpu-gloo", "--gpus", "1",
            "--seq-len", "32", "--global-batch", "2", "--target", "piper", "--dtype", "fp32",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return config, out / "plan.json"


def test_the_plan_carries_the_configs_numerics_keys_and_values(planned):
    _, path = planned
    section = json.loads(path.read_text())["model"]["numerics"]
    rope = {k: v for k, v in GPT_OSS_TINY["rope_scaling"].items() if k != "low_freq_factor"}
    assert section == {
        "model_type": "gpt_oss", "rope_theta": 150000, "rope_scaling": rope,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "swiglu_limit": 5.0,
    }  # fmt: skip
    assert load_plan(path).model.numerics == section  # read back as written


def test_the_plans_arch_is_the_configs_arch_field_by_field(planned):
    _, path = planned
    arch = arch_from_hf_config(dict(load_plan(path).model.numerics))
    assert arch == arch_from_hf_config(GPT_OSS_TINY)
    assert arch != ModelArch()
    assert (arch.rope.theta, arch.rope.kind, arch.rope.factor) == (150000.0, "yarn", 8.0)
    assert (arch.rope.original_max_positions, arch.rope.truncate) == (512, False)
    assert (arch.router, arch.norm_eps) == ("topk_softmax", 1e-5)
    assert (arch.swiglu_limit, arch.swiglu_alpha) == (5.0, 1.702)  # alpha: GPT-OSS's default


def test_piper_run_takes_the_plans_numerics(planned):
    _, path = planned
    spec = checked_spec(RunOptions(str(path)))
    assert spec.arch == arch_from_hf_config(GPT_OSS_TINY) and spec.arch_source == PLAN_ARCH


def test_a_plan_without_numerics_reads_back_and_runs_with_the_runtime_default(planned, tmp_path):
    _, path = planned
    plan = load_plan(path)
    old = replace(plan, model=replace(plan.model, numerics={}))
    text = old.to_json()
    assert "numerics" not in json.loads(text)["model"]
    (tmp_path / "plan.json").write_text(text)
    assert load_plan(tmp_path / "plan.json").to_json() == text
    spec = checked_spec(RunOptions(str(tmp_path / "plan.json")))
    assert spec.arch == ModelArch() and spec.arch_source == DEFAULT_ARCH


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_thetta": 1e6},
         "model.numerics: unknown key 'rope_thetta'; did you mean 'rope_theta'?"),
        ({"rms_norm_eps": "1e-5"},
         "model.numerics: key 'rms_norm_eps' must be a number in [0, 1e+30] or null, got '1e-5'"),
        ({"rope_scaling": {"rope_type": "yarn", "factr": 8.0}},
         "model.numerics.rope_scaling: unknown key 'factr'; did you mean 'factor'?"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": [8]}},
         "key 'rope_scaling.factor' must be a number"),
        ({"norm_topk_prob": 1}, "key 'norm_topk_prob' must be true or false or null, got 1"),
        ({"n_group": 2.5}, "key 'n_group' must be an integer"),
    ],
)  # fmt: skip
def test_a_bad_numerics_section_is_refused_in_one_line(planned, tmp_path, capsys, change, message):
    _, path = planned
    doc = json.loads(path.read_text())
    doc["model"]["numerics"].update(change)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(SpecError, match="regenerate the plan"):
        load_plan(bad)
    assert main(["run", str(bad), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"piper run: error: {bad}: model.numerics") and "\n" not in err
    assert message in err


def test_numerics_that_are_not_a_mapping_are_refused_in_one_line(planned, tmp_path, capsys):
    _, path = planned
    doc = json.loads(path.read_text())
    doc["model"]["numerics"] = [["rope_theta", 1e6]]
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "field 'model.numerics' has the wrong type (list" in err and "\n" not in err


def test_a_config_with_a_mistyped_numerics_key_is_refused_by_piper_plan(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**GPT_OSS_TINY, "rope_theta": "150k"}))
    argv = ["plan", "--model", str(config), "--cluster", "cpu-gloo", "--gpus", "1",
            "--seq-len", "32", "--global-batch", "2", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"{config}: key 'rope_theta' must be a number" in err and "\n" not in err
    assert not (tmp_path / "out").exists()  # nothing written


class _Recording(dict):
    """A dict that records every key the parser asks for."""

    def __init__(self, data, seen):
        super().__init__(data)
        self.seen = seen

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


@pytest.mark.parametrize("name", ["deepseek-v3", "gpt-oss-20b", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_the_key_lists_hold_every_key_the_parser_reads(name, monkeypatch):
    """The parser works on the selected keys; a key it reads beyond NUMERICS_KEYS / ROPE_KEYS
    would never reach it from a plan (and would always be absent): record its reads."""
    seen_top: set = set()
    seen_rope: set = set()
    select = numerics._select

    def recording_select(section, kinds, where, prefix=""):
        seen = seen_rope if prefix else seen_top
        return _Recording(select(section, kinds, where, prefix), seen)

    monkeypatch.setattr(numerics, "_select", recording_select)
    cfg, _, _ = resolve_model(name)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    for variant in (cfg, {**cfg, "rope_scaling": yarn}, {**cfg, "rope_parameters": yarn}):
        arch_from_hf_config(variant)
    assert seen_top and seen_top <= set(NUMERICS_KEYS)
    assert seen_rope and seen_rope <= set(ROPE_KEYS)


def test_every_preset_gives_its_numerics_and_the_same_arch_through_them():
    for name in list_model_presets():
        cfg, _, source = resolve_model(name)
        section = numerics_of_config(cfg, source)
        assert set(section) <= set(NUMERICS_KEYS)
        assert arch_from_hf_config(section) == arch_from_hf_config(cfg), name


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
         "model.numerics: rope_type 'llama3' is not supported by the runtime"),
        ({"model_type": "deepseek_v3", "n_group": 3, "topk_group": 1},
         "n_group=3, topk_group=1 do not fit layer 0's 4 experts, top-2"),
        ({"model_type": "deepseek_v3", "n_group": 4, "topk_group": 1},  # 1 expert kept < top-2
         "n_group=4, topk_group=1 do not fit layer 0's 4 experts, top-2"),
    ],
)  # fmt: skip
def test_numerics_the_runtime_cannot_run_are_refused_before_launch(
    planned, tmp_path, capsys, change, message
):
    _, path = planned
    doc = json.loads(path.read_text())
    doc["model"]["numerics"].update(change)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))
    load_plan(bad)  # a valid plan: other commands (export, calibrate) read it
    assert main(["run", str(bad), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"piper run: error: {bad}: ") and message in err and "\n" not in err
    n_group = dict(change, n_group=2, topk_group=1)
    if "n_group" in change:  # two groups of two experts, one kept: fits top-2
        doc["model"]["numerics"].update(n_group)
        bad.write_text(json.dumps(doc))
        spec = checked_spec(RunOptions(str(bad)))
        assert (spec.arch.router, spec.arch.num_groups, spec.arch.topk_groups) == ("sigmoid", 2, 1)
