"""The torchtitan config module `piper export --to torchtitan` writes for a model torchtitan 0.3
has no config function of its own for: its shapes are the plan's, its parameter count (from
the shapes it hands torchtitan's modules) is Piper's, and the CLI writes it beside the args
file that puts it on PYTHONPATH. Runs without torchtitan (the module is read, not imported)."""

from __future__ import annotations

import ast
import json
import subprocess
from dataclasses import replace

import pytest

from planner.cli import main
from planner.inputs.models import resolve_model
from planner.outputs.export import export_plan
from planner.outputs.export.model_settings import model_settings
from planner.outputs.export.stamp import plan_stamp, stamped
from planner.outputs.export.torchtitan_model import composed_module
from planner.plan import load_plan
from planner.plan.settings import settings_of_model
from planner.resources.params import count_params
from planner.specs import SpecError
from planner.targets import TARGETS, check_model, not_composable
from tests.planner.outputs.export_plans import bash_array, make_plan, priced_for, with_model

COMPOSED = ["tiny-moe-deep", "mixtral-8x7b", "llama4-scout", "llama4-maverick"]


def titan_plan(name: str):
    """The hand-built 4-stage plan with model `name`, its layers split evenly, priced for
    torchtitan (FSDP, 4096 tokens)."""
    plan = with_model(make_plan(experts=()), name)
    n = plan.model_spec().num_layers
    cut = [n * i // 4 for i in range(5)]
    stages = tuple(replace(s, layers=tuple(range(cut[i], cut[i + 1])))
                   for i, s in enumerate(plan.stages))  # fmt: skip
    training = {**plan.training, "fsdp": True, "seq_len": 4096}
    return priced_for(replace(plan, stages=stages, training=training), "torchtitan")


def literals(text: str) -> dict[str, object]:
    """The module's top-level NAME = literal assignments."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def composed_params(v: dict[str, object]) -> int:
    """Parameters of the decoder the module composes, from its literals: torchtitan's GQA
    (wqkv fused, wo), RMSNorm weights, SwiGLU w1/w2/w3, router gate, grouped experts."""
    d, hd, ffn = v["DIM"], v["HEAD_DIM"], v["EXPERT_FFN"]
    attention = d * hd * (2 * v["N_HEADS"] + 2 * v["N_KV_HEADS"]) + 2 * d
    attention += 2 * hd if v["QK_NORM"] else 0
    moe = d * v["NUM_EXPERTS"] * (1 + 3 * ffn) + 3 * d * v["SHARED_FFN"]
    dense = 3 * d * v["DENSE_FFN"]
    layers = sum(moe if i in v["MOE_LAYERS"] else dense for i in range(v["N_LAYERS"]))
    embeddings = v["VOCAB_SIZE"] * d * (1 if v["TIE_EMBEDDINGS"] else 2)
    return embeddings + d + v["N_LAYERS"] * attention + layers


@pytest.mark.parametrize("name", COMPOSED)
def test_composed_module_carries_the_plans_model(name):
    plan = titan_plan(name)
    model = plan.model_spec()
    module, function, text, _ = composed_module(plan, model)
    compile(text, f"{module}.py", "exec")
    v = literals(text)
    attention, moe = model.layers[0].attention, model.first_moe
    assert (v["DIM"], v["VOCAB_SIZE"], v["N_LAYERS"]) == (
        model.hidden_size, model.vocab_size, model.num_layers)  # fmt: skip
    assert (v["N_HEADS"], v["N_KV_HEADS"], v["HEAD_DIM"]) == (
        attention.num_heads, attention.num_kv_heads, attention.head_dim)  # fmt: skip
    assert (v["NUM_EXPERTS"], v["TOP_K"], v["EXPERT_FFN"]) == (
        moe.num_experts, moe.top_k, moe.expert_ffn)  # fmt: skip
    assert v["SHARED_FFN"] == moe.num_shared_experts * moe.shared_ffn
    assert v["MOE_LAYERS"] == model.moe_layers
    settings = model_settings(plan, model)
    assert v["ROPE"]["theta"] == settings.rope_theta and v["ROPE"]["max_seq_len"] == 4096
    assert v["NORM_EPS"] == settings.norm_eps
    assert f"def {function}():" in text
    # Piper's count from the HF config, and torchtitan's modules of these shapes, agree
    assert composed_params(v) == count_params(model).total


def test_the_router_and_rotary_settings_are_the_models():
    mixtral = literals(composed_module(titan_plan("mixtral-8x7b"), titan_plan(
        "mixtral-8x7b").model_spec())[2])  # fmt: skip
    assert (mixtral["SCORE_FUNC"], mixtral["ROUTE_NORM"], mixtral["NORM_EPS"]) == (
        "softmax",
        True,
        1e-5,
    )  # Mixtral renormalizes its top-2 softmax
    assert mixtral["ROPE"] == {"max_seq_len": 4096, "theta": 1e6}  # Mixtral's rope_theta
    scout = titan_plan("llama4-scout")
    v = literals(composed_module(scout, scout.model_spec())[2])
    assert (v["SCORE_FUNC"], v["ROUTE_NORM"], v["TOP_K"]) == ("sigmoid", False, 1)


def test_llama4_notes_name_what_torchtitans_modules_compute_differently():
    scout = titan_plan("llama4-scout")
    notes = export_plan(scout, "torchtitan").notes
    assert any("NoPE" in n and "12 of 48" in n for n in notes)
    assert any("L2 QK norm" in n for n in notes)
    assert any("scales the expert input" in n for n in notes)
    assert not any("chunks" in n for n in notes)  # 4096 tokens fit one 8192-token chunk
    mixtral = titan_plan("mixtral-8x7b")
    assert export_plan(mixtral, "torchtitan").notes == ()  # Mixtral's own math


def test_a_hostile_model_name_stays_text_in_the_module(tmp_path):
    plan = titan_plan("tiny-moe-deep")
    evil = 'x"""; import os; os.system(\'touch PWNED\') #\n$(touch PWNED)'
    settings = settings_of_model(plan.model_spec())  # embedded: the source names no file
    plan = replace(plan, model=replace(plan.model, name=evil, source=evil, settings=settings))
    module, function, text, _ = composed_module(plan, plan.model_spec())
    assert module.isidentifier() and function.isidentifier()
    tree = ast.parse(text)
    kinds = {type(node).__name__ for node in tree.body}
    assert kinds <= {"Expr", "ImportFrom", "Import", "Assign", "FunctionDef"}
    imported = {n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert all(m.split(".")[0] in ("functools", "torch", "torchtitan") for m in imported)
    assert not any(isinstance(n, ast.Name) and n.id == "os" for n in ast.walk(tree))
    # the name reaches the code only as a string constant (the ModelSpec's flavor)
    assert any(isinstance(n, ast.Constant) and n.value == evil for n in ast.walk(tree))


@pytest.mark.parametrize(
    ("name", "why"),
    [("dbrx", "family is none of"), ("qwen2-57b-a14b", "family is none of")],
)
def test_models_torchtitan_cannot_build_are_refused_in_one_line(name, why):
    plan = titan_plan(name)
    with pytest.raises(SpecError, match=why) as err:
        export_plan(plan, "torchtitan")
    assert "\n" not in str(err.value) and "--target megatron" in str(err.value)


def test_not_composable_names_the_layer_and_shape():
    model = titan_plan("mixtral-8x7b").model_spec()
    assert not_composable(model) == ""
    check_model(model, TARGETS["torchtitan"])
    layers = list(model.layers)
    windowed = replace(layers[3].attention, sliding_window=4096)
    layers[3] = replace(layers[3], attention=windowed)
    assert "layer 3 differs" in not_composable(replace(model, layers=tuple(layers)))
    every = tuple(replace(layer, attention=windowed) for layer in model.layers)
    assert "sliding window" in not_composable(replace(model, layers=every))
    biased = tuple(replace(layer, moe=replace(layer.moe, expert_bias=True)) for layer in every)
    assert "layer 0" in not_composable(replace(model, layers=biased))
    dense = tuple(replace(layer, kind="dense", moe=None, dense_ffn=64) for layer in model.layers)
    assert not_composable(replace(model, layers=dense)) == "it has no MoE layer"
    with pytest.raises(SpecError, match="sliding window"):
        check_model(replace(model, layers=every), TARGETS["torchtitan"])


def test_cli_writes_the_module_beside_the_args_file_that_puts_it_on_pythonpath(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(titan_plan("mixtral-8x7b").to_json())
    out = tmp_path / "job" / "torchtitan_args.sh"
    assert main(["export", str(plan_path), "--to", "torchtitan", "--out", str(out)]) == 0
    module = out.parent / "piper_titan_mixtral_8x7b.py"
    assert sorted(p.name for p in out.parent.iterdir()) == [module.name, out.name]
    text, _ = module.read_text(), capsys.readouterr()
    plan = load_plan(plan_path)
    stamp = plan_stamp(plan, plan_path.read_bytes())  # its first line: which plan it is for
    assert text == stamped(composed_module(plan, plan.model_spec())[2], stamp)
    work = tmp_path / "elsewhere"
    work.mkdir()
    shown = subprocess.run(
        ["bash", "-c", f'source {out}; printf "%s\\n" "$PYTHONPATH" "${{TORCHTITAN_ARGS[@]}}"'],
        cwd=work, capture_output=True, text=True, check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "/opt/x"},
    ).stdout.splitlines()  # fmt: skip
    assert shown[0] == f"{out.parent}:/opt/x"
    assert shown[1:5] == ["--module", "piper_titan_mixtral_8x7b", "--config", "piper_mixtral_8x7b"]
    assert shown[1:] == bash_array(out.read_text(), "TORCHTITAN_ARGS")


def test_cli_without_out_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(titan_plan("llama4-scout").to_json())
    assert main(["export", str(plan_path), "--to", "torchtitan"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "piper_titan_llama4_scout.py" in err[0] and "--out" in err[0]
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_sourcing_the_args_file_without_its_module_is_one_line(tmp_path):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(titan_plan("mixtral-8x7b").to_json())
    out = tmp_path / "job" / "torchtitan_args.sh"
    assert main(["export", str(plan_path), "--to", "torchtitan", "--out", str(out)]) == 0
    (out.parent / "piper_titan_mixtral_8x7b.py").unlink()
    run = subprocess.run(["bash", "-c", f"set -euo pipefail; source {out}; echo started"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 1 and "started" not in run.stdout
    assert run.stderr.strip().splitlines() == [
        f"piper: {out.parent}/piper_titan_mixtral_8x7b.py is missing: write it with piper "
        f"export --to torchtitan --out {out}"
    ]


def test_llama4_nope_layers_follow_the_configs_interval(tmp_path):
    """Llama4TextConfig: a NoPE layer every `no_rope_layer_interval` layers (default 4)."""
    cfg, _, _ = resolve_model("llama4-scout")
    cfg["text_config"]["no_rope_layer_interval"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    plan = titan_plan("llama4-scout")
    plan = replace(plan, model=replace(plan.model, source=str(path)))
    assert model_settings(plan, plan.model_spec()).nope_layers == tuple(range(1, 48, 2))
    assert any("24 of 48" in n for n in composed_module(plan, plan.model_spec())[3])
