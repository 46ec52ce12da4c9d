"""`piper prepare-data INPUT... --tokenizer T --out PREFIX`: tokenize local text into the
token file `piper run --data PREFIX.bin` reads (planner/run/prepare_data.py)."""

from __future__ import annotations

import argparse
import json

from planner.outputs.console import progress
from planner.run.prepare_data import PrepareOptions, prepare_data


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare-data",
        help="tokenize local text (.txt, .jsonl, HF datasets) into a token file for run --data",
        description="Tokenize local documents with a local tokenizer and write PREFIX.bin "
        "(uint16 ids, uint32 above 65536) + PREFIX.json, an EOS id after each document; "
        "`piper run PLAN --data PREFIX.bin` trains on it. No network is used.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=".txt or .jsonl files, directories of them; with `datasets` installed also "
        ".parquet, .arrow and Dataset.save_to_disk directories",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help="a tokenizer.json, or a local model directory with tokenizer files",
    )
    p.add_argument("--out", required=True, help="output prefix: writes PREFIX.bin, PREFIX.json")
    p.add_argument("--text-key", default="text", help="JSONL / dataset field (default text)")
    p.add_argument(
        "--documents",
        choices=("file", "line"),
        default="file",
        help="a .txt document is the whole file (default) or each non-empty line",
    )
    p.add_argument("--eos-token", help="the end-of-document token (default: the tokenizer's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    opts = PrepareOptions(
        inputs=tuple(args.inputs),
        tokenizer=args.tokenizer,
        out=args.out,
        text_key=args.text_key,
        documents=args.documents,
        eos_token=args.eos_token,
    )
    with progress("tokenizing") as update:
        done = prepare_data(opts, update)
    if args.json:
        print(json.dumps(done.__dict__, indent=1))
    else:
        print(
            f"{done.bin_path}: {done.tokens} tokens ({done.dtype}) in {done.documents} "
            f"documents, vocabulary {done.vocab_size}, EOS id {done.eos_id}; "
            f"train on it with `piper run PLAN --data {done.bin_path}`"
        )
    return 0
