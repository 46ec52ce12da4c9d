"""A trace file cannot exhaust memory or hang the reader (planner/HARDENING.md, "Hostile
files"): a .csv.gz is streamed, counted before it is parsed, and refused in one line past
MAX_ROWS lines, MAX_TEXT_BYTES of text or a MAX_LINE_BYTES line."""

from __future__ import annotations

import gzip
import subprocess
import sys
import textwrap

import pytest

from planner.migration import trace as trace_module
from planner.migration.trace import MAX_ROWS, MAX_TEXT_BYTES, load_trace, trace_to_csv
from planner.specs import SpecError
from tests.hardening_cli import REPO

CHUNK = 8 * 2**20  # bytes of text per gzip member


def _gzip_bomb(path, line: bytes, total_bytes: int) -> None:
    """header + `line` repeated to `total_bytes` of text, as gzip members of CHUNK bytes each
    (each compresses to a few KB: a 1 GiB bomb is about 1 MB on disk)."""
    member = gzip.compress(line * (CHUNK // len(line)), compresslevel=9)
    with path.open("wb") as fh:
        fh.write(gzip.compress(b"interval,layer,expert,tokens\n"))
        for _ in range(total_bytes // CHUNK):
            fh.write(member)


def test_a_gzip_bomb_of_a_gib_of_rows_is_refused_within_a_gib_of_memory(tmp_path):
    """1 GiB of '0,0,0,0' rows in a 1 MB .csv.gz: refused in one line, in a child whose
    address space is capped at 1.5 GiB (the whole file held as text and rows would not fit)."""
    bomb = tmp_path / "bomb.csv.gz"
    _gzip_bomb(bomb, b"0,0,0,0\n", 2**30)
    assert bomb.stat().st_size < 2 * 2**20
    script = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**29, 3 * 2**29))
        from planner.migration.trace import load_trace
        from planner.specs import SpecError
        try:
            load_trace({str(bomb)!r})
        except SpecError as exc:
            print(exc)
    """)
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(str(bomb)), proc.stdout[-500:]
    assert f"more than {MAX_ROWS:,} lines" in lines[0]


def test_a_line_without_end_is_refused_at_the_line_bound(tmp_path):
    bomb = tmp_path / "long.csv.gz"
    _gzip_bomb(bomb, b"0" * 4096, 64 * 2**20)
    with pytest.raises(SpecError, match=r"line 2 is longer than 64 KiB"):
        load_trace(bomb)


def test_the_bounds_are_the_documented_ones_and_a_trace_at_the_row_bound_reads(
    tmp_path, monkeypatch
):
    assert (MAX_ROWS, MAX_TEXT_BYTES) == (10**7, 2**30)
    rows = [(t, 0, e, t + e) for t in range(10) for e in range(8)]  # 80 rows + header
    text = "interval,layer,expert,tokens\n" + "".join(
        f"{t},{layer},{e},{n}\n" for t, layer, e, n in rows
    )
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(text.encode()))
    monkeypatch.setattr(trace_module, "MAX_ROWS", 81)
    trace = load_trace(path)
    assert trace.tokens_ILE.shape == (10, 1, 8) and int(trace.tokens_ILE.sum()) == 10 * 28 + 8 * 45
    assert trace_to_csv(trace) == text
    monkeypatch.setattr(trace_module, "MAX_ROWS", 80)
    with pytest.raises(SpecError, match="more than 80 lines"):
        load_trace(path)
    monkeypatch.setattr(trace_module, "MAX_ROWS", 10**7)
    monkeypatch.setattr(trace_module, "MAX_TEXT_BYTES", len(text) - 1)
    with pytest.raises(SpecError, match="MiB of text"):
        load_trace(path)


def test_a_fifo_named_as_trace_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "trace.csv"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="a FIFO"):
        load_trace(fifo)


def test_a_cut_gzip_trace_is_one_line(tmp_path):
    text = trace_to_csv(load_trace(REPO / "profiles/traces/example.csv"))
    packed = gzip.compress(text.encode())
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(SpecError, match="not a gzip file") as err:
        load_trace(cut)
    assert "\n" not in str(err.value)
