"""Evidence before fitting: the component-level measurements each named efficiency rests on
and the physical range they support, per hardware family (profiles/evidence/*.yaml).

A file has `family` (a name), `presets` (the cluster presets it covers), `evidence` and
`ranges`:

- each `evidence` entry {constant, quantity, value, source, mapping}: what was measured with
  its unit and shape, the number, where it was published (title and URL, or repository path
  and commit; paper section or table) and the arithmetic that maps it to the constant;
- each `ranges` entry {constant, low, high, summary, low_reason, high_reason} with optional
  `presets` (a subset of the file's; default all of them) and `flags`
  (`no_public_evidence`: the range comes from first principles, said in its reasons).

Every constant is a `planner.specs.EFFICIENCIES` or `TOPOLOGY_EFFICIENCIES` name, every range
lies inside that constant's bounds with low < high, a range not flagged `no_public_evidence`
has at least one evidence entry for its constant, and no preset gets two ranges for one
constant. A file that breaks a rule raises SpecError naming the file, the field and the fix.

`constants_outside(preset)` lists the preset's constants outside their range or at one end:
the values a refit inside the ranges will move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from planner.inputs.clusters import load_cluster
from planner.inputs.paths import PROFILES_DIR, read_text_file
from planner.inputs.yaml_text import load_yaml, yaml_fault
from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES, Efficiency, SpecError

EVIDENCE_DIR = PROFILES_DIR / "evidence"

# Which evidence file (profiles/evidence/<stem>.yaml) covers each cluster preset; None for
# an emulation with no hardware to measure.
EVIDENCE_OF_PRESET: dict[str, str | None] = {
    "h100": "h100", "h200": "h100", "h800": "h100",
    "b200": "b200", "b300": "b200",
    "gb200-nvl72": "gb200", "gb300-nvl72": "gb200",
    "frontier": "mi250x",
    "mi300x": "mi300x", "mi325x": "mi300x", "mi355x": "mi300x",
    "cpu-gloo": None,
}  # fmt: skip

FLAGS = ("no_public_evidence",)
FILE_KEYS = ("family", "presets", "evidence", "ranges")
EVIDENCE_KEYS = ("constant", "quantity", "value", "source", "mapping")
RANGE_TEXT_KEYS = ("summary", "low_reason", "high_reason")
RANGE_KEYS = ("constant", "low", "high", *RANGE_TEXT_KEYS, "presets", "flags")

Status = Literal["inside", "outside", "at end"]


@dataclass(frozen=True)
class Evidence:
    """One published component measurement and how it maps to a constant."""

    constant: str
    quantity: str  # what was measured, with unit and shape
    value: float
    source: str  # title + URL, or repository path + commit
    mapping: str  # the arithmetic from `value` to the constant


@dataclass(frozen=True)
class Range:
    """The physical range [low, high] of one constant for `presets`, each end with its reason."""

    constant: str
    low: float
    high: float
    summary: str  # the evidence in a few words
    low_reason: str
    high_reason: str
    presets: tuple[str, ...]
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvidenceFile:
    """A hardware family's evidence and ranges."""

    path: Path
    family: str
    presets: tuple[str, ...]
    evidence: tuple[Evidence, ...]
    ranges: tuple[Range, ...]

    def range_for(self, preset: str, constant: str) -> Range | None:
        """The range of `constant` that applies to `preset`, or None."""
        return next((r for r in self.ranges
                     if r.constant == constant and preset in r.presets), None)  # fmt: skip


@dataclass(frozen=True)
class ConstantCheck:
    """A preset's current value of one constant against its evidence range."""

    preset: str
    constant: str
    value: float
    low: float
    high: float
    status: Status
    summary: str
    flags: tuple[str, ...]


def _bounds() -> dict[str, Efficiency]:
    return {e.name: e for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES)}


def _fail(path: Path, field: str, problem: str, fix: str) -> SpecError:
    return SpecError(f"evidence file {path}: {field}: {problem}; {fix}")


def _mapping(raw: Any, path: Path, field: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _fail(path, field, "not a mapping", f"give the keys {', '.join(keys)}")
    unknown = sorted(str(k) for k in raw if k not in keys)
    if unknown:
        raise _fail(path, field, f"unknown key {unknown[0]}", f"use {', '.join(keys)}")
    return raw


def _text(raw: dict[str, Any], key: str, path: Path, field: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, f"{field}.{key}", "missing or empty", "give it as non-empty text")
    return value


def _number(raw: dict[str, Any], key: str, path: Path, field: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(path, f"{field}.{key}", f"{value!r} is not a finite number", "give a number")
    return float(value)


def _names(raw: Any, path: Path, field: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(n, str) for n in raw):
        raise _fail(path, field, "not a non-empty list of names", "list the names, e.g. [h100]")
    if len(set(raw)) != len(raw):
        raise _fail(path, field, "a name is listed twice", "list each name once")
    return tuple(raw)


def _constant(raw: dict[str, Any], path: Path, field: str) -> Efficiency:
    name = _text(raw, "constant", path, field)
    known = _bounds()
    if name not in known:
        raise _fail(path, f"{field}.constant", f"unknown constant {name}",
                    f"use one of {', '.join(known)}")  # fmt: skip
    return known[name]


def _evidence(raw: Any, path: Path, field: str) -> Evidence:
    entry = _mapping(raw, path, field, EVIDENCE_KEYS)
    name = _constant(entry, path, field).name
    texts = {k: _text(entry, k, path, field) for k in ("quantity", "source", "mapping")}
    return Evidence(name, texts["quantity"], _number(entry, "value", path, field),
                    texts["source"], texts["mapping"])  # fmt: skip


def _range(raw: Any, path: Path, field: str, presets: tuple[str, ...]) -> Range:
    entry = _mapping(raw, path, field, RANGE_KEYS)
    bounds = _constant(entry, path, field)
    low = _number(entry, "low", path, field)
    high = _number(entry, "high", path, field)
    if not bounds.low <= low < high <= bounds.high:
        raise _fail(path, field, f"{bounds.name} range [{low:g}, {high:g}] is not inside its "
                    f"bounds [{bounds.low:g}, {bounds.high:g}] with low < high",
                    "give low < high within planner.specs' bounds")  # fmt: skip
    texts = [_text(entry, k, path, field) for k in RANGE_TEXT_KEYS]
    applies = _names(entry["presets"], path, f"{field}.presets") if "presets" in entry else presets
    stray = [p for p in applies if p not in presets]
    if stray:
        raise _fail(path, f"{field}.presets", f"{stray[0]} is not in the file's presets",
                    "list only presets the file covers")  # fmt: skip
    flags = _names(entry["flags"], path, f"{field}.flags") if "flags" in entry else ()
    if any(f not in FLAGS for f in flags):
        raise _fail(path, f"{field}.flags", f"unknown flag in {list(flags)}",
                    f"use {', '.join(FLAGS)}")  # fmt: skip
    return Range(bounds.name, low, high, *texts, presets=applies, flags=flags)


def _check_cover(path: Path, evidence: tuple[Evidence, ...], ranges: tuple[Range, ...]) -> None:
    """Each range rests on evidence unless flagged, and no preset has two for one constant."""
    measured = {e.constant for e in evidence}
    seen: set[tuple[str, str]] = set()
    for i, r in enumerate(ranges):
        if r.constant not in measured and "no_public_evidence" not in r.flags:
            fix = "add one with its source, or flag the range no_public_evidence"
            raise _fail(path, f"ranges[{i}]", f"no evidence entry for {r.constant}", fix)
        for preset in r.presets:
            if (preset, r.constant) in seen:
                raise _fail(path, f"ranges[{i}]", f"{preset} has two ranges for {r.constant}",
                            "give each preset one range per constant")  # fmt: skip
            seen.add((preset, r.constant))


def load_evidence(name_or_path: str | Path) -> EvidenceFile:
    """Read and validate one evidence file: a stem under profiles/evidence/ or a path.

    Raises SpecError (one line: the file, the field, the fix) for a file that breaks a rule
    of the module docstring.
    """
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = EVIDENCE_DIR / f"{name_or_path}.yaml"
    try:
        data = load_yaml(read_text_file(path, "evidence file"))
    except yaml.YAMLError as exc:
        raise SpecError(f"evidence file {path}: invalid YAML{yaml_fault(exc)}; fix it") from None
    top = _mapping(data, path, "top level", FILE_KEYS)
    family = _text(top, "family", path, "top level")
    presets = _names(top.get("presets"), path, "presets")
    for key in ("evidence", "ranges"):
        if not isinstance(top.get(key), list) or not top[key]:
            raise _fail(path, key, "missing or empty", "give a non-empty list")
    evidence = tuple(_evidence(e, path, f"evidence[{i}]") for i, e in enumerate(top["evidence"]))
    ranges = tuple(_range(r, path, f"ranges[{i}]", presets) for i, r in enumerate(top["ranges"]))
    _check_cover(path, evidence, ranges)
    return EvidenceFile(path, family, presets, evidence, ranges)


def evidence_for(preset: str) -> EvidenceFile | None:
    """The evidence file covering cluster preset `preset` (None for an emulation).

    Raises SpecError for a preset the mapping does not name.
    """
    if preset not in EVIDENCE_OF_PRESET:
        raise SpecError(f"cluster preset {preset}: no evidence file is mapped to it; add it to "
                        "planner.calibrate.evidence.EVIDENCE_OF_PRESET")  # fmt: skip
    stem = EVIDENCE_OF_PRESET[preset]
    return None if stem is None else load_evidence(stem)


def _status(value: float, low: float, high: float) -> Status:
    if math.isclose(value, low, rel_tol=1e-9) or math.isclose(value, high, rel_tol=1e-9):
        return "at end"
    return "inside" if low < value < high else "outside"


def constant_checks(preset: str) -> tuple[ConstantCheck, ...]:
    """Every constant of `preset` that its evidence file gives a range, in EFFICIENCIES order
    (then TOPOLOGY_EFFICIENCIES), with the preset's value and inside / outside / at end."""
    found = evidence_for(preset)
    if found is None:
        return ()
    cluster = load_cluster(preset)
    checks = []
    for name in _bounds():
        r = found.range_for(preset, name)
        if r is not None:
            value = float(getattr(cluster, name))
            status = _status(value, r.low, r.high)
            checks.append(ConstantCheck(preset, name, value, r.low, r.high, status, r.summary,
                                        r.flags))  # fmt: skip
    return tuple(checks)


def constants_outside(preset: str) -> tuple[ConstantCheck, ...]:
    """The constants of `preset` outside their evidence range or at one of its ends."""
    return tuple(c for c in constant_checks(preset) if c.status != "inside")
