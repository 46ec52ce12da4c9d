"""`piper plan` takes the optimizer-state flags `piper estimate` prices (offload to the host,
the precision-aware optimizer, the gradient dtype): they reach plan.json, the Megatron export
and the memory priced, and a combination Megatron-Core does not run is one line, exit 2."""

from __future__ import annotations

import json
from dataclasses import replace

from planner.calibrate.compare import estimate_plan
from planner.cli import main
from planner.plan.io import load_plan

BASE = ["plan", "--model", "tiny-moe", "--cluster", "h100", "--gpus", "8", "--target", "megatron",
        "--seq-len", "512", "--global-batch", "64"]  # fmt: skip


def test_offload_reaches_the_plan_and_its_memory(tmp_path, capsys):
    out = tmp_path / "p"
    assert main([*BASE, "--optimizer-offload-fraction", "0.5", "--precision-aware-optimizer",
                 "--grad-dtype", "bf16", "--out", str(out)]) == 0  # fmt: skip
    training = json.loads((out / "plan.json").read_text())["training"]
    assert training["optimizer_offload_fraction"] == 0.5
    assert training["precision_aware_optimizer"] and training["grad_dtype"] == "bf16"
    assert training["zero"] and not training["fsdp"]  # HybridDeviceOptimizer needs it
    plan = load_plan(out / "plan.json")
    on_device = replace(plan, training={**plan.training, "optimizer_offload_fraction": 0.0})
    # half the fp32 master + moments leave the device: less optimizer state on every stage
    for off, full in zip(estimate_plan(plan).stages, estimate_plan(on_device).stages, strict=True):
        assert dict(off.memory_gib)["optimizer"] < dict(full.memory_gib)["optimizer"]


def test_offload_with_fsdp_is_one_line(tmp_path, capsys):
    out = str(tmp_path / "q")
    rc = main([*BASE, "--fsdp", "--optimizer-offload-fraction", "0.5", "--out", out])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--optimizer-offload-fraction" in err and "--fsdp" in err
    assert not (tmp_path / "q").exists()


def test_other_targets_refuse_offload(tmp_path, capsys):
    argv = [a if a != "megatron" else "torchtitan" for a in BASE]
    assert main([*argv, "--optimizer-offload-fraction", "0.5", "--out", str(tmp_path / "r")]) == 2
    assert "--target megatron" in capsys.readouterr().err
