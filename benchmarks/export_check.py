"""Each export checked by the tool it is for, on the plans a new user would make first.

Plans: DeepSeek-V3 (h100, 1024), Qwen3-30B-A3B (h100, 64), Llama-4 Scout (h100, 32, ZeRO,
full recompute), GPT-OSS-20B (h100, 16) and the default `piper plan`. For each:
- Megatron-LM: with `--megatron-lm PATH` (a checkout; core_r0.16.0 runs on Python 3.11, main
  needs 3.12), its own `parse_args` + `validate_args` + `core_transformer_config_from_args`
  on the exported MEGATRON_ARGS plus only tokenizer and data flags, in the environment the
  export sets (WORLD_SIZE = the plan's world). The GPU is emulated as an H100 (compute
  capability 9.0) and Transformer Engine as present, the two things a CPU lacks.
- torchtitan 0.3: when `torchtitan` imports (it needs `triton`, and `transformers` for the
  models it lacks), `ConfigManager().parse_args(TORCHTITAN_ARGS)` and each value compared
  with the plan.
- Slurm: `bash -n`, `shellcheck` when installed, and the script run outside an allocation
  (its dry run), for Piper's runtime and for Megatron-LM.
The export tests' every-knob plan (vp, cp, etp and folded ep, recompute modules, FSDP, bf16
moments, FP8 or bf16, the all-to-all overlap, DeepEP, MTP on DeepSeek-V3) is checked too.

    python benchmarks/export_check.py [--megatron-lm PATH ...] [--python PY ...] [--no-results]

Writes what it prints to results/export_check.md (--results FILE elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from results_md import ROOT, recorded

from planner.cli import main as piper_main
from planner.outputs.export import export_plan
from planner.plan import Plan, load_plan

CASES = {
    "deepseek-v3 h100 1024": ["--model", "deepseek-v3", "--cluster", "h100", "--gpus", "1024"],
    "qwen3-30b-a3b h100 64": ["--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "64"],
    "llama4-scout h100 32 zero full": ["--model", "llama4-scout", "--cluster", "h100",
                                       "--gpus", "32", "--zero", "--recompute", "full"],
    "gpt-oss-20b h100 16": ["--model", "gpt-oss-20b", "--cluster", "h100", "--gpus", "16"],
    "default": [],
}  # fmt: skip
# What a user adds to the Megatron export: a tokenizer and data (mock data here).
DATA_FLAGS = ["--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "10",
              "--lr", "1e-4"]  # fmt: skip

# Runs inside the checkout's Python: Megatron-LM's own argument code on the exported flags.
MEGATRON_DRIVER = r"""
import json, sys
checkout, argv = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, checkout)
import torch
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # an H100
import megatron.core.utils as core_utils
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import transformer_config
from megatron.training import arguments
for module in (core_utils, transformer_config, arguments):  # Transformer Engine present
    if hasattr(module, "is_te_min_version"):
        module.is_te_min_version = lambda *a, **k: True
rope_utils.fused_apply_rotary_pos_emb = lambda *a, **k: None
arguments.get_device_arch_version = lambda: 9
sys.argv = ["pretrain_gpt.py", *argv]
args = arguments.parse_args()
arguments.validate_args(args)
config = arguments.core_transformer_config_from_args(args)
keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size",
        "micro_batch_size", "global_batch_size", "virtual_pipeline_model_parallel_size",
        "num_moe_experts", "moe_router_topk", "moe_router_score_function", "rotary_base")
out = {k: getattr(config, k, getattr(args, k, None)) for k in keys}
out["config"] = type(config).__name__
print("PIPER_RESULT " + json.dumps(out, default=str))
"""


def quiet_piper(argv: list[str]) -> int:
    """`piper ARGV` with its printed summary and notes kept off the report."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return piper_main(argv)


def make_plans(folder: Path) -> dict[str, Path]:
    """Run `piper plan` for every case into `folder`, plus the export tests' every-knob plan
    (tests/planner/outputs/export_plans.py); returns case -> plan.json."""
    from tests.planner.outputs.export_plans import knob_plan

    paths = {}
    for name, argv in CASES.items():
        out = folder / name.replace(" ", "_")
        if quiet_piper(["plan", *argv, "--out", str(out)]) != 0:
            raise SystemExit(f"piper plan failed for {name}")
        paths[name] = out / "plan.json"
    for dtype in ("fp8", "bf16"):
        out = folder / f"every_knob_{dtype}"
        out.mkdir()
        (out / "plan.json").write_text(knob_plan(dtype).to_json())
        paths[f"every knob ({dtype})"] = out / "plan.json"
    return paths


def bash_array(text: str, name: str) -> list[str]:
    script = f'{text}\nprintf "%s\\n" "${{{name}[@]}}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          check=True).stdout.splitlines()  # fmt: skip


def check_megatron(plan: Plan, checkout: str, python: str) -> str:
    """Megatron-LM's parse_args + validate_args on the export; one line of outcome."""
    text = export_plan(plan, "megatron").text
    argv = bash_array(text, "MEGATRON_ARGS") + DATA_FLAGS
    argv += ["--vocab-size", str(plan.model_spec().vocab_size)]
    p = plan.parallel
    env = {**os.environ, "WORLD_SIZE": str(p.pp * p.dp * p.tp * p.cp), "RANK": "0"}
    env.update(line.split("=", 1) for line in bash_env(text))
    run = subprocess.run([python, "-c", MEGATRON_DRIVER, checkout, json.dumps(argv)],
                         capture_output=True, text=True, env=env, cwd=checkout)  # fmt: skip
    result = [ln for ln in run.stdout.splitlines() if ln.startswith("PIPER_RESULT ")]
    if run.returncode or not result:
        lines = (run.stderr or run.stdout).strip().splitlines()
        return "FAIL " + (lines[-1] if lines else f"exit {run.returncode}")
    got = json.loads(result[0].removeprefix("PIPER_RESULT "))
    want = {"tensor_model_parallel_size": p.tp, "pipeline_model_parallel_size": p.pp,
            "context_parallel_size": p.cp, "expert_model_parallel_size": p.ep,
            "data_parallel_size": p.dp,
            "micro_batch_size": p.micro_batch}  # fmt: skip
    wrong = [f"{k}={got.get(k)} (plan {v})" for k, v in want.items() if got.get(k) != v]
    if wrong:
        return "FAIL values differ: " + ", ".join(wrong)
    return (f"ok: {got['config']}, dp {got['data_parallel_size']}, router "
            f"{got['moe_router_score_function']}, rotary_base {got['rotary_base']}")  # fmt: skip


def bash_env(text: str) -> list[str]:
    """NAME=VALUE of the variables the export exports."""
    names = [ln.split()[1].split("=")[0] for ln in text.splitlines() if ln.startswith("export ")]
    script = text + "\n" + "".join(f'echo "{n}=${{{n}}}"\n' for n in names)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          check=True).stdout.splitlines()  # fmt: skip


def check_torchtitan(plan: Plan) -> str:
    """torchtitan's ConfigManager on the export, each value compared with the plan."""
    try:
        from torchtitan.config.manager import ConfigManager
    except ImportError as exc:
        return f"skipped (torchtitan does not import: {exc})"
    args = bash_array(export_plan(plan, "torchtitan").text, "TORCHTITAN_ARGS")
    try:
        config = ConfigManager().parse_args(args)
    except (SystemExit, Exception) as exc:  # tyro exits on a bad flag
        return f"FAIL {type(exc).__name__}: {exc}"
    p, par, tr = plan.parallel, config.parallelism, config.training
    want = {"pipeline_parallel_degree": p.pp, "tensor_parallel_degree": p.tp,
            "context_parallel_degree": p.cp, "expert_parallel_degree": p.ep,
            "pipeline_parallel_microbatch_size": p.micro_batch}  # fmt: skip
    wrong = [f"{k}={getattr(par, k)}" for k, v in want.items() if getattr(par, k) != v]
    dp = par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    if dp != p.dp:
        wrong.append(f"dp {dp} (plan {p.dp})")
    if tr.global_batch_size != p.dp * p.micro_batch * p.num_microbatches:
        wrong.append(f"global_batch_size {tr.global_batch_size}")
    if wrong:
        return "FAIL " + ", ".join(wrong)
    name = config.model_spec.name if config.model_spec else type(config).__name__
    ac = config.activation_checkpoint
    ac_name = type(ac).__qualname__.split(".")[0] if ac is not None else "no AC"
    return (f"ok: {name}, dp {par.data_parallel_replicate_degree}x"
            f"{par.data_parallel_shard_degree}, local batch {tr.local_batch_size}, "
            f"{ac_name}")  # fmt: skip


def check_slurm(plan_path: Path, folder: Path, trainer: str) -> str:
    """bash -n, shellcheck and the dry run outside an allocation of the sbatch script."""
    script = folder / f"{trainer}.sbatch"
    argv = ["export", str(plan_path), "--to", "slurm", "--trainer", trainer, "--out", str(script)]
    if trainer == "megatron":
        args_file = folder / "megatron_args.sh"
        quiet_piper(["export", str(plan_path), "--to", "megatron", "--out", str(args_file)])
        argv += ["--args-file", str(args_file)]
    quiet_piper(argv)
    steps = [("bash -n", ["bash", "-n", str(script)])]
    if shutil.which("shellcheck"):
        steps.append(("shellcheck", ["shellcheck", str(script)]))
    done = []
    for name, cmd in steps:
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            return f"FAIL {name}: {(run.stdout + run.stderr).strip().splitlines()[0]}"
        done.append(name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PIPER_HOSTFILE"] = str(folder / f"{trainer}.hosts")
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    if run.returncode or "srun" not in run.stdout:
        return f"FAIL dry run: {(run.stderr or run.stdout).strip()}"
    hosts = (folder / f"{trainer}.hosts").read_text().split()
    return f"ok: {', '.join(done)}, dry run ({len(hosts)} ranks in the hostfile)"


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plans = make_plans(folder)
        failed = 0
        for name, path in plans.items():
            plan = load_plan(path)
            p = plan.parallel
            print(f"{name}: pp={p.pp} vp={p.vp} dp={p.dp} tp={p.tp} cp={p.cp} ep={p.ep} "
                  f"etp={p.etp} mb={p.micro_batch} m={p.num_microbatches} "
                  f"recompute={p.recompute}")  # fmt: skip
            pythons = args.python * len(args.megatron_lm) if len(args.python) == 1 else args.python
            outcomes = {
                f"megatron-lm {Path(root).name}": check_megatron(plan, root, python)
                for root, python in zip(args.megatron_lm, pythons, strict=True)
            } or {"megatron-lm": "skipped (no --megatron-lm checkout)"}
            outcomes |= {
                "torchtitan": check_torchtitan(plan) if "fp8" not in name else
                "skipped (torchtitan's float8 config needs an SM89+ GPU to build; the bf16 "
                "plan checks every other value)",
                "slurm piper": check_slurm(path, path.parent, "piper"),
                "slurm megatron": check_slurm(path, path.parent, "megatron"),
            }  # fmt: skip
            width = max(map(len, outcomes))
            for what, outcome in outcomes.items():
                print(f"  {what:{width}s} {outcome}")
                failed += outcome.startswith("FAIL")
        print(f"{failed} checks failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--megatron-lm",
        nargs="+",
        default=[],
        metavar="PATH",
        help="Megatron-LM checkouts to run validate_args from",
    )
    ap.add_argument("--python", nargs="+", default=[sys.executable], metavar="PY",
                    help="the Python (with torch and triton) that runs each checkout, or one "
                    "for all (main needs Python >= 3.12)")  # fmt: skip
    ap.add_argument("--results", default=str(ROOT / "results/export_check.md"))
    ap.add_argument("--no-results", action="store_true", help="print only")
    args = ap.parse_args()
    with recorded(args.results, "Exports checked by each tool", enabled=not args.no_results):
        run(args)


if __name__ == "__main__":
    main()
