"""Expert-load traces: the `interval,layer,expert,tokens` CSV, validated on load.

A trace row says how many tokens were routed to `expert` of MoE layer `layer` during
`interval` (summed over the expert-parallel group). Intervals are 0..I-1 without gaps;
every (interval, layer) lists every expert 0..E-1 exactly once.

Shape letters: I = intervals, L = MoE layers of the trace (in ascending layer id), E = experts.
"""

from __future__ import annotations

import csv
import gzip
import io
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from planner.inputs.safe_read import open_input
from planner.inputs.shown import shown
from planner.specs import SpecError

COLUMNS = ("interval", "layer", "expert", "tokens")
MAX_VALUE = 2**62  # ids and token counts (int64 with headroom for sums)
# Bounds on what a trace file may make Piper read (a .csv.gz of 1.5 MB can hold 1 GiB). The
# recorded traces under profiles/traces hold a row per step, MoE layer and expert: 128 rows a
# step for 2 layers x 64 experts, so MAX_ROWS reads 78,000 such steps (40,000 steps of 250
# layer x expert cells); the caps are checked before any row is parsed.
MAX_ROWS = 10**7  # lines, header and blank lines included (320 MB as int64 rows)
MAX_TEXT_BYTES = 2**30  # of text, after decompression
MAX_LINE_BYTES = 2**16  # one line (a row is four integers: under 80 bytes)


@dataclass(frozen=True, eq=False)
class Trace:
    """Tokens per interval, MoE layer and expert.

    tokens_ILE: int64 array (I, L, E), tokens routed to each expert in each interval.
    layer_ids: transformer layer index of each of the L trace layers (ascending).
    source: the file it came from ("" when built in memory).
    """

    tokens_ILE: np.ndarray
    layer_ids: tuple[int, ...]
    source: str = ""

    @property
    def num_intervals(self) -> int:
        return int(self.tokens_ILE.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.tokens_ILE.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.tokens_ILE.shape[2])


def _parse_int(text: str, path: str, row: int, column: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise SpecError(
            f"{path}: row {row}: column '{column}' must be a non-negative integer, got "
            f"{shown(text)}; fix or drop that row"
        ) from None
    if value < 0:
        raise SpecError(
            f"{path}: row {row}: column '{column}' is negative ({value}); token counts and "
            f"ids must be >= 0"
        )
    if value > MAX_VALUE:
        raise SpecError(
            f"{path}: row {row}: column '{column}' is {str(value)[:24]}..., above {MAX_VALUE} "
            "(more than any trace holds); fix that row"
        )
    return value


def _read_rows(lines: Iterable[str], path: str) -> np.ndarray:
    try:
        return _csv_rows(csv.reader(lines), path)
    except csv.Error as exc:  # a field over the csv module's size limit, a stray quote
        header = ",".join(COLUMNS)
        raise SpecError(f"{path}: not a trace CSV ({exc}); a trace is {header}") from None


def _csv_rows(reader: Any, path: str) -> np.ndarray:
    """The (interval, layer, expert, tokens) rows as an int64 array (rows, 4)."""
    header = next(reader, None)
    if header is None:
        raise SpecError(f"{path}: empty file; a trace needs the header {','.join(COLUMNS)}")
    names = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise SpecError(
            f"{path}: missing column(s) {', '.join(missing)}; the header must name "
            f"{','.join(COLUMNS)}"
        )
    index = i0, i1, i2, i3 = [names.index(c) for c in COLUMNS]
    values = array("q")
    for line_no, fields in enumerate(reader, start=2):
        if not fields or all(not f.strip() for f in fields):
            continue
        if len(fields) < len(names):
            raise SpecError(
                f"{path}: row {line_no}: {len(fields)} fields, the header has {len(names)}; "
                f"fill in every column"
            )
        try:
            row = (int(fields[i0]), int(fields[i1]), int(fields[i2]), int(fields[i3]))
        except ValueError:
            row = (-1,)
        if not (min(row) >= 0 and max(row) <= MAX_VALUE):  # _parse_int says which and why
            for i, c in zip(index, COLUMNS, strict=True):
                _parse_int(fields[i], path, line_no, c)
        values.extend(row)
    if not values:
        raise SpecError(f"{path}: no data rows; a trace needs at least one interval")
    return np.frombuffer(values, dtype=np.int64).reshape(-1, len(COLUMNS))


def _bounded_lines(fh: BinaryIO, path: str) -> Iterator[str]:
    """The file's lines as text, refusing it past MAX_ROWS lines, MAX_TEXT_BYTES bytes or a
    line of MAX_LINE_BYTES, before reading further (a compressed file is never expanded
    whole)."""
    total = 0
    for line_no in range(1, MAX_ROWS + 2):
        line = fh.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        total += len(line)
        if line_no > MAX_ROWS or total > MAX_TEXT_BYTES:  # grew since _check_size
            raise _too_much(path)
        if len(line) > MAX_LINE_BYTES:
            raise SpecError(
                f"{path}: line {line_no} is longer than {MAX_LINE_BYTES // 1024} KiB; a trace "
                f"row is four integers ({','.join(COLUMNS)})"
            )
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(
                f"{path}: not a text CSV (line {line_no}); a trace is "
                "'interval,layer,expert,tokens'"
            ) from None


def trace_from_rows(rows: Any, path: str) -> Trace:
    """Build a Trace from (interval, layer, expert, tokens) rows (a list of tuples or an int64
    array (rows, 4)), checking completeness."""
    arr = np.asarray(rows, dtype=np.int64)
    intervals = np.unique(arr[:, 0])
    layer_ids = np.unique(arr[:, 1])
    experts = np.unique(arr[:, 2])
    if len(intervals) != int(intervals[-1]) + 1:  # the first gap, without building the range
        gap = next(i for i, v in enumerate(intervals.tolist()) if v != i)
        raise SpecError(
            f"{path}: interval {gap} is missing (intervals must run 0..{int(intervals[-1])} "
            f"without gaps); add its rows or renumber the intervals"
        )
    num_e = int(experts[-1]) + 1
    if len(experts) != num_e:
        gap = next(i for i, v in enumerate(experts.tolist()) if v != i)
        raise SpecError(
            f"{path}: expert {gap} never appears (experts must be 0..{num_e - 1}); "
            f"add rows with tokens 0 for it"
        )
    cells = len(intervals) * len(layer_ids) * num_e
    if cells > 16 * len(rows) + (1 << 20):  # rows are missing: do not allocate every cell
        raise SpecError(
            f"{path}: {len(rows)} rows for {len(intervals)} intervals x {len(layer_ids)} layers "
            f"x {num_e} experts = {cells}; every interval must list every expert of every layer"
        )
    tokens = np.full((len(intervals), len(layer_ids), num_e), -1, dtype=np.int64)
    li = np.searchsorted(layer_ids, arr[:, 1])
    seen = np.zeros(tokens.shape, dtype=np.int64)
    np.add.at(seen, (arr[:, 0], li, arr[:, 2]), 1)
    if seen.max() > 1:
        t, lj, e = (int(x[0]) for x in np.nonzero(seen > 1))
        raise SpecError(
            f"{path}: interval {t}, layer {int(layer_ids[lj])}, expert {e} appears more than "
            f"once (duplicate rows); keep one row per (interval, layer, expert)"
        )
    if seen.min() == 0:
        t, lj, e = (int(x[0]) for x in np.nonzero(seen == 0))
        raise SpecError(
            f"{path}: no row for interval {t}, layer {int(layer_ids[lj])}, expert {e}; every "
            f"interval must list every expert of every layer (use tokens 0)"
        )
    tokens[arr[:, 0], li, arr[:, 2]] = arr[:, 3]
    return Trace(tokens, tuple(int(x) for x in layer_ids), path)


def _too_much(path: str) -> SpecError:
    return SpecError(
        f"{path}: more than {MAX_ROWS:,} lines or {MAX_TEXT_BYTES // 2**20:,} MiB of text "
        "(decompressed), the most a trace may hold; sum its steps into intervals or split it"
    )


def _check_size(fh: BinaryIO, path: str) -> None:
    """Count the lines and bytes of the (decompressed) stream in 1 MiB chunks, at C speed, and
    refuse it past the bounds before any row is parsed."""
    lines = total = 0
    while chunk := fh.read(2**20):
        lines += chunk.count(b"\n")
        total += len(chunk)
        if lines > MAX_ROWS or total > MAX_TEXT_BYTES:
            raise _too_much(path)


def _stream(raw: BinaryIO, gz: bool) -> BinaryIO:
    return gzip.GzipFile(fileobj=raw) if gz else raw


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace CSV (gzip-compressed when the name ends in .gz), streamed
    within MAX_ROWS lines and MAX_TEXT_BYTES of text: a first pass counts them, the second
    parses; every fault is a SpecError naming the file and row."""
    p, where = Path(path), str(path)
    if not p.exists():
        raise SpecError(f"{p}: no such trace file; make one with 'piper trace synth --out {p}'")
    gz = p.suffix == ".gz"
    with open_input(p, "trace", max_bytes=None) as raw:
        try:
            _check_size(_stream(raw, gz), where)
            raw.seek(0)
            rows = _read_rows(_bounded_lines(_stream(raw, gz), where), where)
        except (gzip.BadGzipFile, EOFError, zlib.error):
            raise SpecError(
                f"{p}: not a gzip file (or a cut or corrupt one); name a plain trace CSV "
                "without .gz"
            ) from None
        except OSError as exc:
            raise SpecError(f"{p}: cannot read the trace ({exc.strerror or exc})") from None
    return trace_from_rows(rows, where)


def trace_from_text(text: str, source: str = "trace.csv") -> Trace:
    """Parse and validate trace CSV text; every fault is a SpecError naming `source` and row."""
    return trace_from_rows(_read_rows(io.StringIO(text), source), source)


def interval_trace(trace: Trace, rows_per_interval: int, flag: str = "--rows-per-interval"):
    """The trace whose rows are the sums of `rows_per_interval` consecutive rows of `trace`
    (its rows steps, an interval that many steps); a count that is not positive or does not
    divide the rows into whole intervals is a SpecError naming `flag`."""
    k, rows = rows_per_interval, trace.num_intervals
    if k < 1:
        raise SpecError(f"{flag} must be a positive number of rows, got {k}")
    if rows % k:
        raise SpecError(
            f"{trace.source or 'trace'}: {rows} rows make no whole number of {k}-row "
            f"intervals; pass a {flag} that divides {rows}"
        )
    tokens = trace.tokens_ILE.reshape(rows // k, k, *trace.tokens_ILE.shape[1:]).sum(axis=1)
    return Trace(tokens, trace.layer_ids, trace.source)


def check_divisible(trace: Trace, ranks: int) -> None:
    """Experts must split evenly over the expert-parallel ranks."""
    if ranks <= 0:
        raise SpecError(f"--ep must be a positive number of ranks, got {ranks}")
    if trace.num_experts % ranks:
        divisors = [r for r in range(1, trace.num_experts + 1) if trace.num_experts % r == 0]
        raise SpecError(
            f"{trace.source or 'trace'}: {trace.num_experts} experts do not divide over --ep "
            f"{ranks} ranks; use an --ep that divides them ({', '.join(map(str, divisors))})"
        )


def trace_rows(trace: Trace) -> list[tuple[int, int, int, int]]:
    """(interval, layer id, expert, tokens) for every entry, sorted by the first three."""
    num_i, num_l, num_e = trace.tokens_ILE.shape
    return [
        (t, trace.layer_ids[lj], e, int(trace.tokens_ILE[t, lj, e]))
        for t in range(num_i)
        for lj in range(num_l)
        for e in range(num_e)
    ]


def trace_to_csv(trace: Trace) -> str:
    """Render a trace as CSV text, rows sorted by (interval, layer, expert)."""
    lines = [",".join(COLUMNS)] + [f"{t},{layer},{e},{n}" for t, layer, e, n in trace_rows(trace)]
    return "\n".join(lines) + "\n"
