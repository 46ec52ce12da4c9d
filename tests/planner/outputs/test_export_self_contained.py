"""plan.json is self-contained: a plan made from a config.json exports the same bytes (Megatron,
torchtitan, Slurm), and `piper run` builds the same spec, after that file moved; its
`model.settings` carry the config's rotary, norm and router settings, and its hash covers them.

The oracle is the config file itself: the flags before the move carry its values (not the
family's defaults), and nothing changes when it is gone.
"""

from __future__ import annotations

import json
import shutil

import pytest

from planner.plan import load_plan
from planner.run.options import RunOptions
from planner.run.spec import checked_spec
from tests.hardening_cli import run_piper
from tests.planner.outputs.test_plan_numerics import GPT_OSS_TINY

# Qwen3-MoE in miniature: a rotary base, norm epsilon and top-k renormalization of its own,
# none of them the family's defaults (10000, 1e-5, softmax before top-k)
QWEN3_TINY = {
    "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 4096,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
}  # fmt: skip
# Mixtral in miniature for torchtitan's composed model: its own rotary base and epsilon
MIXTRAL_TINY = {
    "model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "intermediate_size": 32, "vocab_size": 256,
    "max_position_embeddings": 4096, "rope_theta": 250000.0, "rms_norm_eps": 1e-6,
    "router_aux_loss_coef": 0.02,
}  # fmt: skip


def _plan(folder, cfg: dict, target: str, gpus: int = 2) -> tuple:
    """(config path, plan.json path) of `piper plan` on `cfg` saved as folder/model/config.json."""
    config = folder / "model" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(cfg))
    out = folder / "plan"
    result = run_piper(["plan", "--model", str(config), "--cluster", "cpu-gloo", "--gpus",
                        str(gpus), "--seq-len", "64", "--global-batch", "8", "--target", target,
                        "--out", str(out)])  # fmt: skip
    assert result.code == 0, result.stderr
    return config, out / "plan.json"


@pytest.fixture(scope="module")
def qwen_plan(tmp_path_factory):
    """plan.json of QWEN3_TINY for Megatron, its config left in place (read, not changed)."""
    return _plan(tmp_path_factory.mktemp("qwen"), QWEN3_TINY, "megatron")[1]


def _export(plan, to: str) -> str:
    result = run_piper(["export", str(plan), "--to", to])
    assert result.code == 0, result.stderr
    return result.stdout


def _flag(text: str, flag: str) -> str | None:
    """The value after `flag` in an export ("" for a switch), None when it is absent."""
    words = text.split()
    if flag not in words:
        return None
    value = words[words.index(flag) + 1]
    return "" if value.startswith("--") else value


def _slurm_files(plan, out) -> dict[str, bytes]:
    """The files `piper export PLAN --to slurm --out out/job.sh` writes (out made afresh)."""
    shutil.rmtree(out, ignore_errors=True)
    result = run_piper(["export", str(plan), "--to", "slurm", "--out", str(out / "job.sh")])
    assert result.code == 0, result.stderr
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize(
    ("cfg", "flags"),
    [
        (QWEN3_TINY, {"--rotary-base": "1000000", "--norm-epsilon": "1e-06",
                      "--moe-router-pre-softmax": None}),
        # GPT-OSS: its own clamp (the family's is 7), windows and sinks from the shapes
        (GPT_OSS_TINY, {"--activation-func-clamp-value": "5", "--rotary-base": "150000",
                        "--window-size": "4,0", "--softmax-type": "learnable",
                        "--moe-aux-loss-coeff": "0.9"}),
    ],
    ids=["qwen3", "gpt-oss"],
)  # fmt: skip
def test_megatron_and_slurm_exports_are_the_same_after_the_config_moved(tmp_path, cfg, flags):
    config, plan = _plan(tmp_path, cfg, "megatron")
    before = _export(plan, "megatron")
    assert {flag: _flag(before, flag) for flag in flags} == flags
    job = _slurm_files(plan, tmp_path / "job")
    assert f"--rotary-base {flags['--rotary-base']}".encode() in job["megatron_args.sh"]
    shutil.move(config.parent, tmp_path / "renamed")
    assert _export(plan, "megatron") == before
    shutil.rmtree(tmp_path / "renamed")
    assert _export(plan, "megatron") == before
    assert _slurm_files(plan, tmp_path / "job") == job
    assert "no HF config" not in before


def test_torchtitan_export_is_the_same_after_the_config_moved(tmp_path):
    config, plan = _plan(tmp_path, MIXTRAL_TINY, "torchtitan")
    out = tmp_path / "titan"
    result = run_piper(["export", str(plan), "--to", "torchtitan", "--out", str(out / "job.sh")])
    assert result.code == 0, result.stderr
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    module = next(text.decode() for name, text in files.items() if name.endswith(".py"))
    assert "ROPE = {'max_seq_len': 64, 'theta': 250000.0}" in module  # not Mixtral's 1e6
    assert "NORM_EPS = 1e-06" in module  # not the default 1e-5
    config.unlink()
    shutil.rmtree(out)
    result = run_piper(["export", str(plan), "--to", "torchtitan", "--out", str(out / "job.sh")])
    assert result.code == 0, result.stderr
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir())} == files


def test_run_spec_is_the_same_after_the_config_moved(tmp_path):
    config, plan = _plan(tmp_path, QWEN3_TINY, "piper", gpus=1)
    before = checked_spec(RunOptions(str(plan)))
    assert before.arch.rope.theta == 1e6 and before.arch.norm_eps == 1e-6
    config.unlink()
    assert checked_spec(RunOptions(str(plan))) == before


def test_the_plans_hash_covers_the_settings(qwen_plan, tmp_path):
    """Two configs that differ only in a setting the shapes and the runtime's numerics leave
    out (the aux-loss weight) make plans of different settings and different hashes."""
    a = qwen_plan
    _, b = _plan(tmp_path, {**QWEN3_TINY, "router_aux_loss_coef": 0.05}, "megatron")
    pa, pb = load_plan(a), load_plan(b)
    assert pa.model.settings is not None and pb.model.settings is not None
    assert (pa.model.settings.aux_loss_coeff, pb.model.settings.aux_loss_coeff) == (0.001, 0.05)
    assert pa.inputs_sha256 != pb.inputs_sha256
    assert pa.to_json() == a.read_text()  # the settings write back byte-identical


def test_a_plan_without_settings_whose_config_is_gone_is_refused(tmp_path):
    """A plan written without `model.settings` (hand-written, or by an older Piper) reads the
    config it names; when that file is gone the export is one line, exit 2, not defaults."""
    config, plan = _plan(tmp_path, QWEN3_TINY, "megatron")
    d = json.loads(plan.read_text())
    del d["model"]["settings"]
    plan.write_text(json.dumps(d))
    assert _export(plan, "megatron") == _export(plan, "megatron")  # read from the config
    assert _flag(_export(plan, "megatron"), "--rotary-base") == "1000000"
    config.unlink()
    result = run_piper(["export", str(plan), "--to", "megatron", "--out", str(tmp_path / "x.sh")])
    assert result.code == 2 and len(result.err_lines) == 1, result.stderr
    assert "has no model.settings" in result.stderr and "re-run 'piper plan'" in result.stderr
    assert not (tmp_path / "x.sh").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update(rope_thetta=1.0), "unknown key 'rope_thetta' (did you mean"),
        (lambda s: s.update(rope_theta="big"), "'model.settings.rope_theta' must be a number"),
        (lambda s: s.update(router_score="relu"), "'model.settings.router_score' must be one of"),
        (lambda s: s.pop("norm_eps"), "'model.settings.norm_eps' is missing"),
        (lambda s: s.update(nope_layers=[1, True]), "must be a list of layer indices"),
        (lambda s: s.update(rope_scaling={"kind": "yarn", "factor": 4, "beta": 1}),
         "'model.settings.rope_scaling' has an unknown key 'beta'"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_in_one_line(qwen_plan, tmp_path, change, message):
    d = json.loads(qwen_plan.read_text())
    plan = tmp_path / "plan.json"
    change(d["model"]["settings"])
    plan.write_text(json.dumps(d))
    result = run_piper(["export", str(plan), "--to", "megatron"])
    assert result.code == 2 and len(result.err_lines) == 1, result.stderr
    assert message in result.stderr and "regenerate the plan" in result.stderr


def test_a_config_setting_plan_json_would_refuse_stops_the_plan_in_one_line(tmp_path):
    """The writer and the reader agree: a config whose setting plan.json could not read back
    (YaRN's original context 0) is refused by `piper plan` before the search, nothing written."""
    config = tmp_path / "config.json"
    scaling = {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 0}
    config.write_text(json.dumps({**QWEN3_TINY, "rope_scaling": scaling}))
    out = tmp_path / "plan"
    result = run_piper(["plan", "--model", str(config), "--cluster", "cpu-gloo", "--gpus", "2",
                        "--seq-len", "64", "--global-batch", "8", "--out", str(out)])  # fmt: skip
    assert result.code == 2 and len(result.err_lines) == 1, result.stderr
    assert "rope_scaling.original_max_position_embeddings' must be an integer >= 1" in result.stderr
    assert "fix that key in the config" in result.stderr and not out.exists()
