"""`piper cluster init`: a cluster YAML from a few answers about the machine.

The answers are what a data sheet and the system's order form say: the GPU (a model whose
device block a preset under profiles/clusters/ carries, or its figures), GPUs per node, the
scale-up fabric (GB/s per GPU per direction and how many GPUs share it), the NICs (count per
node and Gb/s each, as vendors quote them) and the node count. Everything else the planner
needs (the named efficiencies of `planner.specs.EFFICIENCIES`, latencies, the framework
overhead) is copied from the closest preset and marked `# GUESS: ...` in the file, with what
replaces it (planner/CLUSTERS.md). The text is validated by the cluster loader before it is
returned; a bad answer is a SpecError naming its flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from planner.inputs.clusters import cluster_from_dict, list_cluster_presets, load_cluster
from planner.inputs.yaml_text import load_yaml
from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES, ClusterSpec, SpecError

NIC_LEVEL_KINDS = ("nic",)


@dataclass(frozen=True)
class Answers:
    """The answers as given (text), None where not given. Names are the flags' dests."""

    gpu: str | None = None
    memory_gib: str | None = None
    bf16_tflops: str | None = None
    fp8_tflops: str | None = None
    hbm_gbps: str | None = None
    gpus_per_node: str | None = None
    scale_up_gbps: str | None = None
    scale_up_domain: str | None = None
    nics_per_node: str | None = None
    nic_gbps: str | None = None
    nodes: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Question:
    """One answer: its field of Answers, the question asked on a terminal, integer or not."""

    field: str
    text: str
    integer: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


QUESTIONS: tuple[Question, ...] = (
    Question("gpu", "GPU model, e.g. H100, B200, GB200, MI355X; empty: give its figures"),
    Question("memory_gib", "GPU memory, GiB as the device reports it"),
    Question("bf16_tflops", "dense BF16 peak TFLOPS per GPU, not the sparse figure"),
    Question("fp8_tflops", "dense FP8 peak TFLOPS per GPU; empty: none"),
    Question("hbm_gbps", "HBM bandwidth, GB/s per GPU"),
    Question("gpus_per_node", "GPUs per node", integer=True),
    Question("scale_up_gbps", "scale-up (NVLink / Infinity Fabric) GB/s per GPU per direction"),
    Question(
        "scale_up_domain", "GPUs sharing that fabric: 8 for a node, 72 for NVL72", integer=True
    ),
    Question("nics_per_node", "network NICs per node", integer=True),
    Question("nic_gbps", "Gb/s per NIC as the vendor quotes it, e.g. 400 for NDR"),
    Question("nodes", "nodes in the cluster", integer=True),
    Question("name", "cluster name"),
)
_QUESTION = {q.field: q for q in QUESTIONS}
FIGURES = ("memory_gib", "bf16_tflops", "hbm_gbps")  # the device without --gpu
OPTIONAL = ("fp8_tflops",)


@dataclass(frozen=True)
class InitResult:
    """The YAML text written, the spec it loads as, the preset it borrowed from, and the
    keys marked GUESS."""

    text: str
    cluster: ClusterSpec
    base: str
    guesses: tuple[str, ...]


def gpu_presets() -> list[tuple[str, ClusterSpec]]:
    """The presets under profiles/clusters/ now, by name, each loaded; the CPU emulation
    (topology `emulated`) is no GPU and is left out, and so is a file that does not load
    (`piper plan --cluster` names its fault; it offers no device here)."""
    out = []
    for name in list_cluster_presets():
        try:
            cluster = load_cluster(name)
        except SpecError:
            continue
        if cluster.topology != "emulated":
            out.append((name, cluster))
    return out


def find_gpu(gpu: str) -> str:
    """The preset whose device is `gpu`: its device name or a '-'-separated part of it
    (case-insensitive: H100 is H100-SXM5-80GB, GB200 is B200-GB200). Several: the preset
    named `gpu`, else the one whose name starts with it, else the first by name. None found:
    a SpecError naming --gpu and the known models."""
    want = gpu.strip().lower()
    found = []
    for preset, c in gpu_presets():
        parts = c.device.name.lower().split("-")
        if want and (want in parts or want == "-".join(parts)):
            found.append((preset != want, parts[0] != want, preset))
    if not found:
        known = ", ".join(known_gpus())
        raise SpecError(
            f"--gpu '{gpu}': no preset under profiles/clusters/ has that device (known: "
            f"{known}); give its figures instead: --memory-gib, --bf16-tflops, "
            "--hbm-gbps (and --fp8-tflops)"
        )
    return min(found)[2]


def known_gpus() -> list[str]:
    """The GPU models --gpu accepts: the first part of each GPU preset's device name, and the
    part its preset is named after (GB200 in B200-GB200 of gb200-nvl72)."""
    out = set()
    for preset, c in gpu_presets():
        parts = c.device.name.split("-")
        out.update(p for p in parts if p == parts[0] or p.lower() == preset.split("-")[0])
    return sorted(out)


def closest_preset(memory_gib: float, bf16_tflops: float, hbm_gbps: float) -> str:
    """The GPU preset nearest in log memory, log BF16 peak and log HBM bandwidth."""
    best = []
    for preset, c in gpu_presets():
        d = c.device
        pairs = ((memory_gib, d.memory_gib), (bf16_tflops, d.peak("bf16")),
                 (hbm_gbps, d.hbm_gbps))  # fmt: skip
        best.append((sum(abs(math.log(a / b)) for a, b in pairs), preset))
    return min(best)[1]


def defaults(answers: Answers) -> dict[str, str]:
    """What each answer not given takes: with --gpu, the matched preset's node shape, fabric
    and NICs (marked GUESS in the file); none for the node count and the name."""
    if not answers.gpu:
        return {}
    base = load_cluster(find_gpu(answers.gpu))
    up = base.levels[0]
    return {
        "gpus_per_node": str(base.gpus_per_node),
        "scale_up_gbps": _text(up.bw_gbps),
        "scale_up_domain": str(up.devices),
        "nics_per_node": str(base.nics_per_node),
        "nic_gbps": _text(base.nic_gbps * 8),
    }


def missing(answers: Answers) -> list[Question]:
    """The questions with no answer and no default, in the order asked (the figures only
    without --gpu)."""
    have = defaults(answers)
    out = []
    for q in QUESTIONS:
        if q.field == "gpu" or q.field in OPTIONAL or getattr(answers, q.field) is not None:
            continue
        if q.field in FIGURES and answers.gpu:
            continue
        if q.field not in have:
            out.append(q)
    return out


def describe_cluster(answers: Answers, source: str) -> InitResult:
    """The cluster YAML for `answers` (missing answers take `defaults`), validated by the
    loader with `source` (the file it goes to) in its errors. SpecError naming the flag of a
    bad or missing answer."""
    # an empty answer (Enter on the terminal) is no answer
    answers = Answers(**{f.name: getattr(answers, f.name) or None for f in fields(Answers)})
    given = {f.name: getattr(answers, f.name) for f in fields(Answers)}
    numbers = [q for q in QUESTIONS if q.field not in ("gpu", "name")]
    values = {q.field: _parse(q, given[q.field]) for q in numbers if given[q.field] is not None}
    if answers.name is not None:
        values["name"] = _name(answers.name)
    for q in missing(answers):  # after the answers given: a bad one is named first
        alt = " (or --gpu MODEL)" if q.field in FIGURES else ""
        raise SpecError(f"{q.flag} is missing ({q.text}); pass {q.flag} VALUE{alt}")
    taken = {k: v for k, v in defaults(answers).items() if given[k] is None}
    values.update({k: _parse(_QUESTION[k], v) for k, v in taken.items()})
    base = (
        find_gpu(given["gpu"])
        if given["gpu"]
        else closest_preset(values["memory_gib"], values["bf16_tflops"], values["hbm_gbps"])
    )
    lines, guesses = _yaml_lines(values, given["gpu"], load_cluster(base), base, tuple(taken))
    text = "\n".join(lines) + "\n"
    return InitResult(text, cluster_from_dict(load_yaml(text), source), base, guesses)


def _parse(q: Question, text: str) -> float:
    """One answer as a number > 0 (an integer where the question wants one)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    whole = not q.integer or (math.isfinite(value) and value == int(value))
    if not (math.isfinite(value) and value > 0 and whole) or value > 1e6:
        kind = "a whole number >= 1" if q.integer else "a number > 0"
        raise SpecError(f"{q.flag} must be {kind} ({q.text}), got '{text}'; fix {q.flag}")
    return int(value) if q.integer else value


def _name(text: str) -> str:
    """The cluster name: letters, digits, '-', '_' or '.' (it names files and folders)."""
    name = text.strip()
    if not name or not all(ch.isalnum() or ch in "-_." for ch in name) or name[0] == ".":
        raise SpecError(
            f"--name '{text}': use letters, digits, '-', '_' or '.' (it names the plan "
            "folders); fix --name"
        )
    return name


# What measures or fits each guessed constant (planner/CLUSTERS.md, "Replacing the guesses").
REPLACED_BY = {
    "gemm_efficiency": "piper profile measures it (best GEMM TFLOPS / peak)",
    "grouped_gemm_half_rows": "piper profile's gemm_grouped table, or piper calibrate --fit",
    "attention_efficiency": "piper profile measures it (attention TFLOPS / peak)",
    "hbm_efficiency": "piper profile measures it (permute + unpermute GB/s / hbm_gbps)",
    "layer_overhead_us": "piper calibrate --fit on a few training runs",
    "scale_up_efficiency": "all-reduce bus bandwidth inside a node / scale-up GB/s",
    "scale_out_efficiency": "all-reduce bus bandwidth across nodes / NIC GB/s per GPU",
    "overlap_efficiency": "piper calibrate --fit on a few training runs",
    "network_jitter_us": "piper calibrate --fit --params network_jitter_us",
    "framework_overhead_gib": "piper calibrate (measured minus predicted peak memory)",
    "msg_overhead_us": "nccl-tests alltoall_perf time at small messages",
}


def _yaml_lines(
    v: dict, gpu: str | None, base: ClusterSpec, base_name: str, taken: tuple[str, ...]
) -> tuple[list[str], tuple[str, ...]]:
    """The file's lines (keys in the presets' order, each guessed value marked) and the
    guessed keys."""
    gpn = v["gpus_per_node"]
    if v["scale_up_domain"] % gpn:
        raise SpecError(
            f"--scale-up-domain {v['scale_up_domain']} must be a multiple of --gpus-per-node "
            f"{gpn} (all GPUs of a node share the fabric; 72 for NVL72 over 4-GPU trays); fix "
            "--scale-up-domain"
        )
    guesses: list[str] = list(taken)
    told = {k: f"  # GUESS: not given; {base_name}'s" for k in taken}
    topology = "fat-tree" if v["scale_up_domain"] == gpn else f"nvl{v['scale_up_domain']}"
    lines = [
        f"# {v['name']}: {v['nodes']} nodes x {gpn} GPUs, written by `piper cluster init`.",
        f"# GUESS marks a value nobody measured here (copied from the {base_name} preset);",
        "# planner/CLUSTERS.md says how `piper profile` and an NCCL/RCCL figure replace them.",
        f"name: {v['name']}",
        f"topology: {topology}",
        f'source: "piper cluster init; constants from the {base_name} preset"',
        *_device_lines(v, gpu, base, base_name),
        f"gpus_per_node: {gpn}{told.get('gpus_per_node', '')}",
        f"num_nodes: {v['nodes']}",
        f"nics_per_node: {v['nics_per_node']}{told.get('nics_per_node', '')}",
        f"nic_gbps: {_text(v['nic_gbps'] / 8)}"
        + (told.get("nic_gbps") or f"  # {_text(v['nic_gbps'])} Gb/s / 8 = GB/s per direction"),
    ]
    named = [e.name for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES)]
    for key in ("framework_overhead_gib", "msg_overhead_us", *named):
        lines.append(f"{key}: {_text(getattr(base, key))}  # GUESS: {base_name}'s; "
                     f"{REPLACED_BY[key]}")  # fmt: skip
        guesses.append(key)
    if base.cuda_graphs:
        lines.append(f"cuda_graphs: true  # GUESS: {base_name}'s")
        guesses.append("cuda_graphs")
    lines += _level_lines(v, base, base_name, told, guesses, gpu is None)
    return lines, tuple(guesses)


def _device_lines(v: dict, gpu: str | None, base: ClusterSpec, base_name: str) -> list[str]:
    """The device block: the matched preset's (its data-sheet figures), or the figures given;
    a figure given overrides the preset's."""
    d = base.device
    peak = dict(d.peak_tflops) if gpu else {}
    own = f"  # the {base_name} preset's device (its data sheet)" if gpu else ""
    given = {"bf16": v.get("bf16_tflops"), "fp8": v.get("fp8_tflops")}
    peak.update({k: x for k, x in given.items() if x})
    memory = v.get("memory_gib") or d.memory_gib
    hbm = v.get("hbm_gbps") or d.hbm_gbps
    lines = [
        "device:",
        f"  name: {d.name if gpu else v['name'] + '-gpu'}{own}",
        f"  memory_gib: {_text(memory)}" + ("  # --memory-gib" if v.get("memory_gib") else own),
        "  peak_tflops:",
        *(f"    {k}: {_text(x)}" + (f"  # --{k}-tflops" if given.get(k) else own)
          for k, x in peak.items()),
        f"  hbm_gbps: {_text(hbm)}" + ("  # --hbm-gbps" if v.get("hbm_gbps") else own),
    ]  # fmt: skip
    if gpu and d.sms:
        lines.append(f"  sms: {d.sms}{own}")
    return lines


def _level_lines(
    v: dict, base: ClusterSpec, base_name: str, told: dict, guesses: list, fabric_guessed: bool
) -> list[str]:
    """The scale-up level and, when the system is larger, one network level of all GPUs."""
    gpn, total = v["gpus_per_node"], v["gpus_per_node"] * v["nodes"]
    domain = min(v["scale_up_domain"], total)
    up, out = base.levels[0], base.levels[-1]
    kind = "nvlink" if up.kind in NIC_LEVEL_KINDS or not up.kind else up.kind
    net_gbps = v["nics_per_node"] * v["nic_gbps"] / 8 / gpn
    guesses += ["levels[0].latency_us"] + (["levels[0].kind"] if fabric_guessed else [])
    lines = [
        "levels:",
        f"  - name: {'node' if domain == gpn else 'scale-up'}",
        f"    devices: {domain}" + (told.get("scale_up_domain") or ""),
        f"    bw_gbps: {_text(v['scale_up_gbps'])}"
        + (told.get("scale_up_gbps") or "  # --scale-up-gbps, per GPU per direction"),
        f"    latency_us: {_text(up.latency_us)}  # GUESS: {base_name}'s; nccl-tests "
        "all_reduce_perf time at 8 B inside the domain",
        "    taper: 1.0",
        f"    kind: {kind}" + (f"  # GUESS: {base_name}'s fabric" if fabric_guessed else ""),
    ]
    if domain == total:
        return lines
    guesses += ["levels[1].latency_us", "levels[1].taper"]
    return lines + [
        "  - name: network",
        f"    devices: {total}",
        f"    bw_gbps: {_text(net_gbps)}  # {v['nics_per_node']} NICs x "
        f"{_text(v['nic_gbps'] / 8)} GB/s / {gpn} GPUs per node",
        f"    latency_us: {_text(out.latency_us)}  # GUESS: {base_name}'s outermost level; "
        "nccl-tests all_reduce_perf time at 8 B across nodes",
        "    taper: 1.0  # GUESS: a non-blocking fat tree; oversubscribed: add a level with "
        "taper < 1",
        "    kind: nic",
    ]


def _text(x: float) -> str:
    """A number as YAML reads it back: integers bare, others in plain decimals."""
    if float(x) == int(x):
        return str(int(x))
    return f"{x:.6f}".rstrip("0").rstrip(".")


def next_steps(result: InitResult, out: str) -> list[str]:
    """What `piper cluster init` prints after writing `out`: what was written and the
    commands that replace its guesses (each line within 100 columns)."""
    c = result.cluster
    stem = out.removesuffix(".yaml").removesuffix(".yml")
    up = c.levels[0].bw_gbps
    net = (
        c.levels[-1].bw_gbps
        if len(c.levels) > 1
        else c.nic_gbps * c.nics_per_node / c.gpus_per_node
    )
    return [
        f"wrote {out}: {c.num_nodes} nodes x {c.gpus_per_node} {c.device.name} "
        f"({c.total_gpus:,} GPUs)",
        f"  {len(result.guesses)} values marked GUESS (copied from the {result.base} preset)",
        "next:",
        f"  plan:     piper plan --cluster {out} --model M  (--gpus defaults to its "
        f"{c.total_gpus:,} GPUs)",
        f"  measure:  on one node: piper profile --nproc {c.gpus_per_node} --base {out} --model M",
        f"              --out {stem}-measured.yaml  (GEMM, attention and HBM efficiencies and "
        "hbm_gbps",
        "              measured; plan with that file)",
        "  network:  nccl-tests / rccl-tests bus bandwidth at large messages, measured or "
        "published:",
        f"              scale_up_efficiency = all_reduce busbw inside a node / {_text(up)} GB/s",
        "              scale_out_efficiency = all_to_all (else all_reduce) busbw across nodes / "
        f"{_text(net)} GB/s",
        f"              (edit both in {out})",
        f"  fit:      after a few runs: piper calibrate --fit --log PLAN:LOG ... --cluster {out}",
        f"              --out {stem}-fitted.yaml",
        "  details:  planner/CLUSTERS.md",
    ]


def is_cluster_file(name_or_path: str) -> bool:
    """Whether `--cluster` names a YAML file (a user's machine) rather than a preset, as
    planner.inputs.clusters.load_cluster tells them apart."""
    path = Path(name_or_path)
    return path.suffix in (".yaml", ".yml") or path.exists()
