"""`python -m runtime.launch` applies the run options that live outside the RunSpec: --data
(the sampler and the model's vocabulary), --precision and --expert-gemm. One process,
in-process, on a one-rank plan."""

from __future__ import annotations

import json

import numpy as np
import torch.distributed as dist

import runtime.launch as launch
from planner.inputs.models import load_model, model_config
from planner.plan import ModelEntry
from runtime.data import TokenSampler
from tests.runtime.conftest import free_port
from tests.runtime.tiny_plans import hand_plan


def test_the_launcher_trains_on_the_token_file_in_bf16_with_the_chosen_gemm(tmp_path, monkeypatch):
    model = load_model("tiny-moe")
    entry = ModelEntry("tiny-moe", model.source, model_config(model))
    plan = hand_plan(model, 1, 1, 1, micro_batch=2, num_microbatches=1, seq_len=32,
                     gpus_per_node=1, model_entry=entry)  # fmt: skip
    (tmp_path / "plan.json").write_text(plan.to_json())
    ids = (np.arange(20_000) * 7919 % 400).astype(np.uint16)  # ids up to 399
    ids.tofile(tmp_path / "train.bin")
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)  # fmt: skip
    seen = {}
    real_train = launch.train

    def spy(trainer, **kwargs):
        experts = [m.experts.gemm for m in trainer.module.moe_layers().values()]
        seen.update(dtype=trainer.compute_dtype, sample=trainer.sample, gemm=set(experts))
        seen["vocab"] = trainer.spec.model.vocab_size
        return real_train(trainer, **kwargs)

    monkeypatch.setattr(launch, "train", spy)
    argv = ["--plan", str(tmp_path / "plan.json"), "--steps", "2", "--scale", "0.5"]
    argv += ["--data", str(tmp_path / "train.bin"), "--precision", "bf16"]
    argv += ["--expert-gemm", "loop", "--out", str(tmp_path / "run")]
    assert launch.main(argv) == 0
    assert not dist.is_initialized()
    assert (seen["dtype"], seen["gemm"], seen["vocab"]) == ("bf16", {"loop"}, 400)
    assert isinstance(seen["sample"], TokenSampler)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and abs(json.loads(lines[0])["loss"] - np.log(400)) < 0.6
