"""Tokenize local text into the token file `piper run --data` reads (`piper prepare-data`).

Inputs, in the order given (a directory: its files with a known suffix, sorted walk):
- `.txt`: one document per file, or per non-empty line with documents="line";
- `.jsonl`: one JSON object per line, the document is its `text_key` field;
- with Hugging Face `datasets` installed (not a dependency of Piper): a directory written by
  `Dataset.save_to_disk`, `.parquet` files and `.arrow` files, the document is `text_key`.
The tokenizer is a `tokenizer.json` (the `tokenizers` library, `Tokenizer.from_file`) or a
local model directory (transformers `AutoTokenizer.from_pretrained(dir,
local_files_only=True, trust_remote_code=False)`: a directory whose auto_map names its own
tokenizer code is refused, that code never runs). Each document is encoded as the tokenizer
encodes it (its own special tokens included, as Megatron-LM's HuggingFaceTokenizer does by default,
megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py:288) and followed by the EOS
id, as Megatron-LM's tools/preprocess_data.py:103 (--append-eod) and nanoGPT's
data/openwebtext/prepare.py:45 do; a blank document, or one that encodes to nothing, is
skipped (Megatron's rule, preprocess_data.py:103), one that already ends in EOS gets no second.

Output, PREFIX.bin + PREFIX.json: the ids as one little-endian array, uint16 when the
vocabulary fits (<= 65536 ids; nanoGPT's prepare.py:62 uses uint16 for GPT-2), else uint32,
and {"dtype", "vocab_size", "tokens", "documents", "eos_id", "tokenizer"}: the nanoGPT layout
with the sidecar planner/run/token_data.py reads. Both files go through temporaries and
os.replace, so a failure leaves no output and no temporary behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from planner.inputs.safe_read import read_input_bytes
from planner.run.options import TORCH_INSTALL
from planner.specs import SpecError

TEXT_SUFFIXES = (".txt", ".jsonl")
DATASET_SUFFIXES = (".parquet", ".arrow")
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
BATCH_CHARS = 4 * 2**20  # text encoded per tokenizer call: bounds memory on any input
Update = Callable[[int, int | None], None]


@dataclass(frozen=True)
class PrepareOptions:
    """What `piper prepare-data` was asked: inputs, tokenizer, output prefix, text field."""

    inputs: tuple[str, ...]
    tokenizer: str
    out: str
    text_key: str = "text"
    documents: Literal["file", "line"] = "file"  # what one .txt document is
    eos_token: str | None = None  # default: the tokenizer's own EOS (see load_tokenizer)


@dataclass(frozen=True)
class PreparedData:
    """The files written and what they hold."""

    bin_path: str
    json_path: str
    dtype: str
    tokens: int
    documents: int
    vocab_size: int
    eos_id: int


@dataclass(frozen=True)
class TextTokenizer:
    """encode(texts) -> ids per text; the vocabulary (added tokens included) and EOS id."""

    encode: Callable[[list[str]], list[list[int]]]
    vocab_size: int
    eos_id: int
    name: str


def _eos_name(path: Path, eos_token: str | None, vocab: dict[str, int]) -> str:
    """--eos-token, else a tokenizer_config.json beside a tokenizer file, else a usual EOS
    name; it must be in the vocabulary."""
    name = eos_token
    config = path.with_name("tokenizer_config.json")
    if name is None and path.is_file() and config.is_file():
        try:
            doc = json.loads(read_input_bytes(config, "tokenizer config").decode("utf-8"))
            eos = doc.get("eos_token") if isinstance(doc, dict) else None
        except (ValueError, RecursionError, UnicodeDecodeError):
            raise SpecError(
                f"--tokenizer: {config} is not a JSON object; fix it or pass --eos-token TOKEN"
            ) from None
        name = eos.get("content") if isinstance(eos, dict) else eos
        if name is not None and not isinstance(name, str):
            raise SpecError(
                f"--tokenizer: {config}: 'eos_token' is not a string; fix it or pass --eos-token"
            )
    if name is None:
        name = next((n for n in EOS_NAMES if n in vocab), None)
    if name is None:
        raise SpecError(
            f"--tokenizer: {path} names no EOS token (none of {', '.join(EOS_NAMES)}); "
            "pass --eos-token TOKEN"
        )
    if name not in vocab:
        raise SpecError(f"--eos-token: {name!r} is not in {path}'s vocabulary; name one that is")
    return name


def _require(module: str, what: str, install: str | None = None) -> None:
    """A missing optional package is a one-line error naming it and the command that installs
    it (`pip install MODULE` unless `install` is given), not a traceback."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        how = f"install it with: {install}" if install else f"pip install {module}"
        raise SpecError(f"--tokenizer: {what} needs the `{module}` package; {how}")


def _file_tokenizer(path: Path, eos_token: str | None) -> TextTokenizer:
    # tokenizers is in the `runtime` extra (pyproject.toml): the install line of a run
    _require("tokenizers", f"{path} (a tokenizer file)", TORCH_INSTALL)
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception on any bad file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(
            f"--tokenizer: {path} is not a tokenizers JSON file ({first}); give a "
            "tokenizer.json or a model directory"
        ) from None
    vocab = tok.get_vocab(with_added_tokens=True)
    name = _eos_name(path, eos_token, vocab)

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts)]

    return TextTokenizer(encode, tok.get_vocab_size(with_added_tokens=True), vocab[name], str(path))


def _auto_tokenizer(path: Path) -> Any:
    """transformers' AutoTokenizer for model directory `path`, never running the directory's
    own code: a directory from others may map AutoTokenizer to its own Python (auto_map), and
    without trust_remote_code=False transformers asks on stdin, where `y` runs it. Its
    warnings are kept off stderr (a refusal is one line)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "custom code" in first:
            raise SpecError(
                f"--tokenizer: {path} asks to run its own tokenizer code (auto_map in its "
                "tokenizer_config.json); Piper never runs code from a model directory: give "
                "its tokenizer.json instead"
            ) from None
        raise SpecError(
            f"--tokenizer: no tokenizer loads from {path} ({first}); give a model directory "
            "with tokenizer files or a tokenizer.json"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)


def _dir_tokenizer(path: Path, eos_token: str | None) -> TextTokenizer:
    _require("transformers", f"{path} (a model directory)")
    tok = _auto_tokenizer(path)
    vocab = tok.get_vocab()
    if eos_token is None and tok.eos_token_id is not None:
        eos = int(tok.eos_token_id)
    else:
        eos = vocab[_eos_name(path, eos_token, vocab)]

    def encode(texts: list[str]) -> list[list[int]]:
        return tok(texts, verbose=False)["input_ids"]

    return TextTokenizer(encode, len(tok), int(eos), str(path))


def load_tokenizer(path: str, eos_token: str | None = None) -> TextTokenizer:
    """A tokenizer.json file or a local model directory (see the module doc); the EOS is
    `eos_token`, else the tokenizer's own (a directory's tokenizer_config.json, or for a
    file one beside it), else the first of EOS_NAMES in the vocabulary."""
    p = Path(path)
    if p.is_dir():
        return _dir_tokenizer(p, eos_token)
    if p.is_file():
        return _file_tokenizer(p, eos_token)
    raise SpecError(f"--tokenizer: {path} not found; give a tokenizer.json or a model directory")


def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and (p / "dataset_info.json").is_file() and (p / "state.json").is_file()


def list_sources(inputs: tuple[str, ...]) -> list[Path]:
    """The input files (and saved datasets) in order; SpecError for anything unreadable."""
    known = TEXT_SUFFIXES + DATASET_SUFFIXES
    sources: list[Path] = []
    for item in inputs:
        p = Path(item)
        if (p / "dataset_dict.json").is_file():
            raise SpecError(f"input: {p} holds several splits; give one, e.g. {p / 'train'}")
        if _is_saved_dataset(p) or (p.is_file() and p.suffix in known):
            sources.append(p)
        elif p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in known)
            if not found:
                raise SpecError(f"input: {p} holds no {', '.join(known)} files; check the path")
            sources += found
        elif p.is_file():
            raise SpecError(f"input: {p} is not {', '.join(known)}; convert it or leave it out")
        else:
            raise SpecError(f"input: {p} not found; check the path")
    return sources


def _jsonl_text(path: Path, lineno: int, line: str, key: str) -> str:
    try:
        text = json.loads(line)[key]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise SpecError(
            f"input: {path} line {lineno} is not a JSON object with a string {key!r}; "
            "fix the line or choose the field with --text-key"
        ) from None
    if not isinstance(text, str):
        raise SpecError(f"input: {path} line {lineno}: {key!r} is not a string; fix the line")
    return text


def _text_documents(path: Path, opts: PrepareOptions) -> Iterator[tuple[str, int]]:
    """(document, bytes of the file read so far) for a .txt or .jsonl file."""
    try:
        if path.suffix == ".txt" and opts.documents == "file":
            text = path.read_text(encoding="utf-8")
            yield text, path.stat().st_size
            return
        done = 0
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                done += len(raw)
                line = raw.decode("utf-8").rstrip("\r\n")
                if path.suffix == ".jsonl" and line.strip():
                    yield _jsonl_text(path, lineno, line, opts.text_key), done
                elif path.suffix == ".txt" and line.strip():
                    yield line, done
    except UnicodeDecodeError as exc:
        raise SpecError(f"input: {path} is not UTF-8 text ({exc.reason}); convert it") from None


def _dataset_documents(path: Path, key: str) -> Iterator[tuple[str, int]]:
    """(document, share of the dataset's bytes read so far) for a saved dataset, .parquet or
    .arrow file; needs Hugging Face `datasets`."""
    try:
        import datasets
    except ImportError:
        raise SpecError(
            f"input: {path} is a Hugging Face dataset; `pip install datasets` to read it"
        ) from None
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        size = sum(q.stat().st_size for q in path.rglob("*") if q.is_file())
    elif path.suffix == ".arrow":
        ds, size = datasets.Dataset.from_file(str(path)), path.stat().st_size
    else:  # pyarrow (a dependency of datasets) streams it without a cache directory
        yield from _parquet_documents(path, key)
        return
    if isinstance(ds, datasets.DatasetDict) or key not in ds.column_names:
        raise SpecError(
            f"input: {path} has no column {key!r} (columns: {_columns(ds)}); choose one with "
            "--text-key, or save one split"
        )
    i, rows = 0, max(len(ds), 1)
    for batch in ds.select_columns([key]).iter(batch_size=1024):  # a column slice at a time
        for text in batch[key]:
            if not isinstance(text, str):
                raise SpecError(f"input: {path} row {i}: {key!r} is not a string; fix it")
            i += 1
            yield text, size * i // rows


def _parquet_documents(path: Path, key: str) -> Iterator[tuple[str, int]]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    if key not in f.schema_arrow.names:
        raise SpecError(
            f"input: {path} has no column {key!r} (columns: {', '.join(f.schema_arrow.names)}); "
            "choose one with --text-key"
        )
    rows, size, i = max(f.metadata.num_rows, 1), path.stat().st_size, 0
    for batch in f.iter_batches(columns=[key]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise SpecError(f"input: {path} row {i}: {key!r} is not a string; fix the file")
            i += 1
            yield text, size * i // rows


def _columns(ds: Any) -> str:
    names = ds.column_names
    flat = names if isinstance(names, list) else [f"{k}: {v}" for k, v in names.items()]
    return ", ".join(map(str, flat))


def _documents(sources: list[Path], opts: PrepareOptions) -> Iterator[tuple[str, int]]:
    """Every document of every source, with the input bytes read so far."""
    before = 0
    for path in sources:
        is_text = path.is_file() and path.suffix in TEXT_SUFFIXES
        docs = _text_documents(path, opts) if is_text else _dataset_documents(path, opts.text_key)
        for text, done in docs:
            yield text, before + done
        before += _size(path)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(q.stat().st_size for q in path.rglob("*") if q.is_file())
    return path.stat().st_size


def _batches(docs: Iterator[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    batch, chars, done = [], 0, 0
    for text, done in docs:
        if not text.strip():  # blank: no document (a tokenizer's BOS alone is none either)
            continue
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield batch, done
            batch, chars = [], 0
    if batch:
        yield batch, done


def _write(
    tmp_bin, tok: TextTokenizer, dtype: np.dtype, batches, update: Update
) -> tuple[int, int]:
    """Encode each batch and append its ids (EOS after each document) to tmp_bin; returns
    (tokens, documents)."""
    tokens = documents = 0
    for texts, done in batches:
        ids: list[int] = []
        for doc in tok.encode(texts):
            if not doc:
                continue
            ids += doc if doc[-1] == tok.eos_id else [*doc, tok.eos_id]
            documents += 1
        arr = np.asarray(ids, dtype=np.int64)
        if len(arr) and (arr.min() < 0 or arr.max() >= tok.vocab_size):
            raise SpecError(f"--tokenizer: {tok.name} gave ids outside [0, {tok.vocab_size})")
        arr.astype(dtype).tofile(tmp_bin)
        tokens += len(arr)
        update(done, None)
    return tokens, documents


def prepare_data(opts: PrepareOptions, update: Update | None = None) -> PreparedData:
    """Tokenize opts.inputs with opts.tokenizer into opts.out (+ .bin, + .json).

    Args:
        opts: the inputs, tokenizer, output prefix (PREFIX or PREFIX.bin), text field and
            what a .txt document is.
        update: progress callback (input bytes read, total input bytes or None).
    Returns:
        the files written and their counts. SpecError (nothing written) for a missing or
        unreadable input, a JSONL line or dataset without the text field, a tokenizer that
        does not load, or inputs without a single token.
    """
    update = update or (lambda done, total=None: None)
    prefix = opts.out[: -len(".bin")] if opts.out.endswith(".bin") else opts.out
    if not Path(prefix).name or Path(prefix).is_dir():
        raise SpecError(f"--out: {opts.out} is a directory; give a prefix such as DIR/train")
    bin_path, json_path = Path(f"{prefix}.bin"), Path(f"{prefix}.json")
    if Path(f"{prefix}.idx").exists():
        raise SpecError(
            f"--out: {prefix}.idx exists and --data would read it instead of {json_path}; "
            "choose another --out"
        )
    if not bin_path.parent.is_dir():
        raise SpecError(f"--out: directory {bin_path.parent} does not exist; create it first")
    sources = list_sources(opts.inputs)
    tok = load_tokenizer(opts.tokenizer, opts.eos_token)
    dtype = np.dtype("<u2" if tok.vocab_size <= 2**16 else "<u4")  # little-endian, as read
    total = sum(_size(p) for p in sources)
    update(0, total)
    tmp_bin, tmp_json = _temporary(bin_path), _temporary(json_path)
    try:
        with open(tmp_bin, "wb") as f:
            tokens, documents = _write(f, tok, dtype, _batches(_documents(sources, opts)), update)
        update(total, None)
        if tokens == 0:
            raise SpecError(
                f"input: {', '.join(opts.inputs)} holds no text; give non-empty documents"
            )
        meta = {
            "dtype": dtype.name,
            "vocab_size": tok.vocab_size,
            "tokens": tokens,
            "documents": documents,
            "eos_id": tok.eos_id,
            "tokenizer": os.path.basename(os.path.normpath(opts.tokenizer)),
        }
        Path(tmp_json).write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp_bin, bin_path)  # a reader between the two sees tokens != the .bin's
        os.replace(tmp_json, json_path)
    finally:
        for name in (tmp_bin, tmp_json):
            Path(name).unlink(missing_ok=True)
    return PreparedData(
        str(bin_path), str(json_path), dtype.name, tokens, documents, tok.vocab_size, tok.eos_id
    )


def _temporary(path: Path) -> str:
    """An empty file beside `path` (same file system, so os.replace is atomic), mode 0644."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(name, 0o644)
    return name
