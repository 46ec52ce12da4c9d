"""Communication micro-benchmarks of `piper profile`: point-to-point and all-to-all GB/s
between the ranks of a torch.distributed job, and each rank's node."""

from __future__ import annotations

import socket
import statistics

import torch
import torch.distributed as dist

from runtime.bench.timing import time_op


def bench_p2p(pair: tuple[int, int], sizes: tuple[int, ...], device, iters: int) -> list[float]:
    """One-way GB/s between the two ranks of `pair` (ping-pong); every rank must call it."""
    rank = dist.get_rank()
    out = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        dist.barrier()
        if rank not in pair:
            out.append(0.0)
            continue
        peer = pair[1] if rank == pair[0] else pair[0]

        def pingpong(buf=buf, peer=peer) -> None:
            if rank == pair[0]:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        t = time_op(pingpong, device, iters)
        out.append(nbytes / (t / 2) / 1e9)
    dist.barrier()
    return out


def bench_a2a(group, group_size: int, sizes: tuple[int, ...], device, iters: int) -> list[float]:
    """All-to-all GB/s per rank (send-buffer bytes / slowest rank's time) in `group`."""
    out = []
    for nbytes in sizes:
        per_peer = max(nbytes // group_size, 1)
        send = torch.ones(per_peer * group_size, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        dist.barrier()
        t = time_op(
            lambda send=send, recv=recv: dist.all_to_all_single(recv, send, group=group),
            device,
            iters,
        )
        slowest = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out.append(per_peer * group_size / float(slowest.item()) / 1e9)
    return out


def median_over_ranks(values: list[float]) -> list[float]:
    """Per position, the median of `values` over every rank (every rank must call it)."""
    gathered: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [statistics.median(col) for col in zip(*gathered, strict=True)]


def node_of_ranks(ranks_per_node: int | None) -> list[int]:
    """Node index of every rank: from the declared node size, else from hostnames."""
    world = dist.get_world_size()
    if ranks_per_node:
        return [r // ranks_per_node for r in range(world)]
    names: list[str | None] = [None] * world
    dist.all_gather_object(names, socket.gethostname())
    order = list(dict.fromkeys(names))
    return [order.index(n) for n in names]


def comm_rows(sz, node_of: list[int], device: torch.device) -> list[dict]:
    """p2p and all-to-all rows, each {kind, ranks, x, y}; every rank calls, rank 0 keeps."""
    world = dist.get_world_size()
    rows: list[dict] = []
    same = [r for r in range(1, world) if node_of[r] == node_of[0]]
    other = [r for r in range(1, world) if node_of[r] != node_of[0]]
    for peer in same[:1] + other[:1]:
        y = bench_p2p((0, peer), sz.p2p_bytes, device, sz.iters)
        rows.append({"kind": "p2p", "ranks": [0, peer], "x": list(sz.p2p_bytes), "y": y})
    nodes = sorted(set(node_of))
    members = [[r for r in range(world) if node_of[r] == n] for n in nodes]
    groups = [dist.new_group(m) for m in members]  # every rank creates every group
    mine = next(i for i, m in enumerate(members) if dist.get_rank() in m)
    if len(members[mine]) > 1 and all(len(m) == len(members[0]) for m in members):
        y = bench_a2a(groups[mine], len(members[mine]), sz.a2a_bytes, device, sz.iters)
        rows.append({"kind": "a2a", "ranks": members[0], "x": list(sz.a2a_bytes), "y": y})
    if len(nodes) > 1:
        y = bench_a2a(None, world, sz.a2a_bytes, device, sz.iters)
        rows.append({"kind": "a2a", "ranks": list(range(world)), "x": list(sz.a2a_bytes), "y": y})
    return rows
