"""Does the simulator predict the emulated network? Measured (halo_emulated.py) vs simulated.

Reads the JSON of `benchmarks/halo_emulated.py --json` (or runs it with --run; needs root),
models each emulated network with planner.sim.emulated, fits two parameters on the top-k = 2
uniform-routing points: the per-message software overhead (gloo over TCP + the dispatcher's
Python) and the host's CPU throughput that every emulated byte shares (all "nodes" run on
one machine), and predicts every other uniform-routing point (other k, 200 Mbit/s, 2 x 4).
Prints measured vs predicted per point, the error, and how many held-out points are within
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
from planner.sim.emulated import fit_parameters, predict_dispatch_combine_s  # noqa: E402


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
        help="loopback TCP GB/s per rank (piper profile's p2p_node on this host)",
    )
    ap.add_argument("--fit-topk", type=int, default=2, help="points used to fit")
    ap.add_argument(
        "--halo-direct-below",
        type=float,
        default=256 * 2**10,
        help="runtime HALO's direct-path threshold (bytes per node-pair message; 0 = never)",
    )
    ap.add_argument("--out", default=str(ROOT / "results" / "a2a"))
    ap.add_argument("--no-files", action="store_true")
    args = ap.parse_args(argv)
    if not (args.run or args.emulated_json):
        ap.error("give --emulated-json FILE or --run")
    data = load_points(args)
    points = [m for m in data["measurements"] if m["routing"] == "uniform"]
    is_fit = {id(p): p["topk"] == args.fit_topk for p in points}
    calib = [p for p in points if is_fit[id(p)]]
    direct = args.halo_direct_below
    o_us, host = fit_parameters(calib, args.loopback_gbps, direct)
    rows, within, held_out = [], 0, 0
    csv = [
        "nodes,ranks_per_node,rate_mbit,topk,tokens_per_rank,algo,measured_s,predicted_s,"
        "error_pct,used_for_fit"
    ]
    for p in sorted(
        points,
        key=lambda q: (
            q["nodes"],
            q["ranks_per_node"],
            q["rate_mbit"],
            q["topk"],
            q["tokens_per_rank"],
            q["algo"],
        ),
    ):
        pred = predict_dispatch_combine_s(p, o_us, args.loopback_gbps, 50.0, host, direct)
        err = (pred - p["median_s"]) / p["median_s"]
        fit = is_fit[id(p)]
        if not fit:
            held_out += 1
            within += abs(err) <= 0.25
        rows.append(
            f"| {p['nodes']}x{p['ranks_per_node']} | {p['rate_mbit']} | {p['topk']} | "
            f"{p['tokens_per_rank']} | {p['algo']} | {p['median_s'] * 1e3:.1f} | "
            f"{pred * 1e3:.1f} | {100 * err:+.0f}% |{' fit' if fit else ''}"
        )
        csv.append(
            f"{p['nodes']},{p['ranks_per_node']},{p['rate_mbit']},{p['topk']},"
            f"{p['tokens_per_rank']},{p['algo']},{p['median_s']:.6g},{pred:.6g},"
            f"{100 * err:.1f},{int(fit)}"
        )
    lines = [
        "# Simulator vs emulated network (benchmarks/halo_emulated.py)",
        "",
        f"Fitted on the top-{args.fit_topk} points: per-message overhead {o_us:.0f} us, host "
        f"CPU {host:.3g} GB/s of payload shared by all ranks; loopback {args.loopback_gbps} "
        f"GB/s per rank; HALO direct below {direct:.0f} B per node pair. Machine: "
        f"{data.get('cpus', '?')} CPUs, load average {data.get('load_avg_1min_at_end', '?')} "
        "at the end of the run.",
        "",
        "| nodes x g | Mbit/s | k | tokens | algo | measured ms | simulated ms | error |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
        *rows,
        "",
        f"{within} of {held_out} held-out points within 25%.",
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
