"""Flat all-to-all vs HALO vs HALO-dedup on an emulated multi-node network (needs root).

Nodes are network namespaces joined by rate-limited veth links to one bridge (see
benchmarks/netns.py); each node runs G gloo ranks that talk to each other over loopback.
The workload is a real MoE dispatch + combine: each rank routes T random tokens (hidden size
D, float32) to the top-k of E experts; experts sit contiguously on ranks (expert e on rank
e // (E / world)), so a node holds a contiguous block of experts. Every measurement is the
median over repetitions of the slowest rank's time for one dispatch + combine (forward).

  sudo python3 benchmarks/halo_emulated.py            # full sweep (about 10 minutes)
  sudo python3 benchmarks/halo_emulated.py --quick    # 2 nodes x 2 ranks, seconds
  sudo python3 benchmarks/halo_emulated.py --json     # one JSON object with everything
  sudo python3 benchmarks/halo_emulated.py --cleanup  # remove leftover namespaces
  python3 benchmarks/halo_emulated.py --from-json results/a2a/emulated_run.json  # no root

The full sweep also writes its table and headline to results/halo_emulated.md (--results
FILE elsewhere, --no-results not; --quick writes nothing); --from-json renders that file
from a saved --json output without measuring.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import netns  # noqa: E402
from results_md import command_line, render  # noqa: E402

from planner.outputs.files import write_atomic  # noqa: E402
from runtime.dispatch.halo_cost import DEFAULT_DIRECT_BELOW_BYTES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ("flat", "halo", "halo-dedup")
# HALO held to its three phases at every size: what the path choice avoids (for reference)
FORCED = "halo-3phase"
PORT = 29611
KEY_FIELDS = ("nodes", "ranks_per_node", "rate_mbit", "routing", "topk", "tokens_per_rank")
HEADLINE = {"nodes": 4, "ranks_per_node": 2, "rate_mbit": 1000, "topk": 8}


@dataclass(frozen=True)
class Network:
    """One emulated cluster and the workloads run on it."""

    nodes: int
    ranks_per_node: int
    rate_mbit: int
    topks: tuple[int, ...]
    tokens: tuple[int, ...]  # tokens per rank, small to bandwidth-bound
    dim: int = 256
    experts_per_rank: int = 8
    reps: int = 7
    routing: str = "uniform"  # uniform | node-limited (each token's experts on <= 2 nodes)
    direct_below_bytes: int = DEFAULT_DIRECT_BELOW_BYTES
    # HaloCost (message s, intra GB/s, node link GB/s) to use instead of probing: the host
    # profile runs the links unthrottled but keeps the throttled network's path choices
    cost: tuple[float, ...] = ()


@dataclass
class Measurement:
    """One (network, routing, k, tokens, algorithm) point."""

    nodes: int
    ranks_per_node: int
    rate_mbit: int
    routing: str
    topk: int
    tokens_per_rank: int
    dim: int
    algo: str
    median_s: float
    times_s: list[float] = field(default_factory=list)
    bytes_inter_node: int = 0  # all ranks, one dispatch + combine
    bytes_intra_node: int = 0
    load_avg_1min: float = 0.0  # of the machine running all nodes: mean of start and end
    path: str = "flat"  # HALO: "3-phase", or "direct" (small messages, or nothing to gain)
    cpu_s: float = 0.0  # median over repetitions of the CPU seconds all ranks spent
    halo_message_us: float = 0.0  # the HaloCost HALO chose its path with (probed at start)
    halo_intra_gbps: float = 0.0


def sweep(quick: bool) -> list[Network]:
    """The networks and sizes to measure."""
    if quick:
        return [Network(2, 2, 1000, (8,), (64, 512), reps=3)]
    return [
        Network(4, 2, 1000, (2, 6, 8), (32, 256, 1024, 2048)),
        Network(4, 2, 1000, (8,), (256, 2048), routing="node-limited"),
        Network(4, 2, 200, (8,), (32, 512)),
        Network(2, 4, 1000, (8,), (256, 1024)),
    ]


# ---- worker: runs inside a node namespace ------------------------------------------------


def _route(net: Network, rank: int, topk: int, tokens: int):
    import torch

    world = net.nodes * net.ranks_per_node
    num_experts = net.experts_per_rank * world
    gen = torch.Generator().manual_seed(7919 * topk + 104729 * tokens + rank)
    x_TD = torch.randn(tokens, net.dim, generator=gen)
    scores_TE = torch.rand(tokens, num_experts, generator=gen)
    if net.routing == "node-limited":  # like DeepSeek-V3's node-limited routing (M = 2)
        per_node = num_experts // net.nodes
        node_scores_TN = scores_TE.reshape(tokens, net.nodes, per_node).amax(dim=2)
        keep_TN = torch.zeros_like(node_scores_TN, dtype=torch.bool)
        keep_TN.scatter_(1, node_scores_TN.topk(2, dim=1).indices, True)
        scores_TE = scores_TE.masked_fill(~keep_TN.repeat_interleave(per_node, dim=1), -1.0)
    top_scores_TK, expert_TK = scores_TE.topk(topk, dim=1)
    gate_TK = torch.softmax(top_scores_TK, dim=1)
    rank_of_expert_E = torch.arange(num_experts) // net.experts_per_rank
    return x_TD, expert_TK, gate_TK, rank_of_expert_E


def _measure(net: Network, dispatchers: dict, cost, topk: int, tokens: int) -> list[Measurement]:
    """Times every algorithm on one workload; repetitions interleave the algorithms so that
    load on the (shared) CPUs drifts over all of them alike."""
    import torch
    import torch.distributed as dist

    x_TD, expert_TK, gate_TK, rank_of_expert_E = _route(net, dist.get_rank(), topk, tokens)
    # small sizes are quick and noisy: more repetitions there
    reps = net.reps if tokens * topk * net.dim * 4 >= 8 << 20 else 3 * net.reps
    times: dict[str, list[float]] = {algo: [] for algo in dispatchers}
    cpu: dict[str, list[float]] = {algo: [] for algo in dispatchers}
    sent: dict[str, list[int]] = {}
    paths: dict[str, str] = {}
    for rep in range(reps + 1):  # the first repetition warms up
        for algo, dispatcher in dispatchers.items():
            dispatcher.stats.reset()
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            out_ND, _, handle = dispatcher.dispatch(x_TD, expert_TK, rank_of_expert_E)
            dispatcher.combine(out_ND, handle, gate_TK)
            direct = getattr(handle.exchange, "direct", None)
            paths[algo] = "flat" if direct is None else ("direct" if direct else "3-phase")
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            cpu_s = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu_s)  # process CPU time (gloo's threads included), all ranks
            if rep:
                times[algo].append(float(elapsed))
                cpu[algo].append(float(cpu_s))
            stats = dispatcher.stats
            counts = torch.tensor([stats.bytes_inter_node, stats.bytes_intra_node])
            dist.all_reduce(counts)
            sent[algo] = counts.tolist()
    return [
        Measurement(
            net.nodes,
            net.ranks_per_node,
            net.rate_mbit,
            net.routing,
            topk,
            tokens,
            net.dim,
            algo,
            statistics.median(times[algo]),
            times[algo],
            *sent[algo],
            path=paths[algo],
            cpu_s=statistics.median(cpu[algo]),
            halo_message_us=cost.message_s * 1e6,
            halo_intra_gbps=cost.intra_gbps,
        )
        for algo in dispatchers
    ]


def probe_cost(net: Network):
    """The HaloCost of this emulated network, as a runtime would take it from its cluster
    profile: the node link is the configured rate; the per-message cost (a round of tiny
    messages to every rank / its messages) and the loopback bandwidth (node peers exchanging
    4 MiB at once) are measured here, the slowest rank's median of 5, so all ranks agree."""
    import torch
    import torch.distributed as dist

    from runtime.dispatch.halo_cost import HaloCost

    if net.cost:
        return HaloCost(*net.cost)
    world, rank, rpn = dist.get_world_size(), dist.get_rank(), net.ranks_per_node
    tiny, out = torch.zeros(world), torch.zeros(world)
    big = torch.zeros(1 << 20)  # 4 MiB of float32
    peer = rank + 1 if rank % rpn + 1 < rpn else rank - rank % rpn  # next rank on my node
    src = rank - 1 if rank % rpn else rank + rpn - 1
    rounds, copies = [], []
    for _ in range(6):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(out, tiny)
        rounds.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        if rpn > 1:
            recv = torch.empty_like(big)
            ops = [dist.P2POp(dist.isend, big, peer), dist.P2POp(dist.irecv, recv, src)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        copies.append(time.perf_counter() - start)
    probe = torch.tensor([statistics.median(rounds[1:]), statistics.median(copies[1:])])
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    round_s, copy_s = probe.tolist()
    link_gbps = net.rate_mbit / 8000.0 if net.rate_mbit > 0 else 1e3
    intra_gbps = big.numel() * 4 / max(copy_s, 1e-9) / 1e9 if rpn > 1 else 1e3
    return HaloCost(round_s / max(world - 1, 1), intra_gbps, link_gbps)


def worker(net: Network) -> None:
    """One rank: measures every (k, tokens, algorithm); rank 0 prints JSON lines."""
    import torch
    import torch.distributed as dist

    from runtime.dispatch.flat import FlatAllToAll
    from runtime.dispatch.halo import Halo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    rpn = net.ranks_per_node
    cost = probe_cost(net)
    opts = {"direct_below_bytes": net.direct_below_bytes, "cost": cost}
    dispatchers = {
        "flat": FlatAllToAll(None, rpn),
        "halo": Halo(None, rpn, **opts),
        "halo-dedup": Halo(None, rpn, dedup=True, **opts),
        FORCED: Halo(None, rpn, direct_below_bytes=0),
    }
    with torch.no_grad():
        for topk in net.topks:
            for tokens in net.tokens:
                for m in _measure(net, dispatchers, cost, topk, tokens):
                    print(f"done {m.algo} k={topk} T={tokens}", file=sys.stderr, flush=True)
                    if dist.get_rank() == 0:
                        print("RESULT " + json.dumps(asdict(m)), flush=True)
    dist.destroy_process_group()


# ---- driver: builds the network, launches ranks, prints ----------------------------------


def run_network(net: Network, timeout_s: float) -> list[Measurement]:
    """Creates the emulated network, runs all ranks of `net`, returns rank 0's results."""
    load_start = os.getloadavg()[0]  # (inside a namespace /proc/loadavg may read 0)
    emulated = netns.setup(net.nodes, net.rate_mbit)
    _CREATED.append(emulated)
    world = net.nodes * net.ranks_per_node
    procs = []
    with tempfile.TemporaryDirectory(prefix="piper-halo-") as logs:
        try:
            for rank in range(world):
                procs.append(_launch(net, emulated, rank, Path(logs)))
            deadline = time.monotonic() + timeout_s
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            for rank, proc in enumerate(procs):
                if proc.returncode != 0:
                    err = (Path(logs) / f"{rank}.err").read_text()[-3000:]
                    raise RuntimeError(f"rank {rank} failed (exit {proc.returncode}):\n{err}")
            lines = (Path(logs) / "0.out").read_text().splitlines()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
            netns.teardown(emulated)
    tagged = [x.removeprefix("RESULT ") for x in lines if x.startswith("RESULT ")]
    load = (load_start + os.getloadavg()[0]) / 2
    return [Measurement(**{**json.loads(x), "load_avg_1min": load}) for x in tagged]


def _launch(net: Network, emulated: netns.EmulatedNet, rank: int, logs: Path):
    """Starts one rank inside its node's namespace; output goes to files in `logs`."""
    env = dict(
        os.environ,
        GLOO_SOCKET_IFNAME="eth0",
        MASTER_ADDR=emulated.address(0),
        MASTER_PORT=str(PORT),
        RANK=str(rank),
        WORLD_SIZE=str(net.nodes * net.ranks_per_node),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
    )
    node = rank // net.ranks_per_node
    cmd = ["ip", "netns", "exec", emulated.namespace(node), sys.executable, __file__]
    cmd += ["--worker", json.dumps(asdict(net))]
    with open(logs / f"{rank}.out", "w") as out, open(logs / f"{rank}.err", "w") as err:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=err)


def ratios(results: list[Measurement]) -> list[dict]:
    """Per (network, routing, k, tokens): flat/HALO and flat/HALO-dedup time and byte ratios."""
    by_key: dict[tuple, dict[str, Measurement]] = {}
    for m in results:
        key = tuple(getattr(m, f) for f in KEY_FIELDS)
        by_key.setdefault(key, {})[m.algo] = m
    rows = []
    for key, algos in by_key.items():
        flat, halo, dedup = (algos[a] for a in ALGOS)
        forced = algos.get(FORCED)
        rows.append(
            {
                **dict(zip(KEY_FIELDS, key, strict=True)),
                "flat_s": flat.median_s,
                "halo_s": halo.median_s,
                "halo_dedup_s": dedup.median_s,
                "flat_over_halo": flat.median_s / halo.median_s,
                "flat_over_halo_dedup": flat.median_s / dedup.median_s,
                "inter_node_bytes_flat": flat.bytes_inter_node,
                "inter_node_bytes_halo": halo.bytes_inter_node,
                "inter_node_bytes_halo_dedup": dedup.bytes_inter_node,
                "halo_path": halo.path,
                "halo_dedup_path": dedup.path,
                "halo_3phase_s": forced.median_s if forced else None,
                "flat_over_halo_3phase": flat.median_s / forced.median_s if forced else None,
            }
        )
    return rows


def headline(rows: list[dict]) -> dict | None:
    """The 4 nodes x 2 ranks, 1 Gbit/s, top-8, uniform routing, largest-size row."""
    match = [r for r in rows if all(r[k] == v for k, v in HEADLINE.items())]
    match = [r for r in match if r["routing"] == "uniform"]
    return max(match, key=lambda r: r["tokens_per_rank"]) if match else None


def report_text(summary: dict) -> str:
    """The table of every (network, k, tokens) row and the headline line, from the summary."""
    head = "nodes x g  Mbit/s  routing       k  tokens   flat ms   halo ms  dedup ms  "
    lines = [
        head + "flat/halo  flat/dedup  flat/3-phase  inter MB flat/halo/dedup  path halo/dedup"
    ]
    for r in summary["ratios"]:
        forced = r.get("flat_over_halo_3phase")
        lines.append(
            f"{r['nodes']:>5} x {r['ranks_per_node']}  {r['rate_mbit'] or 'none':>6}"
            f"  {r['routing']:<12}"
            f" {r['topk']:>2}  {r['tokens_per_rank']:>6}  {1e3 * r['flat_s']:>8.1f}"
            f"  {1e3 * r['halo_s']:>8.1f}  {1e3 * r['halo_dedup_s']:>8.1f}"
            f"  {r['flat_over_halo']:>9.2f}  {r['flat_over_halo_dedup']:>10.2f}"
            + (f"  {forced:>12.2f}" if forced else f"  {'-':>12}")
            + f"  {r['inter_node_bytes_flat'] / 1e6:.2f}/{r['inter_node_bytes_halo'] / 1e6:.2f}"
            f"/{r['inter_node_bytes_halo_dedup'] / 1e6:.2f}"
            f"  {r['halo_path']}/{r.get('halo_dedup_path', '')}"
        )
    top, runs = summary["headline"], summary["headline_runs"]
    if top:
        each = ", ".join(f"{r['flat_over_halo_dedup']:.2f}" for r in runs)
        lines.append(
            f"headline (4x2, 1 Gbit/s, top-8, {top['tokens_per_rank']} tokens/rank), median "
            f"of {len(runs)} launches: flat/HALO {summary['flat_over_halo']:.2f}, "
            f"flat/HALO-dedup {summary['flat_over_halo_dedup']:.2f} (each: {each})"
        )
    return "\n".join(lines)


def write_report(path: str, summary: dict, source: str | None = None) -> None:
    """Write the report to `path` under the command and the machine that measured it.

    Args:
        path: markdown file, e.g. results/halo_emulated.md.
        summary: the --json output's object.
        source: the saved JSON it was read from (None: measured by this command).
    """
    date = summary.get("date_utc")
    when = f"on {date}" if date else "(date not recorded)"
    context = (
        f"Measured {when} with {summary['cpus']} CPUs (every emulated node shares them), load "
        f"average {summary['load_avg_1min_at_end']:.1f} at the end of the sweep."
    )
    if source:
        made_by = f"Rendered from {source}, the output of `sudo {command_line(['--json'])}`."
        context = f"{made_by} {context}"
    title = "Flat vs HALO vs HALO-dedup on emulated nodes (netns + tc tbf)"
    write_atomic(path, render(title, command_line(), context, report_text(summary)))
    print(f"wrote {path}", file=sys.stderr)


_CREATED: list[netns.EmulatedNet] = []


def _cleanup_mine() -> None:
    for net in _CREATED:
        netns.teardown(net)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 nodes x 2 ranks, small sizes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cleanup", action="store_true", help="remove namespaces and exit")
    parser.add_argument(
        "--no-host-profile",
        action="store_true",
        help="skip the unthrottled twin of each network (the host's CPU cost per workload)",
    )
    parser.add_argument(
        "--headline-runs",
        type=int,
        default=3,
        help="independent launches of the headline case (the sweep's is one); the headline "
        "ratios are their median (the 2-core emulation varies ~10%% between launches)",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per network")
    parser.add_argument("--results", default="results/halo_emulated.md", help="markdown to write")
    parser.add_argument("--no-results", action="store_true", help="print only")
    parser.add_argument("--from-json", help="render --results from a saved --json output")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(
            Network(
                **{
                    k: tuple(v) if isinstance(v, list) else v
                    for k, v in json.loads(args.worker).items()
                }
            )
        )
        return 0
    if args.from_json:
        summary = json.loads(Path(args.from_json).read_text())
        print(report_text(summary))
        if not args.no_results:
            write_report(args.results, summary, source=args.from_json)
        return 0
    if args.cleanup:
        print("removed: " + " ".join(netns.teardown_all()) if os.geteuid() == 0 else "needs root")
        return 0
    if os.geteuid() != 0:
        print("halo_emulated: needs root (network namespaces); run with sudo", file=sys.stderr)
        return 2
    atexit.register(_cleanup_mine)
    results: list[Measurement] = []
    for net in sweep(args.quick):
        results += run_network(net, args.timeout_s)
        if not (args.quick or args.no_host_profile):  # same workloads, links not limited
            first = results[-1]
            cost = (first.halo_message_us * 1e-6, first.halo_intra_gbps, net.rate_mbit / 8000.0)
            results += run_network(replace(net, rate_mbit=0, cost=cost), args.timeout_s)
    rows = ratios(results)
    top = headline(rows)
    runs = [top] if top else []
    if top and not args.quick:
        again = Network(4, 2, 1000, (8,), (top["tokens_per_rank"],))
        for _ in range(args.headline_runs - 1):
            runs.append(headline(ratios(run_network(again, args.timeout_s))))
    median = (
        {
            key: statistics.median(r[key] for r in runs)
            for key in ("flat_over_halo", "flat_over_halo_dedup")
        }
        if runs
        else {}
    )
    summary = {
        "measurements": [asdict(m) for m in results],
        "ratios": rows,
        "headline": top,
        "headline_runs": runs,
        "flat_over_halo": median.get("flat_over_halo"),
        "flat_over_halo_dedup": median.get("flat_over_halo_dedup"),
        "cpus": os.cpu_count(),
        "load_avg_1min_at_end": os.getloadavg()[0],
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    print(json.dumps(summary, indent=1) if args.json else report_text(summary))
    if not (args.quick or args.no_results):
        write_report(args.results, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
