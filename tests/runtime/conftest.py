"""Shared helper for runtime tests: run a function on N gloo processes on this CPU.

Use it through the fixture: `def test_x(run_distributed): run_distributed(fn, 4, arg)`.
`fn` is called as
`fn(rank, world_size, *args)` after the default process group (gloo) is initialized, and its
return value (picklable) is collected per rank. Any rank failing, or the run exceeding
`timeout_s`, raises in the test process with that rank's traceback.

Processes are forked (fast: no re-import of torch), so `fn` may be any module-level or
nested function; each child sets one intra-op thread.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn, rank, world_size, port, backend, args, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    backend: str = "gloo",
) -> list[Any]:
    """Runs `fn(rank, world_size, *args)` on `world_size` processes joined in one gloo group.

    Args:
      fn: the per-rank body; the default process group is ready when it is called.
      world_size: number of processes.
      args: extra positional arguments (inherited through fork, so need not be picklable).
      timeout_s: wall-clock limit for the whole launch (seconds).
      backend: torch.distributed backend ("gloo" on CPU).

    Returns:
      The return values of `fn`, indexed by rank.

    Raises:
      RuntimeError: a rank raised (its traceback is in the message) or the launch timed out.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, backend, args, results))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    failures: list[str] = []
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"run_distributed: timed out after {timeout_s} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise RuntimeError(
                        f"run_distributed: a rank exited with code {dead[0].exitcode}"
                    ) from None
                continue
            if ok:
                values[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                break  # the other ranks may now block forever; stop them below
    finally:
        for proc in procs:
            proc.join(timeout=0.1 if failures or len(values) < world_size else 5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise RuntimeError("run_distributed: " + "\n".join(failures))
    return [values[r] for r in range(world_size)]


@pytest.fixture(name="run_distributed")
def _run_distributed_fixture() -> Callable[..., list[Any]]:
    """`run_distributed(fn, world_size, *args, timeout_s=60.0)` as a fixture."""
    return run_distributed


@pytest.fixture(scope="module")
def corpus() -> None:
    """The stdlib corpus loaded once in the parent process; forked ranks inherit it."""
    from runtime.data import load_corpus

    load_corpus()
