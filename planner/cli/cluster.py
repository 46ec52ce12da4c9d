"""`piper cluster init`: write a cluster YAML from a few answers (planner/CLUSTERS.md).

Answers come from flags; on a terminal the ones not given are asked (Enter keeps the shown
default); when stdin is not a terminal nothing is asked and a missing answer is one line
naming its flag. The logic is planner/inputs/cluster_init.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path

from planner.inputs.cluster_init import (
    FIGURES,
    OPTIONAL,
    QUESTIONS,
    Answers,
    Question,
    defaults,
    describe_cluster,
    next_steps,
)
from planner.specs import SpecError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cluster",
        help="describe a cluster: `piper cluster init` writes its YAML from a few answers",
        description="Cluster profiles. `piper cluster init` writes one from data-sheet answers.",
    )
    p.set_defaults(func=lambda args: _usage(p))
    sub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    init = sub.add_parser(
        "init",
        help="write a cluster YAML from the GPU, node shape, fabric and NICs",
        description="Write a cluster YAML from a few answers: a known GPU (its device block "
        "comes from the preset with that device) or its figures, GPUs per node, the scale-up "
        "fabric, the NICs and the node count. Constants nobody measured are copied from the "
        "closest preset and marked '# GUESS'. On a terminal, answers not given are asked.",
    )
    for q in QUESTIONS:
        init.add_argument(q.flag, dest=q.field, default=None, metavar="N" if q.integer else None,
                          help=q.text)  # fmt: skip
    init.add_argument("--out", default=None, help="the YAML to write (default: NAME.yaml)")
    init.add_argument("--force", action="store_true", help="replace an existing --out file")
    init.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)
    init.set_defaults(func=run)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from planner.outputs.files import write_atomic

    answers = Answers(**{f.name: getattr(args, f.name) for f in fields(Answers)})
    if _terminal():
        answers = _ask(answers)
    out = args.out or f"{answers.name or 'cluster'}.yaml"
    if Path(out).suffix not in (".yaml", ".yml"):
        raise SpecError(f"--out {out}: a cluster file ends in .yaml; fix --out")
    result = describe_cluster(answers, out)  # every answer checked before anything is written
    if Path(out).exists() and not args.force:
        raise SpecError(f"--out {out}: the file exists; choose another --out or pass --force")
    write_atomic(out, result.text)
    print("\n".join(next_steps(result, out)))
    return 0


def _terminal() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def _ask(answers: Answers) -> Answers:
    """Ask on the terminal each question not answered by a flag (the figures only without
    --gpu); Enter keeps the default shown."""
    if answers.gpu is None:
        answers = replace(answers, gpu=_prompt(QUESTIONS[0], None) or "")
    have = defaults(answers)
    for q in QUESTIONS[1:]:
        if getattr(answers, q.field) is not None or (q.field in FIGURES + OPTIONAL
                                                     and answers.gpu):  # fmt: skip
            continue
        answers = replace(answers, **{q.field: _prompt(q, have.get(q.field))})
    return answers


def _prompt(q: Question, default: str | None) -> str | None:
    """One answer from the terminal; None at end of input or when Enter keeps no default."""
    shown = f" [{default}]" if default else ""
    try:
        text = input(f"{q.text}{shown}: ").strip()
    except EOFError:
        return None
    return text or default
