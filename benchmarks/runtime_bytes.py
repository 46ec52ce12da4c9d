"""The resource model's communication volumes against the bytes a real run sends, in fp32
and in bf16.

For a few layouts of tiny-moe on the cpu-gloo cluster (pipeline, data, tensor and expert
parallel; interleaved 1F1B, expert TP, FSDP), plans with `piper plan` (every size and knob
fixed; --dtype fp32 and --dtype bf16), trains 2 steps of each plan with `piper run` (flat
all-to-all; it computes in the plan's dtype) and prints, per kind, the bytes all ranks sent
in the last step (metrics.jsonl) beside the bytes the planner's model moves for that step
(planner.resources.cost.predicted_traffic of the plan as priced: the piper target's 18-byte
accounting has fp32 gradients, and the runtime reduces fp32 gradients in either dtype, as
Megatron-Core does for bf16), their ratio, and the bf16 run's bytes over the fp32 run's.

bf16 / fp32: 0.5 for the activations (p2p, tp, etp, dispatch up to the routing and its
int64 counts, which stay 8 B), 1.0 for the gradient reductions (grad_*), 0.5 for FSDP's
param_gather. Where the run and the model differ, by design: `tp` - the runtime also
reduce-scatters the vocab-parallel embedding and all-gathers before the head (two ring
passes per stage end, forward and backward) and all-reduces three fp32 numbers per token in
the vocab-parallel cross entropy; `dispatch` and `etp` - the model's rows are the mean
routing, the run's its actual routing (expert TP also pads each all-gather to the largest
member's rows and gathers the per-slot row counts); with FSDP, `param_gather` - the model
gathers the weights in the plan's dtype twice per micro-batch, the run FSDP2's root unit
(embedding, final norm, head) only once (kept from forward to backward), and `grad_*` - FSDP
pads each parameter's dim 0 to a multiple of the group size. Bytes are deterministic, so the
ratios do not depend on the machine.

Usage: python benchmarks/runtime_bytes.py [--precision fp32|bf16|both] [--out DIR]
[--results FILE]. Runs go to DIR (default a temporary directory); what it prints goes to
results/runtime_bytes.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from results_md import recorded  # noqa: E402

from planner.calibrate.compare import plan_inputs  # noqa: E402
from planner.plan import load_plan  # noqa: E402
from planner.resources.cost import predicted_traffic  # noqa: E402
from planner.resources.traffic import KINDS  # noqa: E402

# (gpus, pp, dp, tp, ep, vp, etp, fsdp)
LAYOUTS = (
    (8, 2, 4, 1, 2, 1, 1, False),
    (8, 2, 2, 2, 4, 1, 1, False),
    (8, 2, 2, 2, 2, 1, 1, False),
    (4, 4, 1, 1, 1, 1, 1, False),
    (4, 2, 2, 1, 2, 2, 1, False),
    (4, 2, 2, 1, 1, 1, 2, False),
    (4, 2, 2, 1, 1, 1, 1, True),
)


def _piper(*args: str) -> None:
    code = "import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, *args], check=True, stdout=subprocess.DEVNULL)


def measured(run_dir: Path) -> dict[str, int]:
    """Bytes of the run's last step by kind (intra + inter node), summed over ranks."""
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["bytes_by_kind"]
    return {k: last.get(f"{k}_intra", 0) + last.get(f"{k}_inter", 0) for k in KINDS}


def predicted(plan_path: Path) -> dict[str, float]:
    """The planner's bytes for one step of the plan as priced: its dtype's activations and
    weights, fp32 gradients."""
    plan = load_plan(plan_path)
    model, cluster, training, parallel = plan_inputs(plan)
    return predicted_traffic(model, cluster, training, parallel, [s.layers for s in plan.stages])


def layout_name(pp: int, dp: int, tp: int, ep: int, vp=1, etp=1, fsdp=False) -> str:
    name = f"pp{pp}-dp{dp}-tp{tp}-ep{ep}"
    name += (f"-vp{vp}" if vp > 1 else "") + (f"-etp{etp}" if etp > 1 else "")
    return name + ("-fsdp" if fsdp else "")


def run_layout(
    root: Path, dtype: str, gpus: int, pp: int, dp: int, tp: int, ep: int, vp=1, etp=1, fsdp=False
):
    """Plan the layout in `dtype`, run it; (predicted, measured) bytes by kind."""
    name = f"{layout_name(pp, dp, tp, ep, vp, etp, fsdp)}-{dtype}"
    plan_dir, run_dir = root / f"plan-{name}", root / f"run-{name}"
    _piper("plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", str(gpus),
           "--pp", str(pp), "--dp", str(dp), "--tp", str(tp), "--ep", str(ep),
           "--vp", str(vp), "--etp", str(etp), "--cp", "1",
           "--fsdp" if fsdp else "--no-fsdp",
           "--micro-batch", "2", "--seq-len", "128", "--global-batch", str(4 * dp),
           "--dtype", dtype, "--dispatcher", "flat", "--out", str(plan_dir))  # fmt: skip
    _piper("run", str(plan_dir / "plan.json"), "--steps", "2", "--dispatcher", "flat",
           "--ranks-per-node", "2", "--out", str(run_dir))  # fmt: skip
    return predicted(plan_dir / "plan.json"), measured(run_dir)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both",
                   help="the plans' dtype (both: each layout in fp32 and in bf16)")  # fmt: skip
    p.add_argument("--out", default=None, help="directory for the plans and runs")
    p.add_argument("--results", default="results/runtime_bytes.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    dtypes = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    title = "Planner's bytes per step vs what piper run sends"
    with recorded(args.results, title, enabled=not args.no_results):
        compare(Path(args.out or tempfile.mkdtemp(prefix="piper-bytes-")), dtypes)
    return 0


def compare(root: Path, dtypes: tuple[str, ...]) -> None:
    """Plan and run every layout in each dtype under `root`; print predicted and measured
    bytes by kind per dtype, and (both dtypes) the measured bf16 / fp32 ratio."""
    print(f"tiny-moe on cpu-gloo, micro-batch 2 x seq 128, 2 steps; runs in {root}")
    print("pred: the planner's model of the plan as priced (the piper target: fp32 gradients)")
    header = f"{'layout':<21} {'kind':<12}"
    for d in dtypes:
        header += f" {'pred ' + d:>11} {'meas ' + d:>11} {'m/p':>6}"
    print(header + (f" {'bf16/fp32':>9}" if len(dtypes) == 2 else ""))
    for layout in LAYOUTS:
        name = layout_name(*layout[1:])
        runs = [run_layout(root, d, *layout) for d in dtypes]
        for kind in KINDS:
            if not any(pred[kind] or meas[kind] for pred, meas in runs):
                continue
            row = f"{name:<21} {kind:<12}"
            for pred, meas in runs:
                ratio = f"{meas[kind] / pred[kind]:6.3f}" if pred[kind] else f"{'-':>6}"
                row += f" {pred[kind]:>11,.0f} {meas[kind]:>11,} {ratio}"
            if len(runs) == 2:
                fp32, bf16 = runs[0][1][kind], runs[1][1][kind]
                row += f" {bf16 / fp32:9.3f}" if fp32 else f" {'-':>9}"
            print(row)


if __name__ == "__main__":
    sys.exit(main())
