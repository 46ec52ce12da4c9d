"""Real text for training runs: by default, bytes of the Python standard library's source
files; with `piper run --data`, a pre-tokenized file (planner/run/token_data.py).

The corpus is on every machine that runs Python, so a CPU test, a GPU node and CI all train
on the same text and a falling loss means the model learned something. Tokens are bytes
(vocabulary 256). Sampling is a pure function of (seed, step, dp index): every stage of a
pipeline replica draws the same windows (the first stage uses the inputs, the last the
targets), and each data-parallel rank reads only its own contiguous slice of the corpus.

Shape letters: B = sequences, S = sequence length.
"""

from __future__ import annotations

import os
import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from planner.inputs.safe_read import open_input
from planner.specs import SpecError

VOCAB_SIZE = 256


def _stdlib_sources(root: Path):
    """*.py files under root in a fixed order (sorted walk), skipping tests and site-packages."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


@lru_cache(maxsize=2)
def load_corpus(max_bytes: int = 2 * 2**20) -> torch.Tensor:
    """The stdlib's *.py files in sorted-walk order, concatenated, as uint8 (<= max_bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    blob = corpus_bytes(root, max_bytes)
    if len(blob) < 2**16:
        raise RuntimeError(f"stdlib corpus under {root} is too small ({len(blob)} bytes)")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def corpus_bytes(root: Path, max_bytes: int) -> bytes:
    """The first `max_bytes` of root's *.py files in sorted-walk order. Only regular files
    outside /proc, /sys and /dev are read, and no more of each than is still needed
    (planner/inputs/safe_read.py); a FIFO, device or unreadable file is skipped."""
    chunks, total = [], 0
    for path in _stdlib_sources(root):
        try:
            with open_input(path, "corpus file", max_bytes=None) as fh:
                data = fh.read(max_bytes - total)
        except (SpecError, OSError):
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)


def sample_batch(
    step: int, dp_index: int, dp: int, batch: int, seq_len: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, both int64 [batch, seq_len], for one dp rank and step.

    Args:
        step: optimizer step. dp_index, dp: this replica's index and the dp degree; the
            corpus is cut into dp equal slices and replica i samples only slice i.
        batch: sequences (micro_batch * num_microbatches). seq_len: bytes per sequence.
        seed: run seed.
    """
    return sample_windows(load_corpus(), step, dp_index, dp, batch, seq_len, seed)


def sample_windows(
    corpus, step: int, dp_index: int, dp: int, batch: int, seq_len: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_batch from any 1-D token array: a tensor, or a numpy memmap of token ids
    (planner.run.token_data.TokenFile.array: only the windows drawn are read)."""
    slice_len = len(corpus) // dp
    if slice_len <= seq_len + 1:
        raise ValueError(f"seq_len {seq_len} too long for a corpus slice of {slice_len} tokens")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + dp_index)
    start_B = torch.randint(0, slice_len - seq_len - 1, (batch,), generator=gen)
    start_B += dp_index * slice_len
    idx_BS = start_B[:, None] + torch.arange(seq_len + 1)[None, :]
    if torch.is_tensor(corpus):
        window = corpus[idx_BS].long()
    else:
        window = torch.from_numpy(corpus[idx_BS.numpy()].astype(np.int64))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class TokenSampler:
    """sample_batch's signature over a pre-tokenized file (`piper run --data`)."""

    def __init__(self, tokens) -> None:
        self.tokens = tokens

    def __call__(self, step, dp_index, dp, batch, seq_len, seed=0):
        return sample_windows(self.tokens, step, dp_index, dp, batch, seq_len, seed)
