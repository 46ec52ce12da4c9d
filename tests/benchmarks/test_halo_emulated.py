"""benchmarks/halo_emulated.py: ratio bookkeeping (anywhere) and a quick real run (root)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import halo_emulated as he  # noqa: E402


def _m(algo: str, median_s: float, topk: int = 8, tokens: int = 64, inter: int = 100):
    return he.Measurement(4, 2, 1000, "uniform", topk, tokens, 256, algo, median_s, [], inter, 0)


def test_ratios_and_headline_pick_the_largest_top8_case():
    results = [
        _m("flat", 2.0, tokens=64), _m("halo", 1.0, tokens=64), _m("halo-dedup", 0.5, tokens=64),
        _m("flat", 9.0, tokens=512), _m("halo", 10.0, tokens=512),
        _m("halo-dedup", 3.0, tokens=512, inter=40),
        _m("flat", 1.0, topk=2, tokens=4096), _m("halo", 1.0, topk=2, tokens=4096),
        _m("halo-dedup", 1.0, topk=2, tokens=4096),
    ]  # fmt: skip
    rows = he.ratios(results)
    assert len(rows) == 3
    small = next(r for r in rows if r["tokens_per_rank"] == 64)
    assert small["flat_over_halo"] == 2.0 and small["flat_over_halo_dedup"] == 4.0
    top = he.headline(rows)
    assert top["tokens_per_rank"] == 512 and top["topk"] == 8
    assert top["flat_over_halo"] == pytest.approx(0.9)
    assert top["inter_node_bytes_halo_dedup"] == 40


def test_sweep_contains_the_headline_network():
    nets = he.sweep(quick=False)
    head = [n for n in nets if (n.nodes, n.ranks_per_node, n.rate_mbit) == (4, 2, 1000)]
    assert any(8 in n.topks and n.routing == "uniform" for n in head)
    assert {2, 6, 8} <= {k for n in head for k in n.topks}


@pytest.mark.root
@pytest.mark.slow
def test_quick_run_on_emulated_nodes():
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "halo_emulated.py"), "--quick", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-2000:]
    out = json.loads(stdout)
    by_algo: dict = {}
    for m in out["measurements"]:
        assert m["median_s"] > 0 and len(m["times_s"]) >= 3
        by_algo.setdefault((m["topk"], m["tokens_per_rank"]), {})[m["algo"]] = m
    for (_topk, tokens), algos in by_algo.items():
        assert set(algos) == {*he.ALGOS, he.FORCED}
        flat, dedup = algos["flat"]["bytes_inter_node"], algos["halo-dedup"]["bytes_inter_node"]
        assert flat > 0
        assert algos[he.FORCED]["path"] == "3-phase"  # held to the three phases at any size
        # two nodes without dedup: the relay cannot pay, so HALO goes direct at every size
        assert algos["halo"]["path"] == "direct"
        assert algos["halo"]["halo_message_us"] > 0 and algos["halo"]["halo_intra_gbps"] > 0
        # 2 nodes x 2 ranks, top-8, 1 KiB rows: a rank's message for the other node is
        # tokens * 4 KiB, so 64 tokens stay below the 1 MiB direct threshold.
        path = algos["halo-dedup"]["path"]
        if tokens * 4 * 1024 < (1 << 20):
            assert path == "direct"
        if path == "3-phase":  # top-8: most tokens hit the other node several times
            assert dedup < 0.6 * flat
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"piper-h{proc.pid}" not in listed  # everything this run created is gone
