"""Plans the export tests hand to each target: a small hand-built one, one using every
layout knob, and the plans a new user makes first (made once per test session)."""

from __future__ import annotations

import fcntl
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from planner.cli import main
from planner.inputs.models import load_model, model_config
from planner.plan import (
    ClusterEntry,
    ExpertPlacement,
    ModelEntry,
    ParallelPlan,
    Plan,
    Predicted,
    RankPlan,
    SolveReport,
    StagePlan,
    load_plan,
)
from planner.plan.settings import settings_of_model
from planner.targets import TARGETS

STAGES = ((0, 1, 2), (3, 4), (5, 6), (7,))  # first 3, middle 2 and 2, last 1
# node of each rank (2 ranks per node), deliberately not in rank order
NODE_OF_RANK = (2, 2, 0, 0, 3, 3, 1, 1)
LOCAL_OF_RANK = (1, 0, 0, 1, 0, 1, 1, 0)

# The plans a new user would make first (issue 16's list): name -> `piper plan` flags.
USER_PLANS = {
    "deepseek-v3": ["--model", "deepseek-v3", "--cluster", "h100", "--gpus", "1024"],
    "qwen3-30b-a3b": ["--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "64"],
    "llama4-scout": ["--model", "llama4-scout", "--cluster", "h100", "--gpus", "32", "--zero",
                     "--recompute", "full"],
    "gpt-oss-20b": ["--model", "gpt-oss-20b", "--cluster", "h100", "--gpus", "16"],
    "default": [],
}  # fmt: skip


def make_plan(stages=STAGES, recompute=(), zero=False, cluster="cpu-gloo", experts=None) -> Plan:
    """tiny-moe-deep on 8 ranks: pp 4, dp 2, tp 1, ep 2, by hand, priced for the piper
    target."""
    model = load_model("tiny-moe-deep")
    ranks = tuple(
        RankPlan(rank=r, node=NODE_OF_RANK[r], local_rank=LOCAL_OF_RANK[r], stage=r // 2,
                 dp=r % 2, tp=0, ep=r % 2)
        for r in range(8)
    )  # fmt: skip
    if experts is None:
        experts = tuple(ExpertPlacement(layer, (0, 0, 0, 0, 1, 1, 1, 1)) for layer in range(1, 8))
    rc = dict(recompute)
    return Plan(
        model=ModelEntry(
            model.name, model.source, model_config(model), settings=settings_of_model(model)
        ),
        cluster=ClusterEntry(cluster, gpus_per_node=2, profile={"num_nodes": 4}),
        training={
            "seq_len": 128,
            "global_batch": 32,
            "dtype": "bf16",
            "zero": zero,
            "bytes_per_param": TARGETS["piper"].bytes_per_param,
        },
        parallel=ParallelPlan(
            pp=4, dp=2, tp=1, ep=2, edp=1, micro_batch=2, num_microbatches=8, recompute="none"
        ),  # fmt: skip
        stages=tuple(StagePlan(i, layers, rc.get(i, ())) for i, layers in enumerate(stages)),
        experts=experts,
        ranks=ranks,
        predicted=Predicted(1.0, 0.5, 100.0, 1e5, 0.1, (1.0, 1.0, 1.0, 1.0), 60.0),
        solver=SolveReport("cpsat", "OPTIMAL", 1.0, 1.0, 0.0),
        inputs_sha256="ab" * 32,
    )


# The every-knob layout: DeepSeek-V3 on 1024 ranks (pp 8 x vp 2, cp 2, tp 4, dp 16,
# ep 32 x etp 2 folded over tp*cp*dp = 128, so edp 2).
KNOBS = {"pp": 8, "vp": 2, "dp": 16, "tp": 4, "cp": 2, "ep": 32, "etp": 2}
KNOB_STAGES = (8, 8, 8, 8, 8, 7, 7, 7)  # layers per pipeline rank, 61 in all


def knob_plan(dtype: str = "fp8") -> Plan:
    """DeepSeek-V3 with every knob: vp, cp, etp and folded ep, selective recompute by module,
    FSDP, bf16 Adam moments, a low-precision recipe, the all-to-all overlap, DeepEP, MTP."""
    model = load_model("deepseek-v3")
    k = KNOBS
    par = ParallelPlan(
        pp=k["pp"], dp=k["dp"], tp=k["tp"], ep=k["ep"],
        edp=k["tp"] * k["cp"] * k["dp"] // (k["etp"] * k["ep"]), micro_batch=1,
        num_microbatches=64, recompute="selective", vp=k["vp"], cp=k["cp"], etp=k["etp"],
        recompute_modules=("moe_act", "layernorm"),
    )  # fmt: skip
    stages, start = [], 0
    for i, n in enumerate(KNOB_STAGES):
        stages.append(StagePlan(i, tuple(range(start, start + n))))
        start += n
    ranks = []
    for r in range(k["pp"] * k["dp"] * k["tp"] * k["cp"]):  # Megatron's tp-cp-dp-pp order
        t, c = r % k["tp"], (r // k["tp"]) % k["cp"]
        d, s = (r // (k["tp"] * k["cp"])) % k["dp"], r // (k["tp"] * k["cp"] * k["dp"])
        e = (r % (k["tp"] * k["cp"] * k["dp"])) // k["etp"] % k["ep"]
        ranks.append(RankPlan(rank=r, node=r // 8, local_rank=r % 8, stage=s, dp=d, tp=t, ep=e,
                              cp=c))  # fmt: skip
    per_rank = 256 // k["ep"]
    experts = tuple(ExpertPlacement(i, tuple(e // per_rank for e in range(256)))
                    for i in model.moe_layers)  # fmt: skip
    training = {
        "seq_len": 4096,
        "global_batch": 1024,
        "dtype": dtype,
        "zero": False,
        "fsdp": True,
        "optimizer_dtype": "bf16",
        "a2a_overlap": True,
        "mtp_layers": 1,
        "cuda_graphs": "partial",
    }
    return Plan(
        model=ModelEntry("deepseek-v3", "preset:deepseek-v3", model_config(model)),
        cluster=ClusterEntry("h100", gpus_per_node=8, profile={"num_nodes": 128}),
        training=training,
        parallel=par,
        stages=tuple(stages),
        experts=experts,
        ranks=tuple(ranks),
        predicted=Predicted(1.0, 0.5, 100.0, 1e5, 0.1, (1.0,) * k["pp"], 70.0),
        solver=SolveReport("cpsat", "OPTIMAL", 1.0, 1.0, 0.0),
        inputs_sha256="cd" * 32,
        extra={"dispatcher": "deepep"},
    )


def priced_for(plan: Plan, engine: str) -> Plan:
    """`plan` as priced for `engine`'s conventions (bytes per parameter, router weights), as
    `piper plan --target ENGINE` writes it."""
    t = TARGETS[engine]
    training = {
        **plan.training,
        "bytes_per_param": t.bytes_per_param,
        "gate_in_activation": t.gate_in_activation,
        "fsdp_reduce_dtype": t.fsdp_reduce_dtype,
    }
    stages = plan.stages
    if not t.per_layer_recompute and plan.parallel.recompute != "none":
        stages = tuple(replace(s, recompute_layers=s.layers) for s in stages)
    return replace(plan, training=training, stages=stages, extra={**plan.extra, "target": engine})


def user_plans(folder: Path) -> dict[str, Plan]:
    """`piper plan` for each of USER_PLANS into `folder`; name -> loaded plan.

    Test processes that share `folder` (pytest-xdist workers) split the plans between them:
    each plan is made by the first process to lock it and read by the others, so no plan is
    searched twice and none is read half-written."""
    plans: dict[str, Plan] = {}
    while len(plans) < len(USER_PLANS):
        for name in [n for n in USER_PLANS if n not in plans]:
            with open(folder / f"{name}.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # another process is making it: make the next one meanwhile
                out = folder / name
                if not (out / "plan.json").is_file():
                    assert main(["plan", *USER_PLANS[name], "--out", str(out)]) == 0, name
                plans[name] = load_plan(out / "plan.json")
        if len(plans) < len(USER_PLANS):
            time.sleep(0.2)  # the rest are being made elsewhere
    return {name: plans[name] for name in USER_PLANS}


def with_model(plan: Plan, name: str) -> Plan:
    """`plan` with its model swapped for the preset `name` (layout unchanged)."""
    model = load_model(name)
    return replace(plan, model=ModelEntry(name, f"preset:{name}", model_config(model)))


def bash_array(text: str, name: str) -> list[str]:
    """The words bash puts in array `name` after running `text`."""
    out = subprocess.run(["bash", "-c", f'{text}\nprintf "%s\\n" "${{{name}[@]}}"'],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout.splitlines()
