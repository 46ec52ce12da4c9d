"""Pre-tokenized training data for `piper run --data PATH`, without torch: the file formats,
their checks, and the vocabulary the run's model gets.

Two layouts of token ids, both a flat little-endian array in a `.bin` file:
- Megatron-LM's indexed dataset: PREFIX.bin + PREFIX.idx. The index starts with
  b"MMIDIDX\\x00\\x00", a uint64 version (1), a uint8 dtype code (1 uint8, 4 int32, 5 int64,
  8 uint16 are read here), then uint64 sequence and document counts and the sequence
  lengths, byte pointers and document indices (megatron/core/datasets/indexed_dataset.py,
  `_IndexWriter` / `_IndexReader`). Only the dtype and the count are used: the run reads
  the .bin as one stream, windows may cross documents (as nanoGPT does).
- nanoGPT's train.bin (data/*/prepare.py writes np.uint16 ids): FILE.bin, uint16 unless a
  FILE.json beside it says {"dtype": "uint16" | "uint32", "vocab_size": N}.
PATH may name the .bin or the Megatron prefix. The vocabulary is the json's vocab_size, else
the largest id + 1.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from planner.run.spec import RunSpec
from planner.specs import SpecError

MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 4: np.int32, 5: np.int64, 8: np.uint16}
SIDECAR_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class TokenFile:
    """A checked token file: its .bin, dtype, number of tokens and vocabulary."""

    bin_path: str
    dtype: str
    tokens: int
    vocab_size: int

    def array(self) -> np.memmap:
        """The tokens, memory-mapped read-only."""
        return np.memmap(self.bin_path, dtype=np.dtype(self.dtype), mode="r", shape=(self.tokens,))


def _megatron_dtype(idx: Path) -> np.dtype:
    head = idx.read_bytes()[: len(MEGATRON_HEADER) + 9]
    if len(head) < len(MEGATRON_HEADER) + 9 or not head.startswith(MEGATRON_HEADER):
        raise SpecError(f"--data: {idx} is not a Megatron index (no MMIDIDX header)")
    version, code = struct.unpack("<QB", head[len(MEGATRON_HEADER) :])
    if version != 1 or code not in MEGATRON_DTYPES:
        raise SpecError(
            f"--data: {idx} has version {version}, dtype code {code}; readable: version 1, "
            f"codes {sorted(MEGATRON_DTYPES)}"
        )
    return np.dtype(MEGATRON_DTYPES[code])


def open_token_file(path: str) -> TokenFile:
    """Check PATH (see module doc) and describe it; SpecError names the file and the fix."""
    bin_path = Path(path if path.endswith(".bin") else f"{path}.bin")
    if not bin_path.is_file():
        raise SpecError(f"--data: {bin_path} not found; give a token .bin or a Megatron prefix")
    idx, side = bin_path.with_suffix(".idx"), bin_path.with_suffix(".json")
    vocab = None
    if idx.is_file():
        dtype = _megatron_dtype(idx)
    elif side.is_file():
        try:
            meta = json.loads(side.read_text())
            dtype, vocab = np.dtype(SIDECAR_DTYPES[meta["dtype"]]), meta.get("vocab_size")
        except (ValueError, KeyError, TypeError):
            raise SpecError(
                f'--data: {side} must be {{"dtype": "uint16" | "uint32", "vocab_size": N}}'
            ) from None
    else:
        dtype = np.dtype(np.uint16)
    size = bin_path.stat().st_size
    if size % dtype.itemsize or size == 0:
        raise SpecError(f"--data: {bin_path} has {size} bytes, not a whole number of {dtype}")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    top = int(tokens.max())
    if int(tokens.min()) < 0 or (vocab is not None and top >= vocab):
        raise SpecError(f"--data: {bin_path} holds ids outside [0, {vocab or top}); fix the file")
    return TokenFile(str(bin_path), dtype.name, len(tokens), int(vocab or top + 1))


def spec_for_data(spec: RunSpec, data: TokenFile, scale: float) -> RunSpec:
    """The run with `data`: a --scale'd run (bytes, vocabulary 256, without data) takes the
    data's vocabulary; a full-size model must already hold every id."""
    need = data.vocab_size
    if scale < 1.0:
        return replace(spec, model=replace(spec.model, vocab_size=need))
    if need > spec.model.vocab_size:
        raise SpecError(
            f"--data: {data.bin_path} needs a vocabulary of {need}, the model has "
            f"{spec.model.vocab_size}; tokenize for this model or use --scale < 1"
        )
    return spec


def check_windows(data: TokenFile, dp: int, seq_len: int) -> None:
    """Each data-parallel rank samples windows of seq_len + 1 tokens in its 1/dp slice."""
    if data.tokens // dp <= seq_len + 1:
        raise SpecError(
            f"--data: {data.bin_path} has {data.tokens} tokens, {data.tokens // dp} per "
            f"data-parallel rank, too few for sequences of {seq_len}; use more data"
        )
