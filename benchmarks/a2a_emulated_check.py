"""Does the simulator predict the emulated network? Measured (halo_emulated.py) vs simulated.

Reads the JSON of `benchmarks/halo_emulated.py --json` (or runs it with --run; needs root) and
predicts every rate-limited, uniform-routing measurement with two models of the emulation,
each fitted on the top-k = 2 points and checked on all others (other k, 200 Mbit/s, 2 x 4):
- host-profile model (primary): the flow-level simulation of the rate-limited links, plus a
  share alpha of the host time, the same workload measured with the links unthrottled (the
  sweep's host profile: every emulated node runs on this one machine, so its CPUs are part
  of the system being predicted); one parameter, alpha;
- host-link model: the host's CPUs as one more link every flow crosses plus a per-message
  overhead; two parameters.
Prints measured vs predicted per point, the errors, and how many held-out points are within
25%; writes results/a2a/emulated_check.{md,csv}.

  python3 benchmarks/a2a_emulated_check.py --emulated-json emulated.json
  python3 benchmarks/a2a_emulated_check.py --run            # as root: runs the emulation
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.outputs.files import write_files  # noqa: E402
from planner.sim.emulated import (  # noqa: E402
    fit_alpha,
    fit_parameters,
    predict_dispatch_combine_s,
    predict_with_host_profile,
)


def load_points(args: argparse.Namespace) -> dict:
    if args.run:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "halo_emulated.py"), "--json"]
        cmd += ["--quick"] if args.quick else []
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"halo_emulated.py failed:\n{proc.stderr[-2000:]}")
        if args.save_json:
            Path(args.save_json).write_text(proc.stdout)
        return json.loads(proc.stdout)
    return json.loads(Path(args.emulated_json).read_text())


def _load(data: dict) -> str:
    load = data.get("load_avg_1min_at_end")
    return f"{load:.1f}" if isinstance(load, (int, float)) else "?"


KEY = ("nodes", "ranks_per_node", "routing", "topk", "tokens_per_rank", "algo")


def host_profile(measurements: list[dict]) -> dict[tuple, float]:
    """Median seconds of each workload with the links unthrottled (rate_mbit 0)."""
    out: dict[tuple, float] = {}
    for m in measurements:
        if m["rate_mbit"] == 0:
            out.setdefault(tuple(m[k] for k in KEY), m["median_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--emulated-json", help="output of halo_emulated.py --json")
    ap.add_argument("--run", action="store_true", help="run halo_emulated.py --json (root)")
    ap.add_argument("--quick", action="store_true", help="with --run: its --quick sweep")
    ap.add_argument("--save-json", help="with --run: keep the emulation's JSON here")
    ap.add_argument(
        "--loopback-gbps",
        type=float,
        default=2.0,
        help="host-link model: loopback TCP GB/s per rank (piper profile's p2p_node here)",
    )
    ap.add_argument("--fit-topk", type=int, default=2, help="points used to fit")
    ap.add_argument(
        "--halo-direct-below",
        type=float,
        default=float(1 << 20),
        help="runtime HALO's direct-path threshold for points without a recorded path "
        "(bytes per node-pair message; 0 = never)",
    )
    ap.add_argument("--out", default=str(ROOT / "results" / "a2a"))
    ap.add_argument("--no-files", action="store_true")
    args = ap.parse_args(argv)
    if not (args.run or args.emulated_json):
        ap.error("give --emulated-json FILE or --run")
    data = load_points(args)
    host = host_profile(data["measurements"])
    points = [m for m in data["measurements"] if m["routing"] == "uniform" and m["rate_mbit"] > 0]
    if not points:
        raise SystemExit("no rate-limited uniform-routing measurements in the input")
    is_fit = {id(p): p["topk"] == args.fit_topk for p in points}
    calib = [p for p in points if is_fit[id(p)]]
    direct = args.halo_direct_below
    o_us, host_gbps = fit_parameters(calib, args.loopback_gbps, direct)
    profiled = [
        (p, host[tuple(p[k] for k in KEY)]) for p in calib if tuple(p[k] for k in KEY) in host
    ]
    alpha = fit_alpha(profiled) if profiled else None
    rows, csv = (
        [],
        [
            "nodes,ranks_per_node,rate_mbit,topk,tokens_per_rank,algo,path,measured_s,host_s,"
            "predicted_host_profile_s,predicted_host_link_s,used_for_fit"
        ],
    )
    within = {"profile": 0, "link": 0}
    held_out = {"profile": 0, "link": 0}
    for p in sorted(
        points,
        key=lambda q: tuple(
            q[k]
            for k in ("nodes", "ranks_per_node", "rate_mbit", "topk", "tokens_per_rank", "algo")
        ),
    ):
        key = tuple(p[k] for k in KEY)
        fit = is_fit[id(p)]
        pred_link = predict_dispatch_combine_s(p, o_us, args.loopback_gbps, 50.0, host_gbps, direct)
        err_link = (pred_link - p["median_s"]) / p["median_s"]
        host_s = host.get(key)
        pred_prof = None
        if host_s is not None and alpha is not None:
            pred_prof = predict_with_host_profile(p, host_s, alpha)
        err_prof = None if pred_prof is None else (pred_prof - p["median_s"]) / p["median_s"]
        if not fit:
            held_out["link"] += 1
            within["link"] += abs(err_link) <= 0.25
            if err_prof is not None:
                held_out["profile"] += 1
                within["profile"] += abs(err_prof) <= 0.25
        prof_cells = (
            f"{pred_prof * 1e3:.1f} | {100 * err_prof:+.0f}%" if pred_prof is not None else "- | -"
        )
        rows.append(
            f"| {p['nodes']}x{p['ranks_per_node']} | {p['rate_mbit']} | {p['topk']} | "
            f"{p['tokens_per_rank']} | {p['algo']} | {p.get('path', '')} | "
            f"{p['median_s'] * 1e3:.1f} | "
            + (f"{host_s * 1e3:.1f}" if host_s is not None else "-")
            + f" | {prof_cells} | {pred_link * 1e3:.1f} | {100 * err_link:+.0f}% |"
            + (" fit" if fit else "")
        )
        csv.append(
            f"{p['nodes']},{p['ranks_per_node']},{p['rate_mbit']},{p['topk']},"
            f"{p['tokens_per_rank']},{p['algo']},{p.get('path', '')},{p['median_s']:.6g},"
            + (f"{host_s:.6g}" if host_s is not None else "")
            + ","
            + (f"{pred_prof:.6g}" if pred_prof is not None else "")
            + f",{pred_link:.6g},{int(fit)}"
        )
    alpha_text = f"{alpha:.2f}" if alpha is not None else "n/a (no host profile in the input)"
    lines = [
        "# Simulator vs emulated network (benchmarks/halo_emulated.py)",
        "",
        f"Machine: {data.get('cpus', '?')} CPUs, load average "
        f"{_load(data)} at the end of the run. Fitted on the "
        f"top-{args.fit_topk} points, predicted on every other uniform-routing point:",
        "",
        f"- **host-profile model**: simulated link time + alpha x host time (the same workload "
        f"measured with the links unthrottled); alpha = {alpha_text}. "
        f"**{within['profile']} of {held_out['profile']} held-out points within 25%.**",
        f"- host-link model: the host's CPUs as one link every flow crosses, {host_gbps:.3g} "
        f"GB/s of payload, plus {o_us:.0f} us per message; loopback {args.loopback_gbps} GB/s "
        f"per rank. {within['link']} of {held_out['link']} held-out points within 25%.",
        "",
        "| nodes x g | Mbit/s | k | tokens | algo | HALO path | measured ms | host ms | "
        "host-profile ms | error | host-link ms | error |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_files:
        files = {"emulated_check.md": text, "emulated_check.csv": "\n".join(csv) + "\n"}
        for path in write_files(args.out, files):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
