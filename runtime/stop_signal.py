"""SIGTERM during training: every rank stops after the same step.

A scheduler's SIGTERM (or torchrun passing one on) may reach the ranks at different steps,
or reach one rank only. Each rank notes it in a handler; after every step the ranks agree
on it (one all-reduce of a flag on a gloo group of their own), so all leave the loop after
the same step, finish the save in flight and write their files.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class StopSignal:
    """Holds SIGTERM for the training loop from construction to `close`."""

    def __init__(self) -> None:
        self.received = False
        self.group = dist.new_group(backend="gloo")  # a CPU flag, whatever the device
        self.previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, _signum: int, _frame: object) -> None:
        self.received = True

    def agreed(self) -> bool:
        """Whether any rank has received SIGTERM (every rank calls it after each step)."""
        flag = torch.tensor([int(self.received)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def close(self) -> None:
        """Give SIGTERM back to the handler it had before."""
        signal.signal(signal.SIGTERM, self.previous)
