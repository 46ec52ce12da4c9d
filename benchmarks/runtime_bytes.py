"""The resource model's communication volumes against the bytes a real run sends.

For a few layouts of tiny-moe on the cpu-gloo cluster (pipeline, data, tensor and expert
parallel; interleaved 1F1B, expert TP, FSDP), plans with `piper plan` (every size and knob
fixed, --dtype fp32 so the run computes in fp32, as piper run follows the plan's dtype),
trains 2 steps with `piper run` (flat all-to-all) and prints, per kind, the bytes all
ranks sent in the last step (metrics.jsonl) beside the bytes the planner's model moves for
that step (planner.resources.cost.predicted_traffic, with the run's fp32 activations and
gradients), and their ratio.

Where they differ, by design: `tp` - the runtime also reduce-scatters the vocab-parallel
embedding and all-gathers before the head (two ring passes per stage end, forward and
backward) and all-reduces three fp32 numbers per token in the vocab-parallel cross entropy;
`dispatch` and `etp` - the model's rows
are the mean routing, the run's its actual routing (expert TP also pads each all-gather to
the largest member's rows and gathers the per-slot row counts); with FSDP, `param_gather`
- the model gathers bf16 weights twice per micro-batch, the run its fp32 weights, and
FSDP2's root unit (embedding, final norm, head) only once (kept from forward to backward),
and `grad_*` - FSDP pads each parameter's dim 0 to a multiple of the group size. Bytes
are deterministic, so the ratios do not depend on the machine.

Usage: python benchmarks/runtime_bytes.py [--out DIR] [--results FILE]
Runs go to DIR (default a temporary directory); what it prints goes to
results/runtime_bytes.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
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
    """The planner's bytes for one step of the plan, in the runtime's fp32 (4 B values)."""
    plan = load_plan(plan_path)
    model, cluster, training, parallel = plan_inputs(plan)
    training = replace(training, dtype="fp32", bytes_per_param=18)  # fp32 activations, grads
    return predicted_traffic(model, cluster, training, parallel, [s.layers for s in plan.stages])


def run_layout(root: Path, gpus: int, pp: int, dp: int, tp: int, ep: int, vp=1, etp=1, fsdp=False):
    name = f"pp{pp}-dp{dp}-tp{tp}-ep{ep}"
    name += (f"-vp{vp}" if vp > 1 else "") + (f"-etp{etp}" if etp > 1 else "")
    name += "-fsdp" if fsdp else ""
    plan_dir, run_dir = root / f"plan-{name}", root / f"run-{name}"
    _piper("plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", str(gpus),
           "--pp", str(pp), "--dp", str(dp), "--tp", str(tp), "--ep", str(ep),
           "--vp", str(vp), "--etp", str(etp), "--cp", "1",
           "--fsdp" if fsdp else "--no-fsdp",
           "--micro-batch", "2", "--seq-len", "128", "--global-batch", str(4 * dp),
           "--dtype", "fp32", "--out", str(plan_dir))  # fmt: skip
    _piper("run", str(plan_dir / "plan.json"), "--steps", "2", "--dispatcher", "flat",
           "--ranks-per-node", "2", "--out", str(run_dir))  # fmt: skip
    return name, predicted(plan_dir / "plan.json"), measured(run_dir)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="directory for the plans and runs")
    p.add_argument("--results", default="results/runtime_bytes.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    title = "Planner's bytes per step vs what piper run sends"
    with recorded(args.results, title, enabled=not args.no_results):
        compare(Path(args.out or tempfile.mkdtemp(prefix="piper-bytes-")))
    return 0


def compare(root: Path) -> None:
    """Plan and run every layout under `root`; print predicted and measured bytes by kind."""
    print(f"tiny-moe on cpu-gloo, micro-batch 2 x seq 128, 2 steps; runs in {root}")
    print(f"{'layout':<23} {'kind':<12} {'predicted':>13} {'measured':>13} {'meas/pred':>9}")
    for layout in LAYOUTS:
        name, pred, meas = run_layout(root, *layout)
        for kind in KINDS:
            if not pred[kind] and not meas[kind]:
                continue
            ratio = f"{meas[kind] / pred[kind]:9.3f}" if pred[kind] else f"{'-':>9}"
            print(f"{name:<23} {kind:<12} {pred[kind]:>13,.0f} {meas[kind]:>13,} {ratio}")


if __name__ == "__main__":
    sys.exit(main())
