"""Training logs of Megatron-LM and torchtitan read back: per-iteration time, throughput, memory.

Each parser matches the engine's own format strings (cited below) and returns a `ParsedLog`:
the layout the log prints about itself, one `LogStep` per logged line (the last iteration it
covers and how many iterations it averages over) and the peak memory. A log that cannot be
trusted is one SpecError line naming the file, the line and the fix: an out-of-memory error
or any Python traceback (the run failed), a NaN loss or a non-zero NaN-iteration count, an
iteration line cut short (the log is truncated), no iteration line at all, or a number no run
prints (an iteration or step above MAX_ITERATION, a parallel size above MAX_PARALLEL, a time,
throughput or memory that is infinite or above MAX_MEASURE: the log was edited or corrupted).
Reading is bounded: a log is a regular file of at most MAX_LOG_BYTES, its lines are matched cut
to MAX_LINE_CHARS, and every pattern runs in time linear in the line.

Megatron-LM, github:NVIDIA/Megatron-LM at d98e8a64ddf34856e74b24714e3bedb2f5a39553:
- megatron/training/arguments.py:1990-2001 `_print_args`: between
  `------------------------ arguments ------------------------` and
  `-------------------- end of arguments ---------------------`, one line per argument,
  `'  {} {} {}'.format(arg, '.' * (48 - len(arg)), value)`;
- megatron/training/training.py:3567-3641 `training_log`: ` iteration {:8d}/{:8d} |`,
  ` elapsed time per iteration (ms): {:.1f} |` (the average over the log interval),
  ` throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |` (with --log-throughput),
  ` global batch size: {batch_size:5d} |`, ` {key}: {avg:.6E} |` per loss (printed only when
  avg >= 0, so a NaN loss is absent), ` number of nan iterations: {:3d} |` last;
- megatron/training/utils/common_utils.py:313-333 `report_memory`:
  `[Rank {}] (after {iteration} iterations) memory (MB) | allocated: {:.2f} | max allocated:
  {:.2f} | reserved: ... | max reserved: ...` (MB = 2**20 bytes; max allocated is
  torch.cuda.max_memory_allocated, never reset, so its largest value is the run's peak).

torchtitan 0.3.0 (the pinned version; the wheel's files, which match github:pytorch/torchtitan
at b5bcd76c66d0acb1a08b176d9639425bc55e0b2a for these strings):
- torchtitan/components/metrics.py:523-532 (head: 522-531) `MetricsProcessor.log`:
  `step: {step:2}  loss: {loss:8.5f}  grad_norm: {grad_norm:7.4f}  memory:
  {max_reserved_gib:5.2f}GiB({max_reserved_pct:.2f}%)  tps: {round(tps):,}  tflops:
  {tflops:,.2f}  mfu: {mfu:.2f}%` (mfu `N/A` under FP8/MX), each field behind an ANSI colour
  code (torchtitan/tools/utils.py:263 `Color`); tps is tokens per second per device (tokens
  since the last log / (seconds x cp x tp x pp), metrics.py:477-479), memory the peak reserved
  since the last log (reset after every log line);
- metrics.py:80-82 `get_peak_stats`: `{num_ooms} CUDA OOM errors thrown.`;
- torchtitan/distributed/parallel_dims.py:271-275 (head: 274-278): `Building device mesh with
  parallelism: pp={pp}, dp_replicate={dp_replicate}, dp_shard={dp_shard}, cp={cp}, tp={tp},
  ep={ep}`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from planner.inputs.safe_read import read_input_bytes
from planner.specs import SpecError

ANSI = re.compile(r"\x1b\[[0-9;]*m")
MEGATRON_ARGS_START = "------------------------ arguments ------------------------"
MEGATRON_ARGS_END = "-------------------- end of arguments ---------------------"
# Every pattern runs in time linear in the line: possessive quantifiers (++, *+) where a run
# of spaces or digits could be split two ways, no pattern that scans the rest of the line
# from each of many starts, and lines cut to MAX_LINE_CHARS.
MEGATRON_ARG = re.compile(r"(?:\S++\s++)?([a-z][a-z0-9_]*+) \.++ (.*)")  # on a stripped line
MEGATRON_ITER = re.compile(r" iteration\s++(\d++)/\s*+(\d++) \|")
MEGATRON_MEMORY_AT = "memory (MB) | allocated: "
MEGATRON_MEMORY = re.compile(
    r"\[Rank (\d++)\] [^|]*memory \(MB\) \| allocated: ([\d.]++) \| max allocated: ([\d.]++)"
)  # matched at the last '[Rank ' before MEGATRON_MEMORY_AT
MEGATRON_LAST_FIELD = "number of nan iterations"
# Megatron's argument name -> the plan's name (None in the log: the default given here)
MEGATRON_LAYOUT = {
    "tensor_model_parallel_size": ("tp", None),
    "pipeline_model_parallel_size": ("pp", None),
    "virtual_pipeline_model_parallel_size": ("vp", 1),
    "context_parallel_size": ("cp", None),
    "expert_model_parallel_size": ("ep", None),
    "expert_tensor_parallel_size": ("etp", None),
    "data_parallel_size": ("dp", None),
    "world_size": ("world", None),
    "micro_batch_size": ("micro_batch", None),
    "global_batch_size": ("global_batch", None),
    "seq_length": ("seq_len", None),
}
TITAN_STEP_START = re.compile(r"(?<!validate )step:\s*+(\d++)\s++loss:")
TITAN_STEP = re.compile(
    r"(?<!validate )step:\s*+(\d++)\s++loss:\s*+(\S++)\s++grad_norm:\s*+(\S++)\s++memory:"
    r"\s*+([\d.]++)GiB\(([\d.]++)%\)\s++tps:\s*+([\d,]++)\s++tflops:\s*+([\d,.]++)\s++mfu:"
    r"\s*+(N/A|[\d.]++%)"
)
TITAN_MESH = re.compile(
    r"Building device mesh with parallelism: pp=(\d+), dp_replicate=(\d+), dp_shard=(\d+), "
    r"cp=(\d+), tp=(\d+), ep=(\d+)"
)
TITAN_OOMS = re.compile(r"(?<!\d)(\d++) \w++ OOM errors thrown")
OOM = re.compile(r"OutOfMemoryError|out of memory", re.IGNORECASE)
MIB_PER_GIB = 1024.0
MAX_ITERATION = 10**18 - 1  # 18 digits: fits int64; no run logs that many iterations
MAX_PARALLEL = 1 << 24  # a parallel size or world; plan.json holds none above it
MAX_MEASURE = 1e30  # times, throughputs, memory: far above any run, keeps their sums finite
MAX_LOG_BYTES = 2**30  # a log read whole: 2 million iteration lines of Megatron-LM's ~500 bytes
MAX_LINE_CHARS = 2**14  # of a line matched: an iteration line is ~500, an argument shorter


@dataclass(frozen=True)
class LogStep:
    """One logged line: the last iteration it covers and the iterations it averages over."""

    iteration: int
    window: int
    line: int  # 1-based line of the log
    step_time_s: float | None  # Megatron: elapsed time per iteration
    tokens_per_s_per_gpu: float | None  # torchtitan: tps
    tflops_per_gpu: float | None
    peak_gib: float | None  # torchtitan: peak reserved since the last log line

    @property
    def first(self) -> int:
        """The first iteration the line's figures cover."""
        return self.iteration - self.window + 1


@dataclass(frozen=True)
class ParsedLog:
    """A training log: its engine, the layout it prints, its logged lines and peak memory."""

    engine: str  # "megatron" | "torchtitan"
    source: str
    layout: tuple[tuple[str, int], ...]  # (plan name, value) as the log prints them
    steps: tuple[LogStep, ...]
    peak_gib: float | None  # Megatron: the largest max allocated over the memory reports


def read_log(path: str | Path) -> str:
    """The log's text; SpecError for a missing file, one that is not a regular file (a FIFO,
    a device: planner/inputs/safe_read.py) or one over MAX_LOG_BYTES."""
    p = Path(path)
    if not p.exists():
        raise SpecError(f"{p}: no such log; give the training log the run wrote")
    return read_input_bytes(p, "log", MAX_LOG_BYTES).decode("utf-8", errors="replace")


def _lines(text: str) -> list[str]:
    """The log's lines, each cut to MAX_LINE_CHARS (no line the parsers read is longer)."""
    return [line[:MAX_LINE_CHARS] for line in text.splitlines()]


def _field(part: str) -> tuple[str, str] | None:
    """(key, value) of one ' key: value ' field of a Megatron iteration line, else None: the
    key runs to the first ':', which a space must follow."""
    head, colon, rest = part.partition(":")
    key = head.lstrip()
    if not (colon and key and rest.startswith(" ")):
        return None
    return key, rest[1:].rstrip()


def _memory(line: str) -> re.Match[str] | None:
    at = line.find(MEGATRON_MEMORY_AT)
    start = line.rfind("[Rank ", 0, at) if at >= 0 else -1
    return MEGATRON_MEMORY.match(line, start) if start >= 0 else None


def log_engine(text: str) -> str | None:
    """The log's engine: megatron, torchtitan, metrics (piper run's metrics.jsonl) or None."""
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if first.lstrip().startswith("{"):
        return "metrics"
    if MEGATRON_ARGS_START in text or "elapsed time per iteration (ms)" in text:
        return "megatron"
    clean = ANSI.sub("", text)
    if TITAN_STEP_START.search(clean) or "Building device mesh with parallelism" in clean:
        return "torchtitan"
    return None


def parse_log(text: str, source: str) -> ParsedLog:
    """A Megatron-LM or torchtitan log as a ParsedLog; SpecError for a failed or cut run."""
    engine = log_engine(text)
    if engine == "megatron":
        return parse_megatron(text, source)
    if engine == "torchtitan":
        return parse_torchtitan(text, source)
    raise SpecError(
        f"{source}: neither a Megatron-LM log ('elapsed time per iteration (ms)'), a "
        "torchtitan log ('step: N  loss: ...') nor piper run's metrics.jsonl; give the "
        "training log the run printed"
    )


def _check_failure(lines: list[str], source: str) -> None:
    """A run that ran out of memory or raised is refused (its timings are not a run's)."""
    for n, line in enumerate(lines, start=1):
        if OOM.search(line):
            raise SpecError(
                f"{source} line {n}: the run ran out of memory ({line.strip()[:80]}); a "
                "failed run measures nothing: fit on runs that completed (re-plan with a "
                "larger --memory-margin)"
            )
        oom = TITAN_OOMS.search(line)
        if oom and oom.group(1).strip("0"):  # a count above 0, read without int()
            raise SpecError(
                f"{source} line {n}: the run reports {oom.group(1)} out-of-memory errors; "
                "fit on runs that completed without them"
            )
        if line.lstrip().startswith("Traceback (most recent call last)"):
            raise SpecError(
                f"{source} line {n}: the run raised an exception (a Python traceback); fit "
                "on runs that completed"
            )


def _nan_loss(source: str, n: int, what: str) -> SpecError:
    return SpecError(
        f"{source} line {n}: {what}; a diverged run's timings are not a training run's: fit "
        "on runs whose loss stays finite (lower the learning rate)"
    )


def _truncated(source: str, n: int, line: str) -> SpecError:
    if len(line) >= MAX_LINE_CHARS:
        return SpecError(
            f"{source} line {n}: longer than {MAX_LINE_CHARS:,} characters, not an iteration "
            "line as the engine prints it (edited or corrupt): fix or cut it"
        )
    return SpecError(
        f"{source} line {n}: an iteration line cut short; the log is truncated: give the "
        f"complete log, or cut it before line {n}"
    )


def parse_megatron(text: str, source: str) -> ParsedLog:
    """Megatron-LM's stdout (the module docstring's format strings)."""
    lines = _lines(text)
    _check_failure(lines, source)
    args = _megatron_args(lines)
    steps: list[LogStep] = []
    peak: float | None = None
    interval = _int_or_none(args.get("log_interval"))
    for n, line in enumerate(lines, start=1):
        mem = _memory(line)
        if mem:
            peak = max(peak or 0.0, _measure(mem.group(3), source, n) / MIB_PER_GIB)
            continue
        head = MEGATRON_ITER.search(line)
        if not head:
            continue
        fields = dict(f for part in line[head.end() :].split("|") if (f := _field(part)))
        if MEGATRON_LAST_FIELD not in fields or "elapsed time per iteration (ms)" not in fields:
            raise _truncated(source, n, line)
        if _float(fields[MEGATRON_LAST_FIELD], source, n) > 0:
            raise _nan_loss(source, n, f"{fields[MEGATRON_LAST_FIELD]} NaN iterations")
        for key, value in fields.items():
            if key.endswith("loss") and not math.isfinite(_float(value, source, n)):
                raise _nan_loss(source, n, f"{key} is {value}")
        iteration = _count(head.group(1), source, n, "iteration")
        previous = steps[-1].iteration if steps else 0
        window = interval or max(iteration - previous, 1)
        tflops = fields.get("throughput per GPU (TFLOP/s/GPU)")
        steps.append(LogStep(
            iteration, min(window, iteration), n,
            _measure(fields["elapsed time per iteration (ms)"], source, n) / 1e3, None,
            None if tflops is None else _measure(tflops, source, n), None,
        ))  # fmt: skip
    if not steps:
        raise SpecError(
            f"{source}: no 'iteration N/M | ... elapsed time per iteration (ms)' line; the run "
            "logged no iteration (truncated or failed before training): give a complete log"
        )
    layout = []
    for arg, (name, default) in MEGATRON_LAYOUT.items():
        if arg in args:
            value = _int_or_none(args[arg])
            value = default if value is None else value
            if value is not None and not 0 <= value <= MAX_ITERATION:
                raise SpecError(
                    f"{source}: argument {arg} is {str(value)[:24]}, outside [0, "
                    f"{MAX_ITERATION}]; the arguments block is not as Megatron-LM prints it "
                    "(edited or corrupt): fix it"
                )
            if value is not None:
                layout.append((name, value))
    return ParsedLog("megatron", source, tuple(layout), tuple(steps), peak)


def _megatron_args(lines: list[str]) -> dict[str, str]:
    """The arguments block Megatron prints at start-up (empty when the log has none)."""
    args: dict[str, str] = {}
    inside = False
    for line in lines:
        if MEGATRON_ARGS_START in line:
            inside = True
        elif MEGATRON_ARGS_END in line:
            break
        elif inside and (m := MEGATRON_ARG.fullmatch(line.strip())):
            args[m.group(1)] = m.group(2)
    return args


def parse_torchtitan(text: str, source: str) -> ParsedLog:
    """torchtitan's stdout (the module docstring's format strings), ANSI colours removed."""
    lines = [ANSI.sub("", line) for line in _lines(text)]
    _check_failure(lines, source)
    steps: list[LogStep] = []
    layout: tuple[tuple[str, int], ...] = ()
    for n, line in enumerate(lines, start=1):
        mesh = TITAN_MESH.search(line)
        if mesh:
            names = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
            sizes = [
                _count(x, source, n, name, MAX_PARALLEL)
                for name, x in zip(names, mesh.groups(), strict=True)
            ]
            pp, rep, shard, cp, tp, ep = sizes
            if pp * rep * shard * cp * tp > MAX_PARALLEL:
                raise SpecError(
                    f"{source} line {n}: the device mesh holds {pp * rep * shard * cp * tp} "
                    f"ranks, above {MAX_PARALLEL}; the line is not as torchtitan prints it "
                    "(edited or corrupt): fix or cut it"
                )
            layout = (("pp", pp), ("dp", rep * shard), ("cp", cp), ("tp", tp), ("ep", ep),
                      ("world", pp * rep * shard * cp * tp))  # fmt: skip
            continue
        if not TITAN_STEP_START.search(line):
            continue
        m = TITAN_STEP.search(line)
        if not m:
            raise _truncated(source, n, line)
        step, loss, _, mem_gib, _, tps, tflops, _ = m.groups()
        if not math.isfinite(_float(loss, source, n)):
            raise _nan_loss(source, n, f"loss is {loss}")
        iteration = _count(step, source, n, "step")
        previous = steps[-1].iteration if steps else 0
        steps.append(LogStep(
            iteration, max(iteration - previous, 1), n, None,
            _measure(tps, source, n), _measure(tflops, source, n), _measure(mem_gib, source, n),
        ))  # fmt: skip
    if not steps:
        raise SpecError(
            f"{source}: no 'step: N  loss: ...  tps: ...' line; the run logged no step "
            "(truncated or failed before training): give a complete log"
        )
    return ParsedLog("torchtitan", source, layout, tuple(steps), None)


def after_warmup(log: ParsedLog, warmup: int) -> tuple[LogStep, ...]:
    """The lines whose whole window lies after the first `warmup` iterations; SpecError when
    none does (the run is shorter than its warm-up)."""
    kept = tuple(s for s in log.steps if s.first > warmup)
    if not kept:
        last = log.steps[-1]
        raise SpecError(
            f"{log.source}: the last logged line covers iterations {last.first}-"
            f"{last.iteration}, none after the {warmup} warm-up iteration(s) (--skip-steps); "
            "run more iterations or lower --skip-steps"
        )
    return kept


def _float(text: str, source: str, line: int) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        raise SpecError(
            f"{source} line {line}: {text.strip()[:30]!r} is not a number; the line is not "
            "as the engine prints it (truncated or edited)"
        ) from None


def _measure(text: str, source: str, line: int) -> float:
    """A time, throughput or memory figure: finite, >= 0 and at most MAX_MEASURE."""
    value = _float(text, source, line)
    if not 0 <= value <= MAX_MEASURE:  # NaN fails too
        raise SpecError(
            f"{source} line {line}: {text.strip()[:30]!r} is not a number in [0, "
            f"{MAX_MEASURE:g}]; the line is not as the engine prints it (edited or corrupt): "
            "fix or cut it"
        )
    return value


def _count(text: str, source: str, line: int, what: str, maximum: int = MAX_ITERATION) -> int:
    """An iteration, step or parallel size printed as digits: at most `maximum`, refused
    before int() meets a number of thousands of digits."""
    if len(text) > len(str(maximum)) or int(text) > maximum:
        shown = text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"
        raise SpecError(
            f"{source} line {line}: {what} {shown} is above {maximum}; no run counts that "
            "far, the line is not as the engine prints it (edited or corrupt): fix or cut it"
        )
    return int(text)


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(str(text))
    except ValueError:
        return None
