"""The runtime as a memory oracle: each rank of a full-size plan built on the meta device.

For plans made with `piper plan --target piper` (h100 presets, 64 to 1024 ranks: pp, vp, tp,
etp, ep, FSDP and redundant expert slots), builds a few ranks of every stage with the
runtime's own code, one rank at a time in this one process: a fake process group of the
plan's world size (torch's "fake" backend: collectives return at once, no data moves),
`runtime.launch.build_trainer` under `torch.device("meta")` (groups, stage chunks,
dispatcher, slot tables, expert TP slices, FSDP units, the Adam optimizer), then one
`optimizer.step()` on zero gradients, so Adam creates its moments as it would at the first
step. It counts, per rank:
- weights: every parameter's local tensor (FSDP: this rank's DTensor shard), fp32;
- grads: one fp32 gradient per trainable parameter, shaped (and sharded) as it;
- optimizer: Adam's exp_avg and exp_avg_sq tensors (its scalar `step` counters, 4 B per
  parameter tensor, are left out; the model has no term for them);
and compares with the resource model's per-stage "weights", "grads" and "optimizer"
(planner.calibrate.compare.estimate_plan) plus the plan's redundant slots as
planner.search.assemble.slot_budget prices them (one routed expert's state per MoE layer
of the stage per extra slot of the fullest rank).

Conventions: the runtime's parameters are fp32 (4 B: in a bf16 run they are the master
weights), its gradients fp32 (4) and its Adam moments fp32 (8): 16 B per parameter. The
piper target prices a bf16 plan at 18: bf16 weights (2), fp32 gradients (4), fp32 master +
moments (12). The model's bf16 weights are the copies a bf16 step computes with, which the
runtime casts once per step and holds until the step ends (runtime/RUNTIME.md "Precision";
the embedding table, norms and routers stay uncast, so the model's 2 B on those are on the
safe side); they are not parameter state, so this count does not see them. Per parameter
the component ratios runtime / model are 2, 1 and 2/3 by convention and the total's 16/18;
`per conv.` is the ratio divided by that factor: 1.000 when both hold the same parameters;
`net` is the same after taking the known excess below (`known excess B`) off the runtime's
bytes.

Known differences: none in the plans below. With tp > 1 both sides split the same parameters:
the embedding and the output head by vocabulary rows (ceil(V / tp) each), attention and the
dense and shared-expert MLPs by heads and width, while norms, routers, row-parallel biases,
the shared expert's gate and MLA's down-projections are whole on every TP rank, as in
Megatron-Core (runtime/parallel/tensor_parallel.py, planner.resources.params.
tp_replicated_params). Attention is built as planned: MLA (DeepSeek-V3) as MLA
(runtime/model/attention.py), sinks and sliding windows as the config says;
`attention_excess` (the run model's attention parameters minus the plan model's, nonzero
only when --scale shrinks the attention) is kept as a check and is the `known excess`.
Not in these plans: FSDP with tp > 1, where the runtime leaves the TP-whole weights out of
FSDP's units (runtime/parallel/fsdp.py) and the model shards them over dp.

Two hooks, undone after each rank: `runtime.parallel.fsdp.shard_chunk` builds its DeviceMesh
with the parameters' device type, and FSDP2 has no device module for "meta", so the oracle
hands it "cpu" meshes (FSDP then leaves meta parameters on meta, as for deferred init); the
MoE layers' SlotRouter tables, CPU tensors in a run, are built on the CPU (on meta, torch
runs their cumsums through its slow Python reference kernels: 20 s a rank).

Usage: python benchmarks/memory_oracle.py [--plans DIR] [--results FILE | --no-results]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import runtime.model.moe as runtime_moe  # noqa: E402
import runtime.parallel.fsdp as runtime_fsdp  # noqa: E402
from planner.calibrate.compare import estimate_plan, plan_inputs  # noqa: E402
from planner.plan import Plan, load_plan  # noqa: E402
from planner.resources.memory import (  # noqa: E402
    StateBytes,
    grad_bytes_per_param,
    optimizer_bytes_per_param,
    state_bytes,
    weight_bytes_per_param,
)
from planner.resources.params import attention_params, layer_params  # noqa: E402
from planner.run.spec import RunSpec, run_spec_from_plan  # noqa: E402
from planner.specs import GIB, ModelSpec, TrainingSpec  # noqa: E402
from planner.targets import TARGETS, with_conventions  # noqa: E402
from runtime.launch import build_trainer  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from results_md import recorded  # noqa: E402

COMPONENTS = ("weights", "grads", "optimizer")
RUNTIME_BYTES_PER_PARAM = {"weights": 4, "grads": 4, "optimizer": 8}  # fp32; Adam m + v

# (name, model, gpus, layout flags): full sizes on the h100 preset, every layout kind
FULL_PLANS = (
    ("qwen3-30b-pp4-tp2-ep8", "qwen3-30b-a3b", 64, "--pp 4 --tp 2 --ep 8 --vp 1"),
    ("qwen3-30b-pp4-vp2-tp2-ep16-etp2", "qwen3-30b-a3b", 256,
     "--pp 4 --vp 2 --tp 2 --ep 16 --etp 2"),
    ("qwen3-30b-pp2-ep8-fsdp", "qwen3-30b-a3b", 128, "--pp 2 --tp 1 --ep 8 --vp 1 --fsdp"),
    ("qwen3-235b-pp8-ep32-slots32", "qwen3-235b-a22b", 1024,
     "--pp 8 --tp 1 --ep 32 --vp 1 --redundant-slots 32"),
    ("deepseek-v3-pp16-ep64-slots64", "deepseek-v3", 1024,
     "--pp 16 --tp 1 --ep 64 --vp 1 --redundant-slots 64"),
)  # fmt: skip


@dataclass(frozen=True)
class RankState:
    """Training state one rank of the runtime holds (bytes), and where it sits."""

    rank: int
    stage: int
    weights: int
    grads: int
    optimizer: int

    def component(self, name: str) -> int:
        return (
            self.weights + self.grads + self.optimizer if name == "total" else getattr(self, name)
        )


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """The default process group as `rank` of `world` on torch's fake backend."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _CpuMeshes:
    """DeviceMesh.from_group for runtime.parallel.fsdp with "meta" read as "cpu"."""

    @staticmethod
    def from_group(group, device_type: str, *args, **kwargs) -> DeviceMesh:
        kind = "cpu" if device_type == "meta" else device_type
        return DeviceMesh.from_group(group, kind, *args, **kwargs)


class _CpuSlotRouter(runtime_moe.SlotRouter):
    """The MoE layer's SlotRouter, its routing tables built as CPU tensors (what they are in
    a run) while the meta device is the default."""

    def __init__(self, *args, **kwargs) -> None:
        with torch.device("cpu"):
            super().__init__(*args, **kwargs)


@contextlib.contextmanager
def meta_hooks():
    """The two hooks the meta build needs (module docstring), undone on exit."""
    saved = runtime_fsdp.DeviceMesh, runtime_moe.SlotRouter
    runtime_fsdp.DeviceMesh, runtime_moe.SlotRouter = _CpuMeshes, _CpuSlotRouter
    try:
        yield
    finally:
        runtime_fsdp.DeviceMesh, runtime_moe.SlotRouter = saved


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _numel(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def rank_state(spec: RunSpec, rank: int) -> RankState:
    """Build `rank` of `spec` with the runtime's builders on the meta device and count it."""
    meta = torch.device("meta")
    with fake_world(rank, spec.world), meta_hooks(), meta:
        trainer = build_trainer(spec, rank, meta)
        params = list(trainer.module.parameters())
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        trainer.optimizer.step()  # Adam's moments, created as at the first step
        moments = [
            v
            for state in trainer.optimizer.state.values()
            for k, v in state.items()
            if k in ("exp_avg", "exp_avg_sq")
        ]
        return RankState(
            rank,
            trainer.mesh.me.stage,
            sum(_nbytes(p) for p in params),
            sum(_nbytes(p.grad) for p in params if p.grad is not None),
            sum(_nbytes(v) for v in moments),
        )


def slot_state(plan: Plan) -> list[StateBytes]:
    """Per stage, the state the plan's redundant slots add to a rank of it, as
    planner.search.assemble.slot_budget prices them: ceil(slots / ep) extra routed experts
    of each MoE layer of the stage, each split over etp."""
    model, _, training, par = plan_inputs(plan)
    extra = plan.extra.get("redundant_slots") if isinstance(plan.extra, dict) else None
    slots = int(extra["redundant_slots"]) if extra else 0
    per_rank = -(-slots // par.ep)
    out = []
    for stage in sorted(plan.stages, key=lambda s: s.stage):
        params = sum(
            layer_params(model, model.layers[i]).expert / par.etp
            for i in stage.layers
            if model.layers[i].moe is not None
        )
        one = state_bytes(0.0, params, training, par)
        out.append(StateBytes(*(per_rank * getattr(one, c) for c in COMPONENTS)))
    return out


def model_state(plan: Plan) -> list[dict[str, float]]:
    """The resource model's weights, grads and optimizer bytes per rank of each stage."""
    est = estimate_plan(plan)
    out = []
    for st, extra in zip(est.stages, slot_state(plan), strict=True):
        gib = dict(st.memory_gib)
        row = {c: gib[c] * GIB + getattr(extra, c) for c in COMPONENTS}
        row["total"] = sum(row.values())
        out.append(row)
    return out


def model_bytes_per_param(training: TrainingSpec) -> dict[str, int]:
    """The resource model's bytes per parameter of `training`, by component."""
    return {
        "weights": weight_bytes_per_param(training),
        "grads": grad_bytes_per_param(training),
        "optimizer": optimizer_bytes_per_param(training),
    }


def conventions(plan: Plan) -> dict[str, float]:
    """Runtime / model bytes per parameter, by component (module docstring)."""
    _, _, training, _ = plan_inputs(plan)
    model = model_bytes_per_param(training)
    out = {c: RUNTIME_BYTES_PER_PARAM[c] / model[c] for c in COMPONENTS}
    out["total"] = sum(RUNTIME_BYTES_PER_PARAM.values()) / sum(model.values())
    return out


def representative_ranks(spec: RunSpec, per_stage: int = 3) -> list[int]:
    """Physical ranks of each stage: the first, middle and last place of its dp x tp block
    (so the first and last tp, ep, edp and FSDP shard indices), at most `per_stage`."""
    physical = {logical: p for p, logical in enumerate(spec.logical_of_physical)}
    block = spec.dp * spec.tp
    places = sorted({0, block // 2, block - 1})[:per_stage]
    return [physical[s * block + j] for s in range(spec.pp) for j in places]


def oracle(plan_path: Path, every_rank: bool = False) -> tuple[list[RankState], dict]:
    """(runtime state of every rank, or of representative_ranks, context) for one plan;
    context: the RunSpec, the model's per-stage bytes and the conventions."""
    plan = load_plan(plan_path)
    spec = run_spec_from_plan(plan, plan.model_spec(plan_path))
    ranks = list(range(spec.world)) if every_rank else representative_ranks(spec)
    states = [rank_state(spec, r) for r in ranks]
    model = plan.model_spec(plan_path)
    attention = [attention_excess(spec, model, s) for s in range(spec.pp)]
    return states, {
        "spec": spec,
        "model": model_state(plan),
        "conv": conventions(plan),
        "attention": attention,
    }


def attention_excess(spec: RunSpec, model: ModelSpec, stage: int) -> float:
    """Attention parameters a rank of pipeline rank `stage` holds over the model: the run
    model's attention (planner.run.scale) minus the plan model's, over tp; 0 at --scale 1,
    where the run model keeps every layer's attention as planned."""
    d = model.hidden_size
    return (
        sum(
            attention_params(spec.model.layers[i].attention, d)
            - attention_params(model.layers[spec.source_layers[i]].attention, d)
            for i in spec.stage_layers[stage]
        )
        / spec.tp
    )


def rows(name: str, states: list[RankState], ctx: dict) -> list[tuple]:
    """(plan, rank, stage, component, runtime, model, ratio, per convention, known excess
    bytes (attention_excess), per convention net of it) per rank and component."""
    out = []
    for st in states:
        model = ctx["model"][st.stage]
        extra = ctx["attention"][st.stage]
        for c in (*COMPONENTS, "total"):
            run, mod, conv = st.component(c), model[c], ctx["conv"][c]
            excess = extra * RUNTIME_BYTES_PER_PARAM.get(c, 16)
            ratio = run / mod
            net = (run - excess) / mod / conv
            out.append((name, st.rank, st.stage, c, run, mod, ratio, ratio / conv, excess, net))
    return out


def _piper(*args: str) -> None:
    code = "import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, *args], check=True, stdout=subprocess.DEVNULL)


def make_plan(root: Path, name: str, model: str, gpus: int, flags: str) -> Path:
    """`piper plan --target piper --cluster h100` with the layout flags (reused when there)."""
    out = root / name
    if not (out / "plan.json").exists():
        _piper("plan", "--model", model, "--cluster", "h100", "--gpus", str(gpus),
               "--target", "piper", *flags.split(), "--out", str(out))  # fmt: skip
    return out / "plan.json"


def _line(row: tuple) -> str:
    name, rank, stage, comp, run, mod, ratio, per_conv, excess, net = row
    extra = f"{excess:>15,.0f}" if excess else f"{'-':>15}"
    return (
        f"{name:<32} {rank:>5} {stage:>5} {comp:<9} {run:>17,} {mod:>17,.0f} "
        f"{ratio:>6.3f} {per_conv:>9.4f} {extra} {net:>8.4f}"
    )


def compare(root: Path) -> None:
    """Plan every FULL_PLANS layout under `root`, build its representative ranks, print."""
    print(f"plans in {root}; ranks: first, middle and last of each stage's dp x tp block")
    print(f"conventions runtime / model per parameter: {conventions_line()}")
    print(
        f"{'plan':<32} {'rank':>5} {'stage':>5} {'component':<9} {'runtime bytes':>17} "
        f"{'model bytes':>17} {'ratio':>6} {'per conv.':>9} {'known excess B':>15} {'net':>8}"
    )
    summary = []
    for name, model, gpus, flags in FULL_PLANS:
        states, ctx = oracle(make_plan(root, name, model, gpus, flags))
        spec = ctx["spec"]
        print(
            f"# {name}: world {spec.world}, pp {spec.pp} vp {spec.vp} dp {spec.dp} tp {spec.tp} "
            f"ep {spec.ep} etp {spec.etp} edp {spec.edp} fsdp {spec.fsdp}"
        )
        table = rows(name, states, ctx)
        for row in table:
            print(_line(row))
        summary.append((name, spec, len(states), table))
    print_summary(summary)


def print_summary(summary: list) -> None:
    """Per plan: ranks built, the per-convention ratio's range before and after the known
    excess, and the largest excess (GiB of the runtime's 16 B/param state)."""
    print()
    print(
        f"{'plan':<32} {'world':>5} {'ranks':>5} {'per conv. min-max':>17} "
        f"{'net max |x - 1|':>15} {'max known excess GiB':>20}"
    )
    for name, spec, built, table in summary:
        per_conv = [r[7] for r in table]
        worst = max(abs(r[9] - 1) for r in table)
        excess = max(r[8] for r in table if r[3] == "total") / GIB
        print(
            f"{name:<32} {spec.world:>5} {built:>5} "
            f"{min(per_conv):>8.4f}-{max(per_conv):<8.4f} {worst:>15.1e} {excess:>20.2f}"
        )


def conventions_line() -> str:
    """The runtime / model bytes per parameter of a bf16 plan for the piper target."""
    model = model_bytes_per_param(
        with_conventions(TrainingSpec(seq_len=4096, global_batch=1024), TARGETS["piper"])
    )
    run = RUNTIME_BYTES_PER_PARAM
    return (
        f"weights {run['weights']}/{model['weights']}, grads {run['grads']}/{model['grads']}, "
        f"optimizer {run['optimizer']}/{model['optimizer']} (Adam m+v vs master+m+v), total "
        f"{sum(run.values())}/{sum(model.values())} (the model's bf16 weights: the copies a "
        "bf16 step computes with)"
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plans", default=None, help="directory for the plans (reused if there)")
    p.add_argument("--results", default="results/memory_oracle.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    title = "The runtime as a memory oracle: per-rank state at full size vs the model"
    with recorded(args.results, title, enabled=not args.no_results):
        compare(Path(args.plans or tempfile.mkdtemp(prefix="piper-oracle-")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
