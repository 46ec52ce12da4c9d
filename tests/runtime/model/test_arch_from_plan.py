"""`piper run` builds the model's real numerics from plan.json alone (`model.numerics`).

A tiny DeepSeek-V3 (RoPE theta 50000 with YaRN on interleaved pairs, sigmoid router with
groups and a routed scaling factor, norm epsilon 1e-5) is saved with `save_pretrained` and
planned with `piper plan --model DIR/config.json`. The oracles: the config (the run's
ModelArch equals arch_from_hf_config(config), field by field), the `--hf-weights` path (the
same weights give the same logits, exactly) and Hugging Face's model (its logits to fp32
round-off, as in test_hf_equivalence.py). The runtime's default numerics give other logits,
so the comparison can fail.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from planner.cli import main
from planner.inputs.models import read_config_file
from planner.inputs.numerics import ModelArch, arch_from_hf_config
from planner.plan import load_plan
from planner.run.numerics import DEFAULT_ARCH, PLAN_ARCH
from planner.run.options import RunOptions
from planner.run.spec import checked_spec, run_spec_from_plan
from tests.runtime.model import test_hf_equivalence as hf_eq

transformers = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn", "rope_theta": 50000.0, "factor": 40.0, "mscale": 1.0,
    "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip


def _deepseek_theta(**extra):
    """test_hf_equivalence's tiny DeepSeek-V3 with theta 50000 and norm epsilon 1e-5."""
    return transformers.DeepseekV3Config(
        **{**hf_eq.COMMON, **extra}, intermediate_size=96, moe_intermediate_size=32,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, routed_scaling_factor=2.5,
        max_position_embeddings=2560, rope_parameters=YARN, rms_norm_eps=1e-5,
        num_nextn_predict_layers=0,  # MTP off: transformers has none
    )  # fmt: skip


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """(HF model, checkpoint directory, plan.json path): the checkpoint and `piper plan` of it
    on one CPU rank, fp32."""
    root = tmp_path_factory.mktemp("arch_from_plan")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(hf_eq.CONFIGS, "deepseek_theta", _deepseek_theta)
        hf = hf_eq.hf_reference("deepseek_theta", vocab_size=256)
    ckpt = root / "ckpt"
    hf.save_pretrained(ckpt)
    argv = ["plan", "--model", str(ckpt / "config.json"), "--cluster", "cpu-gloo", "--gpus", "1",
            "--pp", "1", "--tp", "1", "--ep", "1", "--seq-len", str(hf_eq.SEQ),
            "--global-batch", "2", "--target", "piper", "--dtype", "fp32",
            "--out", str(root / "plan")]  # fmt: skip
    assert main(argv) == 0
    return hf, ckpt, root / "plan" / "plan.json"


def test_the_run_of_the_plan_has_the_configs_arch(planned):
    _, ckpt, path = planned
    config = read_config_file(ckpt / "config.json")
    spec = checked_spec(RunOptions(str(path)))
    assert spec.arch_source == PLAN_ARCH
    assert spec.arch == arch_from_hf_config(config)
    rope = spec.arch.rope
    assert (rope.theta, rope.kind, rope.factor, rope.original_max_positions) == (
        config["rope_parameters"]["rope_theta"], "yarn", 40.0, 64
    )  # fmt: skip
    assert (rope.mscale, rope.mscale_all_dim, rope.interleave) == (1.0, 1.0, True)
    assert (spec.arch.router, spec.arch.num_groups, spec.arch.topk_groups) == ("sigmoid", 4, 2)
    assert (spec.arch.routed_scaling_factor, spec.arch.norm_topk_prob) == (2.5, True)
    assert spec.arch.norm_eps == config["rms_norm_eps"] == 1e-5


def _logits_body(rank: int, world: int, specs, ckpt: str, ids):
    """Each spec's one-rank model with the checkpoint's weights: its logits on `ids`."""
    from runtime.launch import build_trainer

    out = []
    for spec in specs:
        trainer = build_trainer(spec, rank, hf_weights=ckpt)
        with torch.no_grad():
            out.append(trainer.module(ids).numpy().copy())
    return out


def test_the_plans_numerics_give_the_hf_weights_paths_logits(planned, run_distributed):
    hf, ckpt, path = planned
    plan = load_plan(path)
    model = plan.model_spec(str(path))
    old = replace(plan, model=replace(plan.model, numerics={}))  # a plan without the section
    from_plan = run_spec_from_plan(plan, model, 1.0, 1, steps=1)
    from_hf = run_spec_from_plan(old, model, 1.0, 1, str(ckpt), steps=1)
    default = run_spec_from_plan(old, model, 1.0, 1, steps=1)
    assert (
        from_hf.arch == from_plan.arch and from_hf.arch_source == f"--hf-weights {ckpt}/config.json"
    )
    assert (default.arch, default.arch_source) == (ModelArch(), DEFAULT_ARCH)
    ids = hf_eq.tokens() + 100  # byte ids: vocabulary 256
    ours, theirs, runtime_default = run_distributed(
        _logits_body, 1, (from_plan, from_hf, default), str(ckpt), ids
    )[0]
    assert (ours == theirs).all()
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    torch.testing.assert_close(torch.from_numpy(ours), reference, **hf_eq.TOL)
    assert (abs(runtime_default - ours)).max() > 1e-2  # the numerics matter


def _run_lines(capsys, monkeypatch, argv) -> tuple[int, str, str]:
    """`piper run` up to the launch (torchrun replaced by a failing stub): exit, out, err."""
    import planner.cli.run as run_cli

    monkeypatch.setattr(run_cli, "_train", lambda *args: (1, False))
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def test_piper_run_says_where_its_numerics_come_from(planned, tmp_path, capsys, monkeypatch):
    _, ckpt, path = planned
    base = ["run", str(path), "--steps", "1", "--out", str(tmp_path / "run")]
    capsys.readouterr()
    _, out, _ = _run_lines(capsys, monkeypatch, base)
    assert out.splitlines()[0].endswith(", fp32 compute, numerics from plan.json model.numerics")
    _, out, _ = _run_lines(capsys, monkeypatch, [*base, "--hf-weights", str(ckpt)])
    assert out.splitlines()[0].endswith(
        f"numerics from plan.json model.numerics (= --hf-weights {ckpt}/config.json)"
    )


def test_hf_weights_that_disagree_with_the_plans_numerics_are_refused_in_one_line(
    planned, tmp_path, capsys, monkeypatch
):
    _, ckpt, path = planned
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 60000.0
    (other / "config.json").write_text(json.dumps(config))
    code, _, err = _run_lines(capsys, monkeypatch, ["run", str(path), "--hf-weights", str(other)])
    assert code == 2 and "\n" not in err
    assert err.startswith(f"piper run: error: {path}: --hf-weights {other}: ")
    assert (
        "rope_theta is 60000.0 in its config.json but 50000.0 in the plan's model.numerics" in err
    )
