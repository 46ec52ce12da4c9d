"""A cluster profile's analytic prediction beside `piper profile`'s measurements, per table.

`python -m runtime.bench.predicted_vs_measured RAW.json [--base h200]`

RAW.json is runtime/bench/profile.py's output (`--raw-out`, or `piper profile --keep-raw`).
For every measured point the base cluster's constants (its gemm_efficiency,
grouped_gemm_half_rows, attention_efficiency, hbm_gbps and hbm_efficiency; its own tables
where it has any) predict the same kernel the way planner.resources.compute prices it, in
the bench's units:
- dense and grouped expert GEMMs: gemm_time for the forward, dgrad and wgrad GEMMs
  (3 x 2 M K N FLOPs, x E experts; bytes 3 x (weights + inputs + outputs)), as TFLOPS;
- attention: the fused kernel's FLOPs (whole diagonal tiles) at attention_efficiency x the
  head-dim factor, plus its launches, as TFLOPS of 3 x 2 h s^2 d_h useful FLOPs;
- copy: hbm_gbps; permute / unpermute: hbm_gbps x hbm_efficiency (the bench counts the
  bytes the resource model counts).
Error = (predicted - measured) / measured. Prints one table and returns 0; a missing or
malformed file is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

from planner.calibrate.profile_tables import hbm_efficiency_from
from planner.inputs.clusters import load_cluster
from planner.inputs.json_errors import load_json_file
from planner.resources.compute import (
    ATTN_TILE,
    KERNEL_LAUNCH_S,
    TRAIN_FACTOR,
    attention_head_efficiency,
    gemm_time,
)
from planner.specs import AttentionSpec, ClusterSpec, SpecError, TrainingSpec

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Point:
    table: str
    x: float
    predicted: float
    measured: float
    unit: str

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def _gemm_tflops(
    cluster: ClusterSpec, tr: TrainingSpec, m: float, k: int, n: int, experts: int, grouped: bool
) -> float:
    flops = TRAIN_FACTOR * 2.0 * experts * m * k * n
    nbytes = _BYTES.get(tr.dtype, 2) * 3 * experts * (k * n + m * (k + n))
    t, _ = gemm_time(cluster, tr, m, flops, nbytes, 3, grouped)
    return flops / t / 1e12


def _attention_tflops(cluster: ClusterSpec, dtype: str, s: float, d: int, heads: int) -> float:
    """What attention_work predicts for the bench's kernel (one sequence, `heads` heads)."""
    useful = TRAIN_FACTOR * 2.0 * heads * s * s * d
    ctx = (s + 1) / 2
    modelled = TRAIN_FACTOR * 2.0 * heads * s * ctx * 2 * d
    kernel = modelled * min((s + ATTN_TILE) / 2, s) / ctx
    att = AttentionSpec(kind="mha", num_heads=heads, num_kv_heads=heads, head_dim=d)
    eff = cluster.attention_efficiency * attention_head_efficiency(att)
    t = kernel / (cluster.device.peak(dtype) * 1e12 * eff) + 3 * KERNEL_LAUNCH_S
    return useful / t / 1e12


def points(raw: dict, base: ClusterSpec) -> list[Point]:
    """Predicted beside measured for every measured compute and memory point of `raw`."""
    compute, sizes = raw["compute"], raw["sizes"]
    dtype = raw["machine"]["dtype"]
    tr = TrainingSpec(dtype=dtype)
    out: list[Point] = []
    k, n = sizes["gemm_k"], sizes["gemm_n"]
    for m, y in zip(compute["gemm"]["x"], compute["gemm"]["y"], strict=True):
        pred = _gemm_tflops(base, tr, m, k, n, 1, grouped=False)
        out.append(Point(f"gemm {k}x{n}", m, pred, y, "TFLOPS"))
    experts = sizes["experts"]
    for shape in compute.get("gemm_grouped_shapes", []):
        for m, y in zip(shape["x"], shape["grouped"], strict=True):
            pred = _gemm_tflops(base, tr, m, shape["k"], shape["n"], experts, grouped=True)
            name = f"grouped {shape['k']}x{shape['n']} {shape.get('model', '')}".rstrip()
            out.append(Point(name, m, pred, y, "TFLOPS"))
    main_head = {"head_dim": sizes["attn_head_dim"], **compute["attention"]}
    heads = list(compute.get("attention_head_dims", []))
    if all(h["head_dim"] != main_head["head_dim"] for h in heads):
        heads.insert(0, main_head)
    for head in heads:
        d = head["head_dim"]
        for s, y in zip(head["x"], head["y"], strict=True):
            pred = _attention_tflops(base, dtype, s, d, sizes["attn_heads"])
            out.append(Point(f"attention hd{d}", s, pred, y, "TFLOPS"))
    copies = sorted(zip(compute["membw"]["x"], compute["membw"]["y"], strict=True))
    for nbytes, y in copies:
        out.append(Point("copy", nbytes, base.device.hbm_gbps, y, "GB/s"))
    streamed = base.hbm_bytes_per_s / 1e9
    for kind in ("permute", "unpermute"):
        if kind in compute:
            for t, y in zip(compute[kind]["x"], compute[kind]["y"], strict=True):
                out.append(Point(kind, t, streamed, y, "GB/s"))
    return [p for p in out if p.measured > 0]


def report(raw: dict, base: ClusterSpec) -> str:
    """The printed comparison: every point, then per table the median |error|."""
    rows = points(raw, base)
    machine = raw["machine"]
    lines = [
        f"predicted ({base.name}'s constants) vs measured ({machine['device']}, "
        f"{machine['dtype']}, torch {machine['torch']})",
        f"{'table':<34} {'x':>10} {'predicted':>10} {'measured':>10} {'unit':>6} {'error':>8}",
    ]
    for p in rows:
        lines.append(
            f"{p.table:<34} {p.x:>10.4g} {p.predicted:>10.4g} {p.measured:>10.4g} "
            f"{p.unit:>6} {100 * p.error:>+7.1f}%"
        )
    lines.append("median |error| per table:")
    for table in dict.fromkeys(p.table for p in rows):
        mid = statistics.median(abs(p.error) for p in rows if p.table == table)
        lines.append(f"  {table:<34} {100 * mid:6.1f}%")
    copies = sorted(zip(raw["compute"]["membw"]["x"], raw["compute"]["membw"]["y"], strict=True))
    eff = hbm_efficiency_from(raw["compute"], copies[-1][1])
    if eff is not None:
        lines.append(
            f"hbm_efficiency: {base.name} {base.hbm_efficiency:.3g} (x {base.device.hbm_gbps:.0f} "
            f"GB/s = {base.hbm_bytes_per_s / 1e9:.0f}); measured {eff:.3g} (x "
            f"{copies[-1][1]:.0f} GB/s = {eff * copies[-1][1]:.0f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.predicted_vs_measured")
    p.add_argument("raw", help="runtime/bench/profile.py's raw JSON")
    p.add_argument("--base", default="h200", help="cluster whose constants predict")
    args = p.parse_args(argv)
    try:
        fix = "pass the raw JSON of runtime/bench/profile.py"
        raw = load_json_file(args.raw, "raw profile", fix)
        text = report(raw, load_cluster(args.base))
    except (KeyError, TypeError) as exc:
        print(
            f"predicted_vs_measured: {args.raw}: missing field {exc}; re-run the profile",
            file=sys.stderr,
        )
        return 2
    except SpecError as exc:
        print(f"predicted_vs_measured: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
