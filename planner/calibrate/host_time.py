"""layer_overhead_us from the host time `piper profile` measured per layer.

runtime/bench/host_time.py times the forward + backward of one layer of each kind of a small
model, alone on each rank, at shapes whose compute is small. The resource model prices the
same layer (planner.resources.layer_cost at pp = dp = ep = 1, one micro-batch) from the
profile's own tables with no host time; what the measurement has beyond that price is the
layer's host time. layer_overhead_us is its mean over the model's layers (each kind weighted
by how many layers it has), within the constant's bounds.

Only where the host is the device (gloo, CPU ranks) does that time add to every layer as the
model adds it. On a GPU the host enqueues kernels ahead of the device, and its time shows only
where a layer's kernels are shorter than their launches; there the measurement is recorded
beside the profile but layer_overhead_us stays the base cluster's (a fitted constant).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner.specs import EFFICIENCIES, ClusterSpec, SpecError


def host_rows(layers: dict[str, Any], cluster: ClusterSpec, dtype: str) -> list[dict[str, Any]]:
    """Per measured layer: measured and priced seconds and the host time between them.

    Args:
        layers: the raw profile's `layers` block (model, seq_len, micro_batch, rows of
            layer, kind, count, fwd_s, bwd_s).
        cluster: the profile being written (its tables price the layer).
        dtype: the profile's dtype ("fp32" on CPU).
    """
    from planner.inputs.models import load_model
    from planner.resources.layer_cost import layer_alone

    try:
        model = load_model(str(layers["model"]))
        mb, seq = int(layers["micro_batch"]), int(layers["seq_len"])
        measured = [(int(r["layer"]), str(r["kind"]), int(r["count"]),
                     float(r["fwd_s"]) + float(r["bwd_s"])) for r in layers["rows"]]  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(
            f"profile raw JSON: the layers block lacks {exc}; re-run 'piper profile'"
        ) from None
    bare = replace(cluster, layer_overhead_us=0.0)
    out = []
    for index, kind, count, seconds in measured:
        priced = layer_alone(model, index, bare, seq, mb, dtype).time_s
        out.append({"layer": index, "kind": kind, "count": count, "measured_s": seconds,
                    "priced_s": priced, "host_s": max(seconds - priced, 0.0)})  # fmt: skip
    return out


def layer_overhead_us(rows: list[dict[str, Any]]) -> float:
    """The layers' host time in us, weighted by their counts, within the constant's bounds."""
    bounds = next(e for e in EFFICIENCIES if e.name == "layer_overhead_us")
    total = sum(r["count"] for r in rows)
    mean_s = sum(r["count"] * r["host_s"] for r in rows) / total if total else 0.0
    return min(max(mean_s * 1e6, bounds.low), bounds.high)
