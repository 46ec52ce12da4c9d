"""`piper profile`: micro-benchmark this machine under torchrun and write a cluster profile.

The benchmarks live in runtime/bench/profile.py (torch); this module only launches them
(`torch.distributed.run --standalone` through planner.run.options.run_torchrun) and
converts the measurements with planner.calibrate.profile_tables, so importing it never
imports torch. Without torch it stops in one line naming the install
(planner.run.options.check_torch), unless --raw.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from planner.inputs.json_errors import load_json_file
from planner.inputs.paths import CLUSTERS_DIR
from planner.outputs.console import print_table, progress
from planner.outputs.files import write_files
from planner.run.options import check_torch, torchrun_command
from planner.specs import SpecError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="measure GEMM/attention TFLOPS and p2p/all-to-all GB/s; write a cluster YAML",
        description="Launch runtime/bench/profile.py under torchrun and write a cluster profile "
        "with measured tables (planner/PROFILING.md).",
    )
    p.add_argument(
        "--out",
        default=None,
        help="cluster YAML to write (default profiles/clusters/measured-<hostname>.yaml)",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (devices) to launch")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="declared node size (CPU emulation); default: from hostnames",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, under a minute on CPU")
    p.add_argument(
        "--base",
        default=None,
        help="cluster whose shape and levels the profile keeps "
        "(default cpu-gloo on gloo, h200 on NCCL)",
    )
    p.add_argument("--name", default=None, help="cluster name (default: the output file stem)")
    p.add_argument("--model", default=None, help="take GEMM K x N from this model's shapes")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--raw", default=None, help="convert an existing raw JSON (no launch)")
    p.add_argument("--keep-raw", default=None, help="also copy the raw measurements here")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.set_defaults(func=run)


class ProfileFailed(RuntimeError):
    """torchrun of runtime/bench/profile.py exited non-zero; the message holds its stderr tail."""


def _launch(args: argparse.Namespace, raw_path: Path) -> None:
    cmd = [
        *torchrun_command(os.getpid()),  # torchrun dies with this process
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "runtime.bench.profile",
        "--raw-out",
        str(raw_path),
        "--device",
        args.device,
    ]
    if args.quick:
        cmd.append("--quick")
    if args.ranks_per_node:
        cmd += ["--ranks-per-node", str(args.ranks_per_node)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.model:
        from planner.inputs.models import load_model

        model = load_model(args.model)
        moe = model.first_moe
        cmd += [
            "--hidden",
            str(model.hidden_size),
            "--ffn",
            str(moe.expert_ffn if moe else model.layers[0].dense_ffn),
        ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        raise SpecError(f"piper profile: torchrun exceeded --timeout-s {args.timeout_s}") from None
    if proc.returncode != 0 or not raw_path.exists():
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        errors = [ln for ln in lines if ln.startswith("runtime.bench.profile:") or "Error:" in ln]
        raise ProfileFailed("\n".join(errors[-3:] + lines[-12:]))


def run(args: argparse.Namespace) -> int:
    from planner.calibrate.profile_tables import profile_to_cluster_dict, profile_yaml
    from planner.inputs.clusters import load_cluster

    if args.nproc < 1:
        raise SpecError(f"--nproc {args.nproc}: must be at least 1")
    if not args.raw:  # the benchmarks run on torch; converting a raw JSON does not
        check_torch()
    out = Path(args.out or CLUSTERS_DIR / f"measured-{socket.gethostname()}.yaml")
    if args.raw:
        fix = "pass the raw JSON that 'piper profile --keep-raw' wrote"
        raw = load_json_file(args.raw, "raw profile", fix)
        if not isinstance(raw, dict):
            raise SpecError(f"{args.raw}: the raw measurements are not a JSON object; {fix}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            raw_path = Path(tmp) / "raw.json"
            try:
                with progress(f"profiling on {args.nproc} processes"):
                    _launch(args, raw_path)
            except ProfileFailed as exc:
                print(
                    f"piper profile: the benchmarks failed; nothing was written\n{exc}",
                    file=sys.stderr,
                )
                return 1
            raw = json.loads(raw_path.read_text())
    base_name = args.base or (
        "h200" if (raw.get("machine") or {}).get("backend") == "nccl" else "cpu-gloo"
    )
    cluster = profile_to_cluster_dict(raw, load_cluster(base_name), args.name or out.stem)
    files = {out.name: profile_yaml(cluster)}
    if args.keep_raw:
        files_raw = {Path(args.keep_raw).name: json.dumps(raw, indent=1) + "\n"}
        write_files(Path(args.keep_raw).parent, files_raw)
    write_files(out.parent, files)
    print(
        f"wrote {out}: {len(cluster['tables'])} tables from {raw['machine']['nproc']} "
        f"{raw['machine']['backend']} ranks on {raw['machine']['hostname']}"
    )
    # numbers as print_table writes them: message sizes in full bytes, never 1.049e+06
    rows = [(t["name"], t["x"][0], t["x"][-1], max(t["y"])) for t in cluster["tables"]]
    print_table("measured tables", ("table", "x from", "x to", "y max"), rows)
    return 0
