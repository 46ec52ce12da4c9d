"""Cluster profiles: load a ClusterSpec from a preset name or a YAML file, and write one back.

A cluster YAML (see profiles/clusters/*.yaml) has the keys of `ClusterSpec`: `name`,
`device` {name, memory_gib, peak_tflops {dtype: TFLOPS}, hbm_gbps}, `gpus_per_node`,
`num_nodes`, `nics_per_node`, `nic_gbps`, `levels` (innermost first, each {name, devices,
bw_gbps, latency_us, taper, kind}) and optional `framework_overhead_gib`,
`gemm_efficiency`, `attention_efficiency`, `msg_overhead_us` (per-message software cost of
the all-to-all, >= 0, default 1.0; shared by the analytic model and `piper a2a-sim`), the
other named efficiencies of `planner.specs.EFFICIENCIES` (`grouped_gemm_half_rows`,
`hbm_efficiency`, `layer_overhead_us`, `scale_up_efficiency`, `scale_out_efficiency`,
`overlap_efficiency`) and of `TOPOLOGY_EFFICIENCIES` (`network_jitter_us`, >= 0, default 0),
`cuda_graphs` (true / false), `calibration` (a mapping of scalars:
where fitted constants come from and the fit's errors, written by `piper calibrate --fit`),
`topology`, `source` and `tables` (measured efficiency tables {name, x, y}, written by
`piper profile`).

Every number must be finite and within a physical bound (MAX_COUNT for counts, MAX_MEMORY_GIB,
MAX_GBPS, MAX_TFLOPS, MAX_US, else MAX_NUMBER). The file is read by
planner/inputs/safe_read.py and its YAML by planner/inputs/yaml_text.py (a key given twice,
nesting past the stack, an integer of more than 4300 digits or aliases expanding past a
million values is a yaml.YAMLError); values quoted in errors are cut short
(planner/inputs/shown.py). Every validation failure raises SpecError with
one line naming the file, the field and the fix.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from planner.inputs.paths import CLUSTERS_DIR
from planner.inputs.safe_read import read_input_bytes
from planner.inputs.shown import shown, shown_text
from planner.inputs.yaml_text import load_yaml, yaml_fault
from planner.specs import (
    ClusterSpec,
    DeviceSpec,
    EfficiencyTable,
    LevelSpec,
    SpecError,
    peak_key,
)

_OPTIONAL_FLOATS = ("framework_overhead_gib", "gemm_efficiency", "attention_efficiency",
                    "grouped_gemm_half_rows", "hbm_efficiency", "scale_up_efficiency",
                    "scale_out_efficiency")  # fmt: skip
_NON_NEGATIVE_FLOATS = ("msg_overhead_us", "layer_overhead_us", "overlap_efficiency",
                        "network_jitter_us")  # fmt: skip
_FRACTIONS = ("gemm_efficiency", "attention_efficiency", "hbm_efficiency", "scale_up_efficiency",
              "scale_out_efficiency", "overlap_efficiency")  # fmt: skip
_TOP_KEYS = ("name", "device", "gpus_per_node", "num_nodes", "nics_per_node", "nic_gbps",
             "levels", "tables", "topology", "source", "cuda_graphs", "calibration",
             *_OPTIONAL_FLOATS, *_NON_NEGATIVE_FLOATS)  # fmt: skip
_LEVEL_KEYS = ("name", "devices", "bw_gbps", "latency_us", "taper", "kind")
# Upper bounds far above any machine: they keep every product of the cost model finite
# (a memory of 1e308 GiB in bytes is inf, and NaN after a subtraction).
MAX_COUNT = 1 << 20  # GPUs per node, nodes, NICs per node, devices of a level, SMs
MAX_MEMORY_GIB = 1e6
MAX_GBPS = 1e6  # HBM, NIC and level bandwidths, GB/s
MAX_TFLOPS = 1e6
MAX_US = 1e7  # latencies and per-message, per-layer or jitter times, microseconds (10 s)
MAX_NUMBER = 1e30  # any other number (efficiencies, table points)
_MAXIMA = {
    "memory_gib": MAX_MEMORY_GIB, "framework_overhead_gib": MAX_MEMORY_GIB,
    "hbm_gbps": MAX_GBPS, "nic_gbps": MAX_GBPS, "bw_gbps": MAX_GBPS,
    "latency_us": MAX_US, "msg_overhead_us": MAX_US, "layer_overhead_us": MAX_US,
    "network_jitter_us": MAX_US,
}  # fmt: skip
_KINDS = {
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "a mapping",
    list: "a list",
    type(None): "nothing (null)",
}


def list_cluster_presets() -> list[str]:
    """Names of the cluster presets under profiles/clusters/, sorted."""
    return sorted(p.stem for p in CLUSTERS_DIR.glob("*.yaml"))


def load_cluster(name_or_path: str) -> ClusterSpec:
    """Load a cluster preset by name (e.g. "frontier") or a cluster YAML by path.

    Raises SpecError for an unknown preset (listing the closest names), an unreadable file
    or an invalid field.
    """
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = CLUSTERS_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            presets = list_cluster_presets()
            close = difflib.get_close_matches(name_or_path, presets, n=3, cutoff=0.4)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise SpecError(
                f"cluster '{name_or_path}': no such preset or file; {hint}"
                f"presets: {', '.join(presets)}"
            )
    if not path.is_file():
        raise SpecError(f"cluster file {path}: not found; give a preset name or a YAML path")
    try:
        data = load_yaml(read_input_bytes(path, "cluster file").decode("utf-8"))
    except UnicodeDecodeError:
        raise SpecError(f"cluster file {path}: not a text file; a cluster is YAML") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"cluster file {path}: invalid YAML{yaml_fault(exc)}; fix it") from None
    return cluster_from_dict(data, source=str(path))


def load_cluster_nodes(name_or_path: str, nodes: int | None) -> ClusterSpec:
    """load_cluster, resized to `nodes` nodes (with_nodes) unless `nodes` is None."""
    cluster = load_cluster(name_or_path)
    return cluster if nodes is None else with_nodes(cluster, nodes)


def with_nodes(cluster: ClusterSpec, nodes: int) -> ClusterSpec:
    """`cluster` resized to `nodes` nodes (`--nodes`): the levels inside the new system keep
    their size, the smallest level that holds all of it becomes the outermost with exactly
    nodes x gpus_per_node devices (keeping its bandwidth, latency and taper), and any level
    above it goes. Shrinking h100 (node 8, leaf 256, spine 1,024) to 16 nodes leaves node 8
    and leaf 128; growing it to 256 nodes gives node 8, leaf 256, spine 2,048. A resized
    profile is named NAME-<nodes>n (h100-256n; resized again, the suffix is replaced); the
    profile's own size returns it unchanged.
    A SpecError naming --nodes when `nodes` < 1."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise SpecError(
            f"--nodes must be a positive integer (nodes of {cluster.name}), got {nodes}; "
            "pass 1 or more"
        )
    if nodes == cluster.num_nodes:
        return cluster
    total = nodes * cluster.gpus_per_node
    last = len(cluster.levels) - 1
    outer = next((i for i, lv in enumerate(cluster.levels) if lv.devices >= total), last)
    levels = (*cluster.levels[:outer], replace(cluster.levels[outer], devices=total))
    # The kept levels nest as before and the new outermost is larger than all of them and
    # made of whole nodes, so every rule of _check_levels holds for any nodes >= 1. A new
    # name: plans made on it embed the resized profile and are not checked against the
    # preset (piper run refuses a plan whose preset changed since planning).
    base = re.sub(r"-\d+n$", "", cluster.name)  # resized again: b200-64n -> b200-32n
    return replace(cluster, name=f"{base}-{nodes}n", num_nodes=nodes, levels=levels)


def check_dtype(cluster: ClusterSpec, dtype: str, where: str) -> None:
    """Raise SpecError naming `where` (the cluster preset or file) when the device has no peak
    TFLOPS for `dtype`."""
    have = [name for name, _ in cluster.device.peak_tflops]
    key = peak_key(dtype)  # fp8_blockwise runs at the fp8 rate
    if key not in have:
        raise SpecError(
            f"cluster {where}: field 'device.peak_tflops' has no "
            f"{key} entry ({', '.join(have)}); add {key}: <dense TFLOPS> or use --dtype "
            f"{have[0]}"
        )


def cluster_from_dict(data: Any, source: str = "<dict>") -> ClusterSpec:
    """Parse and validate the YAML structure of a cluster profile (see the module docstring)."""
    if not isinstance(data, dict):
        raise SpecError(f"cluster file {source}: top level must be a mapping of cluster fields")
    reader = _Reader(source)
    reader.no_typos(data, _TOP_KEYS, "")
    device = _parse_device(reader, reader.get(data, "device", dict))
    cluster = ClusterSpec(
        name=reader.get(data, "name", str),
        device=device,
        gpus_per_node=reader.positive_int(data, "gpus_per_node"),
        num_nodes=reader.positive_int(data, "num_nodes"),
        nics_per_node=reader.positive_int(data, "nics_per_node"),
        nic_gbps=reader.positive(data, "nic_gbps"),
        levels=tuple(
            _parse_level(reader, lv, i)
            for i, lv in enumerate(reader.get(data, "levels", list, nonempty=True))
        ),
        tables=tuple(
            _parse_table(reader, t, i)
            for i, t in enumerate(reader.get(data, "tables", list) if data.get("tables") else [])
        ),
        topology=str(data.get("topology", "")),
        source=str(data.get("source", "")),
        **{k: reader.positive(data, k) for k in _OPTIONAL_FLOATS if k in data},
        **{k: reader.non_negative(data, k) for k in _NON_NEGATIVE_FLOATS if k in data},
        **({"cuda_graphs": reader.flag(data, "cuda_graphs")} if "cuda_graphs" in data else {}),
        calibration=_parse_calibration(reader, data.get("calibration")),
    )
    _check_levels(cluster, source)
    overhead, memory = cluster.framework_overhead_gib, cluster.device.memory_gib
    if overhead >= memory:
        raise SpecError(
            f"cluster file {source}: field 'framework_overhead_gib'={overhead} leaves nothing of "
            f"the {memory} GiB device memory; use a smaller value"
        )
    for key in _FRACTIONS:
        if getattr(cluster, key) > 1.0:
            raise SpecError(f"cluster file {source}: {key} is a fraction; use a value <= 1")
    return cluster


def cluster_to_dict(cluster: ClusterSpec) -> dict[str, Any]:
    """The YAML structure of `cluster`; `cluster_from_dict` reads it back to an equal spec."""
    dev = cluster.device
    out: dict[str, Any] = {
        "name": cluster.name,
        "topology": cluster.topology,
        "source": cluster.source,
        "device": {
            "name": dev.name,
            "memory_gib": dev.memory_gib,
            "peak_tflops": {k: v for k, v in dev.peak_tflops},
            "hbm_gbps": dev.hbm_gbps,
            **({"sms": dev.sms} if dev.sms else {}),
        },
        "gpus_per_node": cluster.gpus_per_node,
        "num_nodes": cluster.num_nodes,
        "nics_per_node": cluster.nics_per_node,
        "nic_gbps": cluster.nic_gbps,
        "framework_overhead_gib": cluster.framework_overhead_gib,
        "gemm_efficiency": cluster.gemm_efficiency,
        "attention_efficiency": cluster.attention_efficiency,
        "msg_overhead_us": cluster.msg_overhead_us,
        "grouped_gemm_half_rows": cluster.grouped_gemm_half_rows,
        "hbm_efficiency": cluster.hbm_efficiency,
        "layer_overhead_us": cluster.layer_overhead_us,
        "cuda_graphs": cluster.cuda_graphs,
        "scale_up_efficiency": cluster.scale_up_efficiency,
        "scale_out_efficiency": cluster.scale_out_efficiency,
        "overlap_efficiency": cluster.overlap_efficiency,
        "network_jitter_us": cluster.network_jitter_us,
        "levels": [
            {
                "name": lv.name,
                "devices": lv.devices,
                "bw_gbps": lv.bw_gbps,
                "latency_us": lv.latency_us,
                "taper": lv.taper,
                "kind": lv.kind,
            }
            for lv in cluster.levels
        ],
    }
    if cluster.calibration:
        out["calibration"] = {k: _scalar(v) for k, v in cluster.calibration}
    if cluster.tables:
        out["tables"] = [{"name": t.name, "x": list(t.x), "y": list(t.y)} for t in cluster.tables]
    return out


def cluster_to_yaml(cluster: ClusterSpec) -> str:
    """`cluster_to_dict` as YAML text (keys in the order of the presets)."""
    return yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False)


class _Reader:
    """Typed field access that names the file and the field in every error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, fix: str) -> SpecError:
        return SpecError(f"cluster file {self.source}: field '{field}' {fix}")

    def get(self, d: dict, key: str, typ: type, where: str = "", nonempty: bool = False) -> Any:
        field = f"{where}{key}"
        kind = _KINDS.get(typ, typ.__name__)
        if key not in d:
            raise self.fail(field, f"is missing; add it ({kind})")
        value = d[key]
        if typ is str and isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, typ) or isinstance(value, bool):
            got = _KINDS.get(type(value), type(value).__name__)
            raise self.fail(field, f"must be {kind}, got {got} {shown(value)}")
        if nonempty and not value:
            raise self.fail(field, "must not be empty")
        return value

    def no_typos(self, d: dict, known: tuple[str, ...], where: str) -> None:
        """Reject a key that is a near miss of a known one (extra metadata keys are kept)."""
        for key in d:
            if key in known:
                continue
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.8)
            if close:
                raise self.fail(
                    f"{where}{shown_text(key)}", f"is not a field; did you mean '{close[0]}'?"
                )

    def number(self, d: dict, key: str, where: str, low: str, maximum: float | None) -> float:
        """A finite number in (0, maximum] (`low` "> 0") or [0, maximum] (`low` ">= 0");
        `maximum` None: the field's bound in _MAXIMA, else MAX_NUMBER."""
        field = f"{where}{key}"
        top = _MAXIMA.get(str(key), MAX_NUMBER) if maximum is None else maximum
        wanted = f"a number {low} 0 and <= {top:g}"
        if key not in d:
            raise self.fail(field, f"is missing; add {wanted}")
        value = d[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(field, f"must be {wanted}, got {shown(value)}")
        bad = not math.isfinite(value) or value < 0 or (low == ">" and value == 0)
        if bad or value > top:
            raise self.fail(field, f"must be {wanted}, got {shown(value)}")
        return float(value)

    def positive(self, d: dict, key: str, where: str = "", maximum: float | None = None) -> float:
        return self.number(d, key, where, ">", maximum)

    def non_negative(self, d: dict, key: str, where: str = "") -> float:
        return self.number(d, key, where, ">=", None)

    def flag(self, d: dict, key: str, where: str = "") -> bool:
        value = d.get(key)
        if not isinstance(value, bool):
            raise self.fail(f"{where}{key}", "use true or false")
        return value

    def positive_int(self, d: dict, key: str, where: str = "") -> int:
        value = self.get(d, key, int, where)
        if not 0 < value <= MAX_COUNT:
            raise self.fail(
                f"{where}{key}", f"must be an integer in [1, {MAX_COUNT}], got {shown(value)}"
            )
        return value


def _parse_calibration(r: _Reader, data: Any) -> tuple[tuple[str, str], ...]:
    """The `calibration` mapping as (key, text) pairs; values must be scalars."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise r.fail("calibration", "must be a mapping of names to numbers or text")
    out = []
    for key, value in data.items():
        if isinstance(value, dict | list):
            raise r.fail(f"calibration.{shown_text(key)}", "must be a number or text")
        out.append((str(key), str(value)))
    return tuple(out)


def _scalar(text: str) -> Any:
    """A calibration value back as a number where it reads as one."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _parse_device(r: _Reader, d: dict) -> DeviceSpec:
    r.no_typos(d, ("name", "memory_gib", "peak_tflops", "hbm_gbps", "sms"), "device.")
    peak = r.get(d, "peak_tflops", dict, "device.", nonempty=True)
    if "bf16" not in peak:  # the default training dtype; every accelerator Piper targets has it
        names = shown_text(", ".join(map(str, peak)), 80)
        raise r.fail("device.peak_tflops", f"has no bf16 entry ({names}); add bf16: <dense TFLOPS>")
    pairs = tuple((str(k), r.positive(peak, k, "device.peak_tflops.", MAX_TFLOPS)) for k in peak)
    return DeviceSpec(
        name=r.get(d, "name", str, "device."),
        memory_gib=r.positive(d, "memory_gib", "device."),
        peak_tflops=pairs,
        hbm_gbps=r.positive(d, "hbm_gbps", "device."),
        sms=r.positive_int(d, "sms", "device.") if "sms" in d else 0,
    )


def _parse_level(r: _Reader, lv: Any, i: int) -> LevelSpec:
    where = f"levels[{i}]."
    if not isinstance(lv, dict):
        raise r.fail(f"levels[{i}]", "must be a mapping {name, devices, bw_gbps, latency_us}")
    r.no_typos(lv, _LEVEL_KEYS, where)
    taper = r.positive(lv, "taper", where) if "taper" in lv else 1.0
    if taper > 1.0:
        raise r.fail(f"{where}taper", f"is a bandwidth fraction and must be <= 1, got {taper}")
    return LevelSpec(
        name=r.get(lv, "name", str, where),
        devices=r.positive_int(lv, "devices", where),
        bw_gbps=r.positive(lv, "bw_gbps", where),
        latency_us=r.non_negative(lv, "latency_us", where),
        taper=taper,
        kind=str(lv.get("kind", "")),
    )


def _parse_table(r: _Reader, t: Any, i: int) -> EfficiencyTable:
    where = f"tables[{i}]."
    if not isinstance(t, dict):
        raise r.fail(f"tables[{i}]", "must be a mapping {name, x, y}")
    x = r.get(t, "x", list, where, nonempty=True)
    y = r.get(t, "y", list, where, nonempty=True)
    if len(x) != len(y):
        raise r.fail(f"{where}y", f"must have as many values as x ({len(x)}), got {len(y)}")
    xs = tuple(r.positive({"x": v}, "x", where) for v in x)
    ys = tuple(r.positive({"y": v}, "y", where) for v in y)
    if any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
        raise r.fail(f"{where}x", "must be strictly increasing; sort the measurements by size")
    return EfficiencyTable(name=r.get(t, "name", str, where), x=xs, y=ys)


def _check_levels(c: ClusterSpec, source: str) -> None:
    """Levels nest: sizes strictly increase, each inner size divides the next, and every
    level is either inside a node (divides gpus_per_node) or made of whole nodes; the
    outermost level is the whole system (it may hold a partial last domain of the level
    below, as Frontier's 9,408 nodes do not fill whole dragonfly groups)."""
    total = c.total_gpus
    names = [lv.name for lv in c.levels]
    if len(set(names)) != len(names):
        raise SpecError(f"cluster file {source}: field 'levels' has duplicate names {shown(names)}")
    for i, lv in enumerate(c.levels):
        g = c.gpus_per_node
        if g % lv.devices and lv.devices % g:
            raise SpecError(
                f"cluster file {source}: field 'levels[{i}].devices'={lv.devices} must divide "
                f"gpus_per_node={g} or be a multiple of it"
            )
        if i == 0:
            continue
        inner = c.levels[i - 1].devices
        last = i == len(c.levels) - 1
        if lv.devices <= inner or (not last and lv.devices % inner):
            raise SpecError(
                f"cluster file {source}: field 'levels[{i}].devices'={lv.devices} must be a "
                f"larger multiple of levels[{i - 1}].devices={inner} (levels innermost first)"
            )
    if c.levels[-1].devices != total:
        raise SpecError(
            f"cluster file {source}: field 'levels[{len(c.levels) - 1}].devices'="
            f"{c.levels[-1].devices} must equal num_nodes x gpus_per_node = {total}; "
            "the outermost level is the whole system"
        )
