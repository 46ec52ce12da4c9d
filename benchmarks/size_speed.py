"""`piper size` wall time: DeepSeek-V3, 8 sizes x 2 presets, the whole command.

Runs `piper size --model deepseek-v3 --tokens 14.8T --cluster h800,h100 --gpus 128..16384
--dtype fp8` as a child process (start-up, 16 plans, files and plot) at the default global batch
(1,024 sequences) and at DeepSeek-V3's (15,360: more micro-batch counts to search), each with the
default --jobs (the CPUs available) and with --jobs 1, --repeat times, and prints each run's wall
and CPU seconds (the child's and its workers'), the rows planned, and the load average of the
machine before and after (the machine may be shared: CPU seconds say what the command cost).
Target from the issue: the whole command <= 60 s.

Run: OMP_NUM_THREADS=1 python3 benchmarks/size_speed.py [--repeat 1] [--no-results]
Writes what it prints to results/size_speed.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import ROOT, recorded

TARGET_S = 60.0
COMMAND = [
    "size",
    "--model",
    "deepseek-v3",
    "--tokens",
    "14.8T",
    "--cluster",
    "h800,h100",
    "--gpus",
    "128..16384",
    "--dtype",
    "fp8",
]


VARIANTS = (
    ("batch 1,024, default --jobs", []),
    ("batch 1,024, --jobs 1", ["--jobs", "1"]),
    ("batch 15,360, default --jobs", ["--global-batch", "15360"]),
    ("batch 15,360, --jobs 1", ["--global-batch", "15360", "--jobs", "1"]),
)


def run_once(out: Path, extra: list[str]) -> tuple[float, float, int, int]:
    """(wall s, CPU s of the child and its workers, rows, rows planned) of one `piper size`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    code = "import sys; from planner.cli import main; sys.exit(main())"
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, *COMMAND, *extra, "--out", str(out)],
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = list(csv.DictReader((out / "sizes.csv").open()))
    return wall, cpu, len(rows), sum(1 for r in rows if r["days"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--results", default="results/size_speed.md")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    with recorded(args.results, "piper size wall time", enabled=not args.no_results):
        print("piper " + " ".join(COMMAND))
        print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        with tempfile.TemporaryDirectory() as tmp:
            for v, (name, extra) in enumerate(VARIANTS):
                walls = []
                for k in range(args.repeat):
                    wall, cpu, rows, planned = run_once(Path(tmp) / f"run{v}-{k}", extra)
                    walls.append(wall)
                    print(
                        f"{name}: wall {wall:.1f} s, CPU {cpu:.1f} s, {rows} rows "
                        f"({planned} planned), {wall / rows:.2f} s per size"
                    )
                best = min(walls)
                verdict = "PASS" if best <= TARGET_S else "FAIL"
                print(
                    f"  fastest wall {best:.1f} s vs target {TARGET_S:.0f} s: {verdict}; load "
                    f"average now {os.getloadavg()[0]:.1f}"
                )


if __name__ == "__main__":
    main()
