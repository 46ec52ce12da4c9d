"""What `piper size` is asked, parsed from text, and the cited defaults it prices with.

    parse_tokens("15T") -> 1.5e13            parse_duration_s("60d") -> 5_184_000.0
    parse_gpus("256..16384") -> (256, 512, ..., 16384)      parse_gpus("256,512") -> (256, 512)
    list_price(cluster) -> Price | None      device_power_w(cluster) -> (watts, source) | None

Every bad text raises SpecError naming the flag, the value and the form that is accepted.
planner/SIZING.md gives each default's source.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from planner.specs import ClusterSpec, SpecError

BatchRule = Literal["fixed", "sqrt"]
CheckpointMode = Literal["blocking", "async"]
BATCH_RULES: tuple[BatchRule, ...] = ("fixed", "sqrt")
CHECKPOINT_MODES: tuple[CheckpointMode, ...] = ("blocking", "async")

# Llama 3 405B pre-training: 419 unexpected interruptions in a 54-day snapshot on 16,384 H100s
# ("The Llama 3 Herd of Models", arXiv 2407.21783, section 3.3.4, Table 5).
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
FAILURES_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_GPUS * LLAMA3_DAYS * 24)  # 1.97e-5
# Relaunch after an interruption: requeue, process start, NCCL initialisation. ASSUMPTION (no
# source states it for a whole job); reading the checkpoint back is priced on top of it.
RESTART_S = 600.0
# Aggregate checkpoint storage bandwidth, GB/s: Llama 3's Tectonic file system sustains 2 TB/s
# ("The Llama 3 Herd of Models", section 3.3.1, Storage). Smaller clusters have less.
STORAGE_GBPS = 2000.0
# How each target saves, as the engine runs with the flags a Piper export writes: Piper's runtime
# saves with torch.distributed.checkpoint.async_save (runtime/checkpoint.py); Megatron-LM
# (--async-save off by default) and torchtitan (checkpoint.async_mode "disabled" by default)
# block while the checkpoint is written.
TARGET_CHECKPOINT_MODE: dict[str, CheckpointMode] = {
    "piper": "async",
    "megatron": "blocking",
    "torchtitan": "blocking",
}
# The batch rule's cap: DeepSeek-V3's largest batch, 15,360 sequences of 4,096 tokens
# ("DeepSeek-V3 Technical Report", arXiv 2412.19437, section 4.2), in tokens.
CRITICAL_BATCH_TOKENS = 15_360 * 4_096
MIN_MFU = 0.15  # below it a size is flagged: the GPUs mostly wait
MAX_DEFAULT_GPUS = 16_384  # the largest published single training job in the sources above
DEFAULT_SIZES = 8


@dataclass(frozen=True)
class Price:
    """A public price per GPU-hour (USD) and where it is listed."""

    usd_per_gpu_hour: float
    source: str


# Only prices a public source lists; a preset without one prices no cost unless
# --price-per-gpu-hour is given.
LIST_PRICES: dict[str, Price] = {
    "H800": Price(2.0, "DeepSeek-V3 Technical Report, Table 1: H800 rental at $2 per GPU-hour"),
}
# Device board power (TDP), W, from the vendors' data sheets; per GCD for the MI250X.
DEVICE_POWER_W: dict[str, tuple[float, str]] = {
    "H100": (700.0, "NVIDIA H100 SXM data sheet: max TDP 700 W"),
    "H800": (700.0, "NVIDIA H800 SXM data sheet: max TDP 700 W"),
    "H200": (700.0, "NVIDIA H200 SXM data sheet: max TDP 700 W"),
    "MI250X": (280.0, "AMD MI250X data sheet: 560 W per OAM of 2 GCDs"),
    "MI300X": (750.0, "AMD MI300X data sheet: 750 W"),
}


@dataclass(frozen=True)
class FailureModel:
    """Failures per GPU-hour, the relaunch time (s), checkpoint storage GB/s (aggregate) and the
    save mode (None: the target's, TARGET_CHECKPOINT_MODE)."""

    per_gpu_hour: float = FAILURES_PER_GPU_HOUR
    restart_s: float = RESTART_S
    storage_gbps: float = STORAGE_GBPS
    mode: CheckpointMode | None = None


@dataclass(frozen=True)
class SizeRequest:
    """One `piper size` question (planner/SIZING.md).

    tokens: training tokens; gpus: the sizes (None = default_sizes); global_batch: sequences at
    the smallest size; batch_rule "fixed" keeps it, "sqrt" scales it with sqrt(GPUs) up to
    critical_batch_tokens; price_usd: per GPU-hour for every cluster (None = LIST_PRICES);
    deadline_s: wall-clock target (None = none); time_limit_s: each IP solve's limit.
    """

    model: str
    clusters: tuple[str, ...]
    tokens: float
    gpus: tuple[int, ...] | None = None
    seq_len: int = 4096
    global_batch: int = 1024
    batch_rule: BatchRule = "fixed"
    critical_batch_tokens: float = CRITICAL_BATCH_TOKENS
    dtype: str = "bf16"
    target: str | None = None
    memory_margin: str | None = None
    price_usd: float | None = None
    deadline_s: float | None = None
    min_mfu: float = MIN_MFU
    failures: FailureModel = field(default_factory=FailureModel)
    solver: str = "cpsat"
    time_limit_s: float = 1.0
    seed: int = 0


_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}
_DURATION_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_tokens(text: str, flag: str = "--tokens") -> float:
    """'15T', '14.8T', '500B', '2e12' -> tokens (> 0); SpecError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]?)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SCALE or float(m.group(1)) <= 0:
        raise SpecError(
            f"{flag} {text!r}: not a token count; give a positive number with an optional K, M, "
            "B or T suffix (e.g. 15T, 500B)"
        )
    return float(m.group(1)) * _SCALE[unit]


def parse_duration_s(text: str, flag: str = "--deadline") -> float:
    """'60d', '12h', '2w', '90m', '3600s' -> seconds (> 0); SpecError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw])\s*", text)
    if m is None or float(m.group(1)) <= 0:
        raise SpecError(
            f"{flag} {text!r}: not a duration; give a positive number with a unit s, m, h, d "
            "or w (e.g. 60d, 12h)"
        )
    return float(m.group(1)) * _DURATION_S[m.group(2)]


def parse_gpus(text: str, flag: str = "--gpus") -> tuple[int, ...]:
    """'256..16384' (the powers of two from 256 to 16384; both ends powers of two) or
    '256,512,1024' (those sizes) -> sorted distinct GPU counts; SpecError otherwise."""
    bad = SpecError(
        f"{flag} {text!r}: give a range of powers of two LO..HI (e.g. 256..16384) or a comma "
        "list of positive GPU counts (e.g. 256,512,1024)"
    )
    if ".." in text:
        ends = text.split("..")
        if len(ends) != 2 or not all(e.strip().isdigit() for e in ends):
            raise bad
        lo, hi = (int(e) for e in ends)
        if lo < 1 or hi < lo or lo & (lo - 1) or hi & (hi - 1):
            raise bad
        return tuple(2**k for k in range(lo.bit_length() - 1, hi.bit_length()))
    words = [w.strip() for w in text.split(",")]
    if not words or not all(w.isdigit() and int(w) > 0 for w in words):
        raise bad
    return tuple(sorted({int(w) for w in words}))


def parse_clusters(text: str) -> tuple[str, ...]:
    """'h100,h800' -> ('h100', 'h800'), order kept, repeats dropped."""
    names = [w.strip() for w in text.split(",")]
    if not all(names):
        raise SpecError(
            f"--cluster {text!r}: an empty name; give presets or YAML paths, comma-separated"
        )
    return tuple(dict.fromkeys(names))


def _by_device(table: dict, cluster: ClusterSpec):
    name = cluster.device.name.upper()
    for key in sorted(table, key=len, reverse=True):
        if key in name:
            return table[key]
    return None


def list_price(cluster: ClusterSpec) -> Price | None:
    """The LIST_PRICES entry whose key the device name contains, or None."""
    return _by_device(LIST_PRICES, cluster)


def device_power_w(cluster: ClusterSpec) -> tuple[float, str] | None:
    """(board power W, source) of the cluster's device from DEVICE_POWER_W, or None."""
    return _by_device(DEVICE_POWER_W, cluster)


def batch_at(request: SizeRequest, gpus: int, smallest: int) -> tuple[int, bool]:
    """(global batch in sequences at `gpus`, whether the rule's cap was reached).

    "fixed": the request's batch at every size. "sqrt": B0 sqrt(gpus / smallest), the
    square-root scaling rule for Adam (Malladi et al., "On the SDEs and Scaling Rules for
    Adaptive Gradient Algorithms", NeurIPS 2022), rounded to 3 significant bits (so powers of two
    divide it) and capped at the critical batch (McCandlish et al., "An Empirical Model of
    Large-Batch Training", 2018: past it, more batch buys no fewer steps)."""
    b0 = request.global_batch
    if request.batch_rule == "fixed":
        return b0, False
    cap = max(1, int(request.critical_batch_tokens // request.seq_len))
    want = b0 * math.sqrt(gpus / smallest)
    step = 2 ** max(0, math.floor(math.log2(want)) - 2)
    rounded = max(1, round(want / step) * step)
    if cap <= b0:  # the user's batch is already past the cap: kept
        return b0, False
    return (cap, True) if rounded >= cap else (rounded, False)
