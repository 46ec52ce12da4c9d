"""Pre-tokenized training data for `piper run --data PATH`, without torch: the file formats,
their checks, and the vocabulary the run's model gets.

Two layouts of token ids, both a flat little-endian array in a `.bin` file:
- Megatron-LM's indexed dataset: PREFIX.bin + PREFIX.idx. The index starts with
  b"MMIDIDX\\x00\\x00", a uint64 version (1), a uint8 dtype code (1 uint8, 4 int32, 5 int64,
  8 uint16 are read here), then uint64 sequence and document counts and the sequence
  lengths, byte pointers and document indices (megatron/core/datasets/indexed_dataset.py,
  `_IndexWriter` / `_IndexReader`). The dtype is used, and the sequence lengths must add up
  to the .bin's ids; the run reads the .bin as one stream, windows may cross documents (as
  nanoGPT does).
- nanoGPT's train.bin (data/*/prepare.py writes np.uint16 ids): FILE.bin, uint16 unless a
  FILE.json beside it says {"dtype": "uint16" | "uint32", "vocab_size": N} (vocab_size at
  most what the dtype holds; an optional "tokens": N must equal the .bin's ids), as
  `piper prepare-data` (planner/run/prepare_data.py) writes it.
PATH may name the .bin or the Megatron prefix. The vocabulary is the json's vocab_size, else
the largest id + 1.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from planner.inputs.json_errors import DuplicateKey, unique_object
from planner.inputs.safe_read import open_input, read_input_bytes
from planner.run.spec import RunSpec
from planner.specs import SpecError

MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 4: np.int32, 5: np.int64, 8: np.uint16}
SIDECAR_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MAX_TOKENS = 1 << 62  # a count no file reaches; keeps every product within int64
MAX_SIDECAR_BYTES = 2**20  # the sidecar holds three keys (`piper prepare-data` writes ~60 B)


@dataclass(frozen=True)
class TokenFile:
    """A checked token file: its .bin, dtype, number of tokens and vocabulary."""

    bin_path: str
    dtype: str
    tokens: int
    vocab_size: int

    def array(self) -> np.memmap:
        """The tokens, memory-mapped read-only (from a regular file: _mapped)."""
        return _mapped(Path(self.bin_path), np.dtype(self.dtype), self.tokens)


def _mapped(bin_path: Path, dtype: np.dtype, tokens: int | None = None) -> np.memmap:
    """`bin_path` memory-mapped read-only, once open_input has found it a regular file outside
    /proc, /sys and /dev (planner/inputs/safe_read.py): a FIFO or a device is one line."""
    with open_input(bin_path, "token file", max_bytes=None) as fh:
        shape = None if tokens is None else (tokens,)
        return np.memmap(fh, dtype=dtype, mode="r", shape=shape)


def _megatron_index(idx: Path) -> tuple[np.dtype, int]:
    """The dtype of a Megatron index and the tokens its sequence lengths add up to."""
    with open_input(idx, "Megatron index", max_bytes=None) as fh:
        raw = fh.read(len(MEGATRON_HEADER) + 25)
        if len(raw) == len(MEGATRON_HEADER) + 25:  # the lengths, no more than the file holds
            (sequences,) = struct.unpack("<Q", raw[-16:-8])
            room = os.fstat(fh.fileno()).st_size - len(raw)
            raw += fh.read(max(0, min(sequences * 4, room)))
    head = raw[: len(MEGATRON_HEADER) + 9]
    if len(head) < len(MEGATRON_HEADER) + 9 or not head.startswith(MEGATRON_HEADER):
        raise SpecError(f"--data: {idx} is not a Megatron index (no MMIDIDX header)")
    version, code = struct.unpack("<QB", head[len(MEGATRON_HEADER) :])
    if version != 1 or code not in MEGATRON_DTYPES:
        raise SpecError(
            f"--data: {idx} has version {version}, dtype code {code}; readable: version 1, "
            f"codes {sorted(MEGATRON_DTYPES)}"
        )
    at = len(head)
    if len(raw) < at + 16:
        raise SpecError(f"--data: {idx} ends inside its header; rebuild the index")
    (sequences,) = struct.unpack("<Q", raw[at : at + 8])
    room = (len(raw) - at - 16) // 4
    lengths = np.frombuffer(raw, dtype=np.int32, count=min(sequences, room), offset=at + 16)
    if len(lengths) < sequences:
        raise SpecError(f"--data: {idx} lists {sequences} sequences but ends early; rebuild it")
    return np.dtype(MEGATRON_DTYPES[code]), int(lengths.sum(dtype=np.int64))


def _sidecar(side: Path) -> tuple[np.dtype, int | None, int | None]:
    """dtype, vocab_size and tokens of a .json sidecar (the last two may be absent). Every
    fault is one SpecError line naming the file: not UTF-8 or not JSON, a key given twice,
    nesting past the stack, an integer of more than 4300 digits, a missing or unknown dtype,
    counts that are not integers in [1, MAX_TOKENS]."""

    def bad(problem: str) -> SpecError:
        return SpecError(
            f'--data: {side}: {problem}; it must be {{"dtype": "uint16" | "uint32", '
            '"vocab_size": N} (optional "tokens": N), N a positive integer'
        )

    raw = read_input_bytes(side, "token sidecar", MAX_SIDECAR_BYTES)
    try:
        meta = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_object)
    except DuplicateKey as exc:
        raise bad(f"key {str(exc)[:60]!r} is given twice") from None
    except RecursionError:
        raise bad("nesting deeper than Python's stack") from None
    except json.JSONDecodeError as exc:
        raise bad(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise bad("not UTF-8 text") from None
    except ValueError:  # int() of more digits than sys.get_int_max_str_digits() allows
        raise bad(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None
    if not isinstance(meta, dict):
        raise bad("not a JSON object")
    if "dtype" not in meta:
        raise bad("field 'dtype' is missing")
    if not isinstance(meta["dtype"], str) or meta["dtype"] not in SIDECAR_DTYPES:
        raise bad(f"field 'dtype' is {str(meta.get('dtype'))[:30]!r}")
    dtype = np.dtype(SIDECAR_DTYPES[meta["dtype"]])
    vocab, tokens = meta.get("vocab_size"), meta.get("tokens")
    for key, value in (("vocab_size", vocab), ("tokens", tokens)):
        if value is not None and (type(value) is not int or not 0 < value <= MAX_TOKENS):
            raise bad(f"field {key!r} is {str(value)[:30]!r}, not an integer in [1, {MAX_TOKENS}]")
    if vocab is not None and vocab > np.iinfo(dtype).max + 1:
        raise SpecError(
            f"--data: {side} says vocab_size {vocab} in {dtype}, which holds ids below "
            f"{np.iinfo(dtype).max + 1}; fix the .json or rebuild with uint32"
        )
    return dtype, vocab, tokens  # type: ignore[return-value]


def open_token_file(path: str) -> TokenFile:
    """Check PATH (see module doc) and describe it; SpecError names the file and the fix."""
    bin_path = Path(path if path.endswith(".bin") else f"{path}.bin")
    if not os.path.lexists(bin_path):
        raise SpecError(f"--data: {bin_path} not found; give a token .bin or a Megatron prefix")
    with open_input(bin_path, "token file", max_bytes=None) as fh:  # not a FIFO or device
        size = os.fstat(fh.fileno()).st_size
    idx, side = bin_path.with_suffix(".idx"), bin_path.with_suffix(".json")
    vocab = expected = None
    if os.path.lexists(idx):
        dtype, expected = _megatron_index(idx)
    elif os.path.lexists(side):
        dtype, vocab, expected = _sidecar(side)
    else:
        dtype = np.dtype(np.uint16)
    if size % dtype.itemsize or size == 0:
        raise SpecError(f"--data: {bin_path} has {size} bytes, not a whole number of {dtype}")
    if expected is not None and expected != size // dtype.itemsize:
        meta = idx if os.path.lexists(idx) else side
        raise SpecError(
            f"--data: {meta} counts {expected} tokens, {bin_path} holds "
            f"{size // dtype.itemsize} {dtype}; the pair is inconsistent, rebuild it"
        )
    tokens = _mapped(bin_path, dtype)
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
