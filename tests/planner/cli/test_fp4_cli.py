"""FP4 and blockwise FP8 from the command line: `--dtype` takes every priced precision, the
layers `--bf16-layers` keeps in BF16 are priced in BF16, MFU is against the BF16 peak with the
low-precision figure labelled, a cluster without the format's peak is one line, and the
Megatron export carries the recipe and the BF16 layers."""

from __future__ import annotations

import json
import re

from tests.hardening_cli import run_piper

LAYOUT = ["--model", "deepseek-v3", "--gpus", "256", "--pp", "16", "--dp", "16", "--tp", "1",
          "--ep", "16", "--target", "megatron", "--json"]  # fmt: skip


def _step_s(*extra: str) -> float:
    result = run_piper(["estimate", "--cluster", "b200", *LAYOUT, *extra])
    assert result.code == 0, result.stderr
    return float(json.loads(result.stdout)["step_time_s"])


def test_bf16_layers_are_priced_in_bf16():
    nvfp4, kept, bf16 = (_step_s("--dtype", "nvfp4"),
                         _step_s("--dtype", "nvfp4", "--bf16-layers", "3,3"),
                         _step_s("--dtype", "bf16"))  # fmt: skip
    assert nvfp4 < kept < bf16


def test_mfu_is_against_the_bf16_peak_and_the_fp4_figure_labelled():
    argv = ["estimate", "--cluster", "b200", *LAYOUT[:-1], "--dtype", "nvfp4"]
    result = run_piper(argv)
    assert result.code == 0, result.stderr
    text = " ".join(result.stdout.split())
    found = re.search(r"(\d+) TFLOPS/GPU, MFU ([\d.]+)% of the BF16 peak, ([\d.]+)% of the NVFP4 "
                      r"peak", text)  # fmt: skip
    assert found, text[:400]
    tflops, bf16, fp4 = float(found[1]), float(found[2]), float(found[3])
    assert abs(bf16 - 100 * tflops / 2250) < 0.2 and abs(fp4 - 100 * tflops / 9000) < 0.1


def test_a_cluster_without_the_formats_peak_is_one_line_and_blockwise_fp8_runs_at_fp8():
    refused = run_piper(["estimate", "--cluster", "h100", *LAYOUT, "--dtype", "nvfp4"])
    assert refused.code == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "has no nvfp4 entry" in refused.stderr
    assert (
        run_piper(["estimate", "--cluster", "h100", *LAYOUT, "--dtype", "fp8_blockwise"]).code == 0
    )


def test_bad_bf16_layers_is_one_line():
    result = run_piper(["estimate", "--cluster", "b200", *LAYOUT, "--dtype", "nvfp4",
                        "--bf16-layers", "1"])  # fmt: skip
    assert result.code == 2 and "--bf16-layers '1': give two layer counts" in result.stderr


def test_the_megatron_export_carries_the_recipe_and_the_bf16_layers(tmp_path):
    out = tmp_path / "plan"
    planned = run_piper(["plan", "--model", "qwen3-30b-a3b", "--cluster", "b200", "--gpus", "16",
                         "--target", "megatron", "--dtype", "nvfp4", "--bf16-layers", "1,1",
                         "--no-plots", "--time-limit-s", "5", "--out", str(out)])  # fmt: skip
    assert planned.code == 0, planned.stderr
    args = tmp_path / "megatron_args.sh"
    exported = run_piper(["export", str(out / "plan.json"), "--to", "megatron", "--out", str(args)])
    assert exported.code == 0, exported.stderr
    text = args.read_text()
    assert "--fp4-format e2m1" in text and "--fp4-recipe nvfp4" in text
    assert "--num-layers-at-start-in-bf16 1" in text and "--num-layers-at-end-in-bf16 1" in text
