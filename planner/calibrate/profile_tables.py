"""Turn `runtime/bench/profile.py` measurements into a cluster profile the planner reads directly.

The result is the YAML structure of `planner.inputs.clusters` (a base cluster's shape and levels)
with the measured device numbers and these tables (x ascending). Compute tables hold training
throughput, y = 3 x forward FLOPs / forward + backward seconds, the way
planner.resources.compute prices a GEMM or attention from them:
- `gemm_<dtype>`: x = tokens M of one GEMM at the profiled K x N, y = TFLOPS;
- `gemm_grouped_<dtype>` / `gemm_looped_<dtype>`: x = tokens per expert, y = TFLOPS of the
  expert GEMMs in one batched call / one call per expert, at the first expert shape;
  `gemm_grouped_<dtype>_<K>x<N>`: the same at every profiled expert shape K x N;
- `attention_<dtype>`: x = sequence length, y = causal attention TFLOPS (2 b h s^2 d_h
  forward) at the profiled head dim; `attention_<dtype>_hd<D>` at the other head dims D;
- `membw`: x = bytes copied, y = GB/s (read + write);
- `permute_<dtype>` / `unpermute_<dtype>`: x = tokens T, y = GB/s counting (1 + k) T d
  elements, the resource model's bytes for the MoE permute and unpermute;
- `a2a_<level>`: x = bytes per rank, y = GB/s per rank; `p2p_<level>`: x = message bytes,
  y = GB/s one way. <level> is the base cluster's level that the measured ranks span.
plus a `machine` block (hostname, device, torch, date, backend, ranks) that the loader ignores.
The device block takes the largest measured copy's bandwidth as `hbm_gbps`; `gemm_efficiency` and
`attention_efficiency` are the best measured / peak; `hbm_efficiency` is what the permute
kernels reach of that bandwidth (hbm_efficiency_from), within its EFFICIENCIES bounds. On
gloo, `layer_overhead_us` is the host time per layer the runtime's own layers take beyond their
priced compute (planner/calibrate/host_time.py); the measured rows go to the machine block.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml

from planner.calibrate.host_time import host_rows, layer_overhead_us
from planner.inputs.clusters import cluster_from_dict, cluster_to_dict
from planner.specs import EFFICIENCIES, ClusterSpec, SpecError
from planner.topology import span_level_index

log = logging.getLogger(__name__)


def _table(name: str, x: list[float], y: list[float]) -> dict[str, Any]:
    pairs = sorted((float(a), float(b)) for a, b in zip(x, y, strict=True) if b > 0)
    return {"name": name, "x": [a for a, _ in pairs], "y": [b for _, b in pairs]}


def comm_level(base: ClusterSpec, ranks: list[int], ranks_per_node: int) -> str:
    """Name of the base cluster level that measured `ranks` span.

    Measured rank r sits on node r // ranks_per_node; it is mapped to the same local slot of
    the same node in the base cluster, so the base's levels name the traffic.
    """
    if ranks_per_node > base.gpus_per_node:
        raise SpecError(
            f"--ranks-per-node {ranks_per_node} (declared, or ranks sharing a hostname) exceeds "
            f"the base cluster {base.name}'s gpus_per_node {base.gpus_per_node}; pass a smaller "
            "--ranks-per-node or a --base whose nodes are as large"
        )
    devices = [(r // ranks_per_node) * base.gpus_per_node + r % ranks_per_node for r in ranks]
    if max(devices) >= base.total_gpus:
        raise SpecError(f"profile spans more nodes than base cluster {base.name} has")
    return base.levels[max(span_level_index(base, devices), 0)].name


def profile_to_cluster_dict(raw: dict[str, Any], base: ClusterSpec, name: str) -> dict[str, Any]:
    """The cluster YAML structure for measurements `raw` (runtime/bench/profile.py's JSON).

    Raises SpecError when the raw file lacks a field or does not fit the base cluster.
    """
    try:
        machine = raw["machine"]
        compute = raw["compute"]
        dtype = machine["dtype"]
        rpn = int(machine["ranks_per_node"])
        comm = raw.get("comm", [])
    except (KeyError, TypeError) as exc:
        raise SpecError(f"profile raw JSON: missing field {exc}; re-run 'piper profile'") from None
    out = cluster_to_dict(base)
    out["name"] = name
    out["source"] = (
        f"piper profile on {machine['hostname']} at {machine['date']} (base {base.name})"
    )
    try:
        tables = _compute_tables(compute, dtype)
    except (KeyError, TypeError) as exc:
        raise SpecError(
            f"profile raw JSON: compute block lacks {exc}; re-run 'piper profile'"
        ) from None
    for row in comm:
        level = comm_level(base, row["ranks"], rpn)
        tables.append(_table(f"{row['kind']}_{level}", row["x"], row["y"]))
    out["tables"] = [t for t in tables if t["x"]]
    out["machine"] = dict(machine)
    _apply_device(out, dtype, compute)
    cluster = cluster_from_dict(out, source=f"profile {name}")  # what the planner reads must load
    if raw.get("layers"):
        rows = host_rows(raw["layers"], cluster, dtype)
        out["machine"]["layer_host"] = rows
        if machine.get("backend") != "nccl":
            out["layer_overhead_us"] = round(layer_overhead_us(rows), 1)
    return out


def _compute_tables(compute: dict, dtype: str) -> list[dict[str, Any]]:
    """The compute, memory and permute tables of a raw `compute` block; the per-shape,
    per-head-dim and permute entries are optional (older raw files lack them)."""
    tables = [
        _table(f"gemm_{dtype}", compute["gemm"]["x"], compute["gemm"]["y"]),
        _table(f"gemm_grouped_{dtype}", compute["gemm_grouped"]["x"], compute["gemm_grouped"]["y"]),
        _table(f"gemm_looped_{dtype}", compute["gemm_looped"]["x"], compute["gemm_looped"]["y"]),
    ]
    for shape in compute.get("gemm_grouped_shapes", []):
        name = f"gemm_grouped_{dtype}_{shape['k']}x{shape['n']}"
        if all(t["name"] != name for t in tables):
            tables.append(_table(name, shape["x"], shape["grouped"]))
    att = compute["attention"]
    tables.append(_table(f"attention_{dtype}", att["x"], att["y"]))
    for head in compute.get("attention_head_dims", []):
        if head["head_dim"] != att.get("head_dim"):
            tables.append(_table(f"attention_{dtype}_hd{head['head_dim']}", head["x"], head["y"]))
    tables.append(_table("membw", compute["membw"]["x"], compute["membw"]["y"]))
    for kind in ("permute", "unpermute"):
        if kind in compute:
            tables.append(_table(f"{kind}_{dtype}", compute[kind]["x"], compute[kind]["y"]))
    return tables


def hbm_efficiency_from(compute: dict, hbm_gbps: float) -> float | None:
    """The fraction of `hbm_gbps` the MoE permute kernels reach: at each measured T the
    GB/s of a permute followed by an unpermute (their bytes over their summed time), the
    best T, divided by hbm_gbps and held within EFFICIENCIES' bounds for hbm_efficiency.
    None when the raw file has no permute measurements."""
    perm, unperm = compute.get("permute"), compute.get("unpermute")
    if not perm or not unperm or hbm_gbps <= 0:
        return None
    pairs = [
        2.0 / (1.0 / a + 1.0 / b)
        for a, b in zip(perm["y"], unperm["y"], strict=True)
        if a > 0 and b > 0
    ]
    if not pairs:
        return None
    bounds = next(e for e in EFFICIENCIES if e.name == "hbm_efficiency")
    return min(max(max(pairs) / hbm_gbps, bounds.low), bounds.high)


def _apply_device(out: dict[str, Any], dtype: str, compute: dict) -> None:
    """Measured memory bandwidth, large-GEMM / attention efficiencies and the permute
    kernels' hbm_efficiency; a declared peak below the measured throughput (CPU guesses) is
    raised to the measurement."""
    dev = out["device"]
    dev["name"] = str(out["machine"].get("device") or dev["name"])
    copies = sorted(zip(compute["membw"]["x"], compute["membw"]["y"], strict=True))
    dev["hbm_gbps"] = copies[-1][1]  # the largest copy: smaller ones may sit in the cache
    best_gemm = max(compute["gemm"]["y"] + compute["gemm_grouped"]["y"])
    peak = dev["peak_tflops"].get(dtype, 0.0)
    if best_gemm > peak:
        log.warning(
            "measured %.3g TFLOPS above %s peak %.3g; raising the peak", best_gemm, dtype, peak
        )
        dev["peak_tflops"][dtype] = peak = best_gemm
    out["gemm_efficiency"] = min(best_gemm / peak, 1.0)
    out["attention_efficiency"] = min(max(compute["attention"]["y"]) / peak, 1.0)
    hbm_eff = hbm_efficiency_from(compute, dev["hbm_gbps"])
    if hbm_eff is not None:
        out["hbm_efficiency"] = hbm_eff


def profile_yaml(cluster_dict: dict[str, Any]) -> str:
    """YAML text of a measured profile, with a header saying where it came from."""
    m = cluster_dict.get("machine", {})
    head = (
        f"# Measured by `piper profile` on {m.get('hostname')} ({m.get('device')}), "
        f"torch {m.get('torch')}, {m.get('backend')}, {m.get('nproc')} ranks, "
        f"{m.get('date')}.\n# Tables: see planner/PROFILING.md.\n"
    )
    return head + yaml.safe_dump(cluster_dict, sort_keys=False, default_flow_style=None, width=100)
