"""RunOptions: what one `piper run` is asked to do, written once for every place that needs it.

Each field is one command-line flag (`migrate_every` is `--migrate-every`): its type gives the
argparse type (a Literal gives the choices, a bool a switch) and its metadata the help text.
`add_run_arguments` adds the flags to a parser (`piper run` and `python -m runtime.launch`
both call it), `RunOptions.from_args` reads them back, and `to_launch_argv` writes the
`-m runtime.launch ...` arguments that `piper run` hands to torchrun. Fields marked cli_only
(`--nproc`, `--force`) decide whether and how `piper run` starts the processes; the launcher
has none of them.

The processes' lifetime is written here too, for both sides of the torchrun line:
`torchrun_command` starts torchrun so that it dies with `piper run` (`run_torchrun`), and
`die_with_torchrun` makes each training process die with torchrun; `check_torch` refuses a run
on a Python without torch before anything starts.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import logging
import os
import runpy
import signal
import sys
import typing
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from planner.specs import SpecError

Dispatcher = Literal["halo", "halo-dedup", "flat"]
ExpertGemm = Literal["grouped", "loop"]
Precision = Literal["fp32", "bf16", "plan"]
# the compute dtype `--precision plan` takes for each plan dtype: fp8 and fp4 GEMMs are not
# run here, bf16 is the nearest; fp32 stays fp32
PLAN_COMPUTE = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"} | {
    low: "bf16" for low in ("fp8", "mxfp8", "fp8_blockwise", "nvfp4", "mxfp4")
}
LAUNCH_MODULE = "runtime.launch"


def _flag(
    default: Any,
    help: str | None = None,
    *,
    metavar: str | None = None,
    cli_only: bool = False,
    launcher_default: Any = None,
) -> Any:
    """A RunOptions field that is one flag; cli_only: only `piper run` has it;
    launcher_default: the launcher's default where `piper run` resolves a None default itself
    (written on the torchrun line in place of a None)."""
    meta = {"help": help, "metavar": metavar, "cli_only": cli_only}
    return field(default=default, metadata={**meta, "launcher_default": launcher_default})


@dataclass(frozen=True)
class RunOptions:
    """One training run as the user asked for it; planner.run.spec turns it into a RunSpec."""

    # PLAN for `piper run`, a required --plan for the launcher
    plan: str = field(metadata={"help": "plan.json written by 'piper plan'", "positional": True})
    steps: int = _flag(30, "optimizer steps (default 30)")
    nproc: int | None = _flag(None, "processes (default: pp*dp*tp)", cli_only=True)
    ranks_per_node: int | None = _flag(
        None, "emulated node size (default: the plan cluster's gpus_per_node)"
    )
    scale: float = _flag(1.0, "shrink widths, depth and sequence by F in (0, 1] (see RUNTIME.md)")
    dispatcher: Dispatcher | None = _flag(
        None, "expert all-to-all (default: the one the plan was priced with; RUNTIME.md)"
    )
    migrate_every: int = _flag(0, "migrate experts every K steps (0 = never)", metavar="K")
    out: str | None = _flag(None, "output directory (default: PLAN's dir/run)")
    seed: int = _flag(0)
    lr: float = _flag(3e-3, "Adam learning rate")
    trace_every: int = _flag(1, "sum S steps into one trace.csv interval (default 1)", metavar="S")
    halo_direct_below_bytes: int = _flag(
        -1,
        "HALO sends directly when node-to-node messages are below B bytes "
        "(0 = always hierarchical; default: the dispatcher's own threshold)",
        metavar="B",
    )
    router_bias_rate: float = _flag(
        0.0, "aux-loss-free balancing: router bias step per update (0 = off)", metavar="R"
    )
    expert_gemm: ExpertGemm = _flag(
        "grouped", "a rank's experts in grouped GEMMs (torch._grouped_mm) or one by one"
    )
    precision: Precision = _flag(
        "plan",
        "compute dtype: plan (default): the plan's training dtype (bf16 for bf16 and the fp8 "
        "and fp4 dtypes); fp32; bf16 (autocast, fp32 master weights, Adam and reductions)",
    )
    data: str | None = _flag(
        None,
        "pre-tokenized token ids: a Megatron PREFIX(.bin/.idx) or a nanoGPT-style .bin "
        "(default: the Python standard library's sources as bytes)",
        metavar="PATH",
    )
    hf_weights: str | None = _flag(
        None,
        "start from a Hugging Face checkpoint (a save_pretrained directory: config.json + "
        "safetensors of the plan's model) and compute as its family does (RoPE, router)",
        metavar="DIR",
    )
    checkpoint_dir: str | None = _flag(
        None, "save checkpoints (torch.distributed.checkpoint) under D", metavar="D"
    )
    checkpoint_every: int | None = _flag(
        None,
        "checkpoint every N steps and after the last (0 = after the last only; default with "
        "--checkpoint-dir: the plan's interval that minimises lost time, planner/SIZING.md, "
        "or after the last only when the run is no longer; runtime.launch's default: 0)",
        metavar="N",
        launcher_default=0,
    )
    resume: bool = _flag(False, "continue from the newest intact checkpoint in --checkpoint-dir")
    max_restarts: int = _flag(
        0,
        "torchrun restarts of the processes after one fails; each restart resumes from the "
        "newest intact checkpoint (needs --checkpoint-dir)",
        metavar="R",
        cli_only=True,
    )
    force: bool = _flag(
        False,
        "run even if the model or cluster changed since planning, or the processes may "
        "not fit in this machine's memory, or set aside another run's checkpoints in "
        "--checkpoint-dir",
        cli_only=True,
    )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        """The options in a namespace parsed with add_run_arguments' flags (a flag the parser
        did not have keeps its default)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def compute_dtype(self, training: dict) -> str:
        """fp32, bf16 or fp16: --precision, or with `plan` the plan's training dtype."""
        if self.precision != "plan":
            return self.precision
        return PLAN_COMPUTE.get(str(training.get("dtype", "fp32")), "fp32")

    @property
    def out_dir(self) -> Path:
        """Where the run writes its files: --out, else `run` beside the plan."""
        return Path(self.out) if self.out else Path(self.plan).resolve().parent / "run"

    def check(self) -> None:
        """Raise SpecError, naming the flag, for values no run can use."""
        for name in ("steps", "trace_every"):
            if getattr(self, name) < 1:
                raise SpecError(f"{_flag_name(name)} must be >= 1, got {getattr(self, name)}")
        if self.migrate_every < 0 or self.router_bias_rate < 0:
            raise SpecError("--migrate-every and --router-bias-rate must be >= 0")
        for name in ("nproc", "ranks_per_node"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SpecError(
                    f"{_flag_name(name)} must be >= 1, got {value}; leave it out for the default"
                )
        if (self.checkpoint_every or 0) < 0 or self.max_restarts < 0:
            raise SpecError("--checkpoint-every and --max-restarts must be >= 0")
        if (self.checkpoint_every or self.resume or self.max_restarts) and not self.checkpoint_dir:
            raise SpecError(
                "--checkpoint-every, --resume and --max-restarts need --checkpoint-dir D"
            )
        if not self.lr > 0:
            raise SpecError(f"--lr must be a positive learning rate, got {self.lr}")

    def to_launch_argv(self) -> list[str]:
        """`-m runtime.launch --plan ... --steps ...`: torchrun's program and its arguments
        for this run. cli_only flags, options left at None (the launcher applies the same
        defaults; one with a launcher_default is written as that) and switches left off are
        not written."""
        argv = ["-m", LAUNCH_MODULE]
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                value = f.metadata.get("launcher_default")
            if f.metadata.get("cli_only") or value is None or value is False:
                continue
            flag = _flag_name(f.name)
            argv += [flag] if value is True else [flag, str(value)]
        return argv


def add_run_arguments(parser: argparse.ArgumentParser, launcher: bool = False) -> None:
    """Add one argument per RunOptions field to `parser`.

    launcher=False: `piper run`'s arguments (PLAN positional, every flag). launcher=True:
    `python -m runtime.launch`'s (a required --plan, no cli_only flags).
    """
    hints = typing.get_type_hints(RunOptions)
    for f in fields(RunOptions):
        meta = f.metadata
        if launcher and meta.get("cli_only"):
            continue
        if meta.get("positional") and not launcher:
            parser.add_argument(f.name, help=meta["help"])
        elif meta.get("positional"):
            parser.add_argument(_flag_name(f.name), required=True, help=meta["help"])
        else:
            kwargs = _argparse_kwargs(f, hints[f.name], launcher)
            parser.add_argument(_flag_name(f.name), **kwargs)


def _argparse_kwargs(f: Field, hint: Any, launcher: bool = False) -> dict[str, Any]:
    """add_argument's keywords for field `f` of type `hint` (the launcher's default where
    it has its own)."""
    default = f.default
    if launcher and f.metadata.get("launcher_default") is not None:
        default = f.metadata["launcher_default"]
    kwargs: dict[str, Any] = {"default": default, "help": f.metadata.get("help")}
    if hint is bool:
        return {**kwargs, "action": "store_true"}
    if type(None) in typing.get_args(hint):  # `X | None`: the flag takes an X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is Literal:
        kwargs["choices"] = typing.get_args(hint)
    else:  # int, float or str
        kwargs["type"] = hint
    if f.metadata.get("metavar"):
        kwargs["metavar"] = f.metadata["metavar"]
    return kwargs


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


# What a run needs that `pip install -e .` does not bring (pyproject.toml's `runtime` extra,
# torch's CPU build first as the README's test install puts it).
TORCH_INSTALL = "python3 -m pip install torch==2.13.0 && python3 -m pip install -e '.[runtime]'"


def check_torch() -> None:
    """Raise SpecError naming TORCH_INSTALL when this Python cannot import torch (the processes
    a run or a profile starts run this interpreter, sys.executable)."""
    if importlib.util.find_spec("torch") is None:
        raise SpecError(
            f"PyTorch is not installed for {sys.executable}; install it with: {TORCH_INSTALL}"
        )


PR_SET_PDEATHSIG = 1  # linux/prctl.h
TORCHRUN_MODULE = "torch.distributed.run"
TORCHRUN_PID_ENV = "PIPER_TORCHRUN_PID"  # set by run_torchrun for the processes it starts
_TORCHRUN_BOOT = "from planner.run.options import run_torchrun; run_torchrun()"


def die_with_parent(parent_pid: int) -> bool:
    """Have Linux SIGKILL this process when its parent exits, `kill -9` included (prctl
    PR_SET_PDEATHSIG), and end it now if its parent is no longer `parent_pid`: the parent
    exited before the request and the process was re-parented. False where there is no prctl
    (not Linux): the process outlives its parent there."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:
        os._exit(128 + signal.SIGKILL)
    return True


def die_with_torchrun() -> None:
    """In a process torchrun started (TORCHELASTIC_RUN_ID set): die with torchrun, so that none
    trains on after torchrun is killed. The parent checked is TORCHRUN_PID_ENV's pid under
    `piper run` (exact however late this is called), else the current parent, which must not be
    init already. Elsewhere (srun, by hand) nothing changes."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = int(os.environ.get(TORCHRUN_PID_ENV) or os.getppid())
    if parent == 1:
        os._exit(128 + signal.SIGKILL)
    die_with_parent(parent)


def torchrun_command(parent_pid: int) -> list[str]:
    """`python -c ... PARENT_PID torch.distributed.run`: torchrun through run_torchrun, for
    the process `parent_pid` to start (append torchrun's arguments)."""
    return [sys.executable, "-c", _TORCHRUN_BOOT, str(parent_pid), TORCHRUN_MODULE]


# torchrun's own report of a stop it was asked for (its loggers and message templates); the
# launcher that sent the signal reports the stop itself
_STOP_RECEIVED = "Received %s death signal, shutting down workers"
_STOP_NOISE = {_STOP_RECEIVED, "Sending process %s closing signal %s", "Got termination signal: %s"}
_ELASTIC_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _QuietStop(logging.Filter):
    """Drops torchrun's warnings of a stop on SIGTERM or SIGINT, from the first on."""

    stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _STOP_RECEIVED and record.args and record.args[0] in STOP_SIGNALS:
            self.stopping = True
        return not (self.stopping and record.msg in _STOP_NOISE)


def run_torchrun(argv: list[str] | None = None) -> None:
    """torchrun as `piper run` and `piper profile` start it (argv: PARENT_PID MODULE ARGS...,
    default sys.argv[1:]): it dies with PARENT_PID (die_with_parent), hands its pid to its
    processes (TORCHRUN_PID_ENV, for die_with_torchrun), and a stop on SIGTERM or SIGINT ends
    it with 128 + the signal without torchrun's traceback and warnings of the stop."""
    parent, module, *args = sys.argv[1:] if argv is None else argv
    die_with_parent(int(parent))
    os.environ[TORCHRUN_PID_ENV] = str(os.getpid())
    quiet = _QuietStop()
    for name in _ELASTIC_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    sys.argv = [module, *args]
    try:  # torchrun's SignalException, matched by name: the planner does not import torch
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except Exception as exc:
        signum = getattr(exc, "sigval", None)
        if type(exc).__name__ != "SignalException" or signum not in STOP_SIGNALS:
            raise
        sys.exit(128 + int(signum))
