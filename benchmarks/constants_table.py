"""Constants: evidence, range, value — each cluster preset's named efficiencies against the
physical range of its evidence file (profiles/evidence/*.yaml, planner.calibrate.evidence).

Prints one markdown table (preset, constant, the evidence in short, the range, the preset's
current value, inside / outside / at end) and a count per preset, and writes them to
results/constants_table.md. A range marked "first principles" has no public measurement
behind it (flag no_public_evidence); its reasons are in the evidence file.

    python3 benchmarks/constants_table.py [--no-results]
"""

from __future__ import annotations

import argparse
from collections import Counter

from results_md import ROOT, recorded

from planner.calibrate.evidence import EVIDENCE_OF_PRESET, ConstantCheck, constant_checks
from planner.inputs.clusters import list_cluster_presets
from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES

ORDER = [e.name for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES)]


def _number(x: float) -> str:
    return f"{x:g}"


def _rows(checks: list[ConstantCheck], stem: str) -> list[str]:
    """Table rows, presets of one file with the same range and value sharing a row."""
    shared: dict[tuple, list[str]] = {}
    for c in checks:
        key = (c.constant, c.low, c.high, c.value, c.status, c.summary, c.flags)
        shared.setdefault(key, []).append(c.preset)
    rows = []
    for (constant, low, high, value, status, summary, flags), presets in shared.items():
        basis = "first principles: " if "no_public_evidence" in flags else ""
        evidence = f"{basis}{summary} ({stem}.yaml)"
        span = f"[{_number(low)}, {_number(high)}]"
        names = ", ".join(presets)
        rows.append(
            f"| {names} | `{constant}` | {evidence} | {span} | {_number(value)} | {status} |"
        )
    return rows


def report() -> None:
    """Print the table of every preset with an evidence file, then the counts per preset."""
    print("| preset | constant | evidence | range | value | status |")
    print("|---|---|---|---|---|---|")
    counts: dict[str, Counter[str]] = {}
    for stem in sorted({s for s in EVIDENCE_OF_PRESET.values() if s is not None}):
        presets = [p for p in list_cluster_presets() if EVIDENCE_OF_PRESET.get(p) == stem]
        checks = [c for p in presets for c in constant_checks(p)]
        checks.sort(key=lambda c: ORDER.index(c.constant))  # stable: presets keep their order
        for p in presets:
            counts[p] = Counter(c.status for c in checks if c.preset == p)
        for row in _rows(checks, stem):
            print(row)
    print()
    print("| preset | inside | outside | at end |")
    print("|---|---|---|---|")
    for preset, n in sorted(counts.items()):
        print(f"| {preset} | {n['inside']} | {n['outside']} | {n['at end']} |")
    left = [p for p in list_cluster_presets() if EVIDENCE_OF_PRESET.get(p) is None]
    print(f"\nNo evidence file (emulation): {', '.join(left)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    title = "Constants: evidence, range, value"
    with recorded(ROOT / "results" / "constants_table.md", title, not args.no_results):
        report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
