"""Simulated Frontier sweep: flat all-to-all vs HALO vs HALO-dedup, 2..512 nodes, KiB..MiB.

Runs the flow-level simulator (planner/sim/halo.py) on the frontier preset and prints, side by
side in one run:
  1. flat / HALO and flat / HALO-dedup time ratios at 8, 16, 64, 512 nodes per message size,
     beside the paper's reported range (about equal at <= 8 nodes; 1.2-9x at 16-512);
  2. why: messages per rank, bytes through the NICs, NIC balance, the busiest link and how
     long the dragonfly global links are busy, at the headline points;
  3. the sensitivity of the ratios to the per-message overhead (0.5, 1, 2 us);
  4. agreement of the planner's analytic model (planner/resources/comm.py) with the simulator,
     flat, HALO and HALO-dedup.
Writes results/a2a/{frontier_sweep.csv, frontier_time_vs_nodes.png, frontier_ratio.png,
summary.md} (deterministic apart from the PNG renderer).

  python3 benchmarks/a2a_sweep.py [--out results/a2a] [--cluster frontier] [--topk 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.inputs.clusters import load_cluster  # noqa: E402
from planner.outputs.files import write_files  # noqa: E402
from planner.resources.comm import all_to_all_time_s, dedup_ratio  # noqa: E402
from planner.sim.halo import SimResult, simulate_all_to_all  # noqa: E402

NODES = (2, 4, 8, 16, 32, 64, 128, 256, 512)
SIZES = (4 * 2**10, 64 * 2**10, 2**20, 16 * 2**20)  # bytes per rank
HEADLINE_NODES = (8, 16, 64, 512)
ALGOS = ("flat", "halo", "halo-dedup")
PAPER = {8: "~1 (about equal)", 16: "1.2-9x", 64: "1.2-9x", 512: "1.2-9x"}


def size_label(b: float) -> str:
    return f"{b / 2**20:g} MiB" if b >= 2**20 else f"{b / 2**10:g} KiB"


def run_sweep(cluster, topk: int, overhead_us: float) -> dict[tuple[int, float, str], SimResult]:
    out = {}
    for n in NODES:
        for b in SIZES:
            for a in ALGOS:
                out[n, b, a] = simulate_all_to_all(cluster, n, b, a, topk, overhead_us=overhead_us)
    return out


def global_busy_s(r: SimResult) -> float:
    """Busy time of the outermost scale-out up-links (dragonfly global links on Frontier)."""
    ups = [ld for ld in r.links if ld.link.startswith("up:")]
    return ups[-1].busy_s if ups else 0.0


def csv_text(res, cluster) -> str:
    head = (
        "nodes,bytes_per_rank,algo,time_s,messages_per_rank,nic_bytes,nic_balance,"
        "bottleneck,global_busy_s,dedup_ratio,analytic_s"
    )
    lines = [head]
    for (n, b, a), r in sorted(res.items()):
        nic = sum(lv.bytes for lv in r.levels if lv.level == "nic")
        an = analytic_s(cluster, n, b, a, r)
        lines.append(
            f"{n},{b:.0f},{a},{r.time_s:.6g},{r.messages_per_rank:.0f},{nic:.6g},"
            f"{r.nic_balance:.3g},{r.bottleneck},{global_busy_s(r):.6g},{r.dedup_ratio:.4g},"
            + f"{an:.6g}"
        )
    return "\n".join(lines) + "\n"


def analytic_s(cluster, nodes: int, nbytes: float, algo: str, sim: SimResult) -> float:
    """The analytic model's time; HALO-dedup at the ratio of the simulated routing (its
    experts and top-k; comm.dedup_ratio)."""
    n = nodes * cluster.gpus_per_node
    ratio = dedup_ratio(cluster, n, sim.experts, sim.topk) if algo == "halo-dedup" else 1.0
    return all_to_all_time_s(cluster, n, nbytes, algo, 1, ratio)


def ratio_table(res) -> list[str]:
    lines = ["| nodes | " + " | ".join(size_label(b) for b in SIZES) + " | paper |",
             "|---:|" + "---:|" * len(SIZES) + "---|"]  # fmt: skip
    for n in HEADLINE_NODES:
        cells = []
        for b in SIZES:
            f, h, d = (res[n, b, a].time_s for a in ALGOS)
            cells.append(f"{f / h:.2f} / {f / d:.2f}")
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {PAPER[n]} |")
    return lines


def why_table(res) -> list[str]:
    lines = ["| nodes | size | algo | time us | msgs/rank | NIC MB | NIC bal | bottleneck | "
             "global busy us |", "|---:|---|---|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    for n in HEADLINE_NODES:
        for b in (64 * 2**10, 16 * 2**20):
            for a in ALGOS:
                r = res[n, b, a]
                nic = sum(lv.bytes for lv in r.levels if lv.level == "nic") / 1e6
                lines.append(
                    f"| {n} | {size_label(b)} | {a} | {r.time_s * 1e6:.1f} | "
                    f"{r.messages_per_rank:.0f} | {nic:.1f} | {r.nic_balance:.2f} | "
                    f"{r.bottleneck} | {global_busy_s(r) * 1e6:.1f} |"
                )
    return lines


def agreement(res, cluster) -> tuple[list[str], dict[str, float]]:
    lines = ["| algo | size | " + " | ".join(str(n) for n in NODES) + " |",
             "|---|---|" + "---:|" * len(NODES)]  # fmt: skip
    within, total, worst = 0, 0, 0.0
    for a in ALGOS:
        for b in SIZES:
            cells = []
            for n in NODES:
                ratio = analytic_s(cluster, n, b, a, res[n, b, a]) / res[n, b, a].time_s
                within += abs(ratio - 1) <= 0.25
                worst = max(worst, abs(ratio - 1))
                total += 1
                cells.append(f"{ratio:.2f}")
            lines.append(f"| {a} | {size_label(b)} | " + " | ".join(cells) + " |")
    return lines, {"within_25pct": within, "points": total, "worst": worst}


def plots(res, cluster_name: str) -> dict[str, bytes]:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from planner.numbers import number

    readable = FuncFormatter(lambda value, _pos: number(value, 3))

    def node_axis(ax) -> None:
        """Log-2 node counts written as plain numbers (2, 8, 32, ...), not 2^n."""
        ax.set_xscale("log", base=2)
        ax.set_xticks(NODES[::2], [str(n) for n in NODES[::2]])
        ax.xaxis.set_minor_formatter(NullFormatter())

    def plain_log_y(ax) -> None:
        """Log scale with ticks at 1, 2 and 5 per decade, written as plain numbers."""
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(readable)
        ax.yaxis.set_minor_formatter(NullFormatter())

    out = {}
    fig, axes = plt.subplots(1, len(SIZES), figsize=(4 * len(SIZES), 3.6), sharey=False)
    for ax, b in zip(axes, SIZES, strict=True):
        for a, style in zip(ALGOS, ("o-", "s-", "^--"), strict=True):
            ax.plot(NODES, [res[n, b, a].time_s * 1e6 for n in NODES], style, label=a, ms=4)
        node_axis(ax)
        plain_log_y(ax)
        ax.set_title(f"{size_label(b)} per rank")
        ax.set_xlabel("nodes (8 GCDs each)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("all-to-all time (us)")
    axes[0].legend()
    fig.suptitle(f"{cluster_name}: simulated all-to-all time vs nodes")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, metadata={"Software": None})
    out["frontier_time_vs_nodes.png"] = buf.getvalue()
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    # 4 KiB and 64 KiB coincide: distinct line styles and markers keep both visible
    for b, style in zip(SIZES, ("o-", "s--", "^-.", "D:"), strict=True):
        ax.plot(NODES, [res[n, b, "flat"].time_s / res[n, b, "halo"].time_s for n in NODES],
                style, label=size_label(b), ms=4, alpha=0.85)  # fmt: skip
    ax.axhspan(1.2, 9, color="green", alpha=0.08, label="paper 1.2-9x (16-512 nodes)")
    ax.axhline(1.0, color="gray", lw=0.8)
    node_axis(ax)
    plain_log_y(ax)
    ax.set_xlabel("nodes")
    ax.set_ylabel("flat time / HALO time")
    ax.set_title(f"{cluster_name}: simulated flat / HALO")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, metadata={"Software": None})
    out["frontier_ratio.png"] = buf.getvalue()
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="frontier")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "results" / "a2a"))
    ap.add_argument("--no-files", action="store_true", help="print only")
    args = ap.parse_args(argv)
    cluster = load_cluster(args.cluster)
    res = run_sweep(cluster, args.topk, 1.0)
    lines = [f"# {cluster.name}: simulated all-to-all sweep (top-{args.topk}, 1 us/message)", ""]
    lines += ["## flat / HALO and flat / HALO-dedup time ratios", ""] + ratio_table(res)
    lines += ["", "## Why (messages, NIC bytes and balance, busiest link, global links)", ""]
    lines += why_table(res)
    lines += ["", "## Sensitivity of flat / HALO to the per-message overhead", ""]
    lines += ["| overhead us | " + " | ".join(f"{n} nodes" for n in HEADLINE_NODES) + " |",
              "|---:|" + "---:|" * len(HEADLINE_NODES)]  # fmt: skip
    for o in (0.5, 1.0, 2.0):
        cells = []
        for n in HEADLINE_NODES:
            b = 2**20
            f = simulate_all_to_all(cluster, n, b, "flat", args.topk, overhead_us=o).time_s
            h = simulate_all_to_all(cluster, n, b, "halo", args.topk, overhead_us=o).time_s
            cells.append(f"{f / h:.2f}")
        lines.append(f"| {o} | " + " | ".join(cells) + " |  (1 MiB per rank)")
    agree, stats = agreement(res, cluster)
    lines += ["", "## Analytic model (planner/resources/comm.py) / simulator", ""] + agree
    lines += ["", f"{stats['within_25pct']} of {stats['points']} points within 25% "
              f"(largest deviation {stats['worst']:.1e})."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_files:
        files: dict[str, str | bytes] = {"frontier_sweep.csv": csv_text(res, cluster)}
        files.update({"summary.md": text, **plots(res, cluster.name)})
        for path in write_files(args.out, files):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
