"""The layouts teams publish for a model: profiles/runs/published_runs.csv as recipes.

A recipe is one published run's layout (tp, pp, vp, cp, ep, etp, micro-batch, recompute,
dispatcher, all-to-all overlap) with where it was published. `recipes_for(model, device,
dtype)` lists a model's recipes, the closest first: on the plan's hardware, in its precision,
then the fastest measured. `recipe_layout(recipe, gpus, global_batch)` keeps every size of
the recipe but dp, which fills the plan's GPUs (None where the recipe cannot run there).

`published_for(model, hardware_names, gpus, dtype, seq_len, global_batch)` lists the
measurements of the plan's own setting in RECIPES_CSV and HOLDOUT_CSV: the same model, the
hardware family (the row's `hardware` in the cluster's device or cluster name), GPU count,
precision, sequence length and global batch; `piper plan` prints them beside its prediction.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache

from planner.inputs.paths import PROFILES_DIR
from planner.parallel import RECOMPUTE_MODULES, ParallelConfig
from planner.specs import SpecError

RECIPES_CSV = PROFILES_DIR / "runs" / "published_runs.csv"
HOLDOUT_CSV = PROFILES_DIR / "runs" / "holdout_runs.csv"
SHORT_MODULES = {"norm": "layernorm", "act": "moe_act"}  # Megatron-Core's short forms
PRECISIONS = {"BF16": "bf16", "FP16": "fp16", "FP8": "fp8", "MXFP8": "mxfp8",
              "FP8-BLOCKWISE": "fp8_blockwise", "NVFP4": "nvfp4", "MXFP4": "mxfp4"}  # fmt: skip
SIZES = ("gpus", "mbs", "tp", "pp", "vp", "cp", "ep", "etp")


@dataclass(frozen=True)
class Recipe:
    """One published layout; `source` is the project that published it (Megatron-Bridge,
    Megatron-MoE-ModelZoo), `row_id` its id in RECIPES_CSV."""

    source: str
    row_id: str
    model: str
    hardware: str  # e.g. H100, GB200
    gpus: int
    dtype: str  # bf16, fp8, mxfp8
    tp: int
    pp: int
    vp: int
    cp: int
    ep: int
    etp: int
    micro_batch: int
    recompute: str  # none, full, selective
    recompute_modules: tuple[str, ...]
    dispatcher: str
    a2a_overlap: bool
    tokens_per_s_per_gpu: float

    @property
    def where(self) -> str:
        """E.g. "Megatron-Bridge, 64 H100s, bf16"."""
        return f"{self.source}, {self.gpus} {self.hardware}s, {self.dtype}"


def recipes_for(model: str, device: str, dtype: str) -> tuple[Recipe, ...]:
    """The model's recipes (its name with or without "-nomtp"), closest first: on `device`'s
    hardware, in `dtype`, then the fastest measured tokens/s per GPU."""
    base = model.removesuffix("-nomtp")
    mine = [r for r in _recipes() if r.model.removesuffix("-nomtp") == base]
    device = device.upper()

    def key(r: Recipe) -> tuple:
        return (r.hardware.upper() not in device, r.dtype != dtype, -r.tokens_per_s_per_gpu)

    return tuple(sorted(mine, key=key))


def recipe_layout(recipe: Recipe, gpus: int, global_batch: int) -> ParallelConfig | None:
    """The recipe's layout on `gpus` devices: its sizes, dp = gpus / (tp pp cp); the
    micro-batch reduced to 1 when the batch does not divide; None where no layout remains
    (the GPUs or the batch do not divide, the expert mesh does not fold)."""
    dense = recipe.tp * recipe.pp * recipe.cp
    if gpus % dense:
        return None
    dp = gpus // dense
    for mb in dict.fromkeys((recipe.micro_batch, 1)):
        if global_batch % (mb * dp):
            continue
        try:
            return ParallelConfig(
                pp=recipe.pp, dp=dp, tp=recipe.tp, ep=recipe.ep, micro_batch=mb,
                num_microbatches=global_batch // (mb * dp), recompute=recipe.recompute,  # type: ignore[arg-type]
                vp=recipe.vp, cp=recipe.cp, etp=recipe.etp,
                recompute_modules=recipe.recompute_modules,  # type: ignore[arg-type]
            )  # fmt: skip
        except SpecError:
            continue
    return None


@dataclass(frozen=True)
class Published:
    """One published measurement of a setting: its row as a recipe, the release it names
    (e.g. "25.11", "" where the source names none), the file and the row's fields as read
    (planner.calibrate.runs.run_of prices them)."""

    recipe: Recipe
    release: str
    seq_len: int
    global_batch: int
    file: str  # published_runs.csv or holdout_runs.csv
    fields: tuple[tuple[str, str], ...]


def published_for(
    model: str,
    hardware_names: tuple[str, ...],
    gpus: int,
    dtype: str,
    seq_len: int,
    global_batch: int,
) -> tuple[Published, ...]:
    """The measurements of exactly this setting (module docstring), fastest measured first;
    `hardware_names` are the cluster's device and profile names (a row matches when its
    `hardware` is part of one, case-insensitive)."""
    names = tuple(n.upper() for n in hardware_names)
    found = [
        p for p in _published()
        if p.recipe.model == model and p.recipe.gpus == gpus and p.recipe.dtype == dtype
        and p.seq_len == seq_len and p.global_batch == global_batch
        and p.recipe.hardware and any(p.recipe.hardware.upper() in n for n in names)
        and p.recipe.tokens_per_s_per_gpu > 0
    ]  # fmt: skip
    return tuple(sorted(found, key=lambda p: (-p.recipe.tokens_per_s_per_gpu, p.recipe.row_id)))


@cache
def _recipes() -> tuple[Recipe, ...]:
    """Every row of RECIPES_CSV that reads as a recipe (a row that does not is skipped: the
    file is project data, checked by planner.calibrate.runs)."""
    return tuple(p.recipe for p in _published() if p.file == RECIPES_CSV.name)


@cache
def _published() -> tuple[Published, ...]:
    """Every row of RECIPES_CSV and HOLDOUT_CSV that reads as a recipe (tokens/s per GPU 0
    where the row gives TFLOPS only)."""
    out = []
    for path in (RECIPES_CSV, HOLDOUT_CSV):
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        for row in rows:
            try:
                recipe = _recipe(row)
                seq, gbs = int(row["seq"]), int(row["gbs"])
            except (KeyError, ValueError):
                continue
            release = row.get("source", "").partition("[")[2].partition("]")[0]
            fields = tuple((k, v or "") for k, v in row.items() if k is not None)
            out.append(Published(recipe, release.split(",")[0].strip(), seq, gbs, path.name,
                                 fields))  # fmt: skip
    return tuple(out)


def _recipe(row: dict[str, str]) -> Recipe:
    size = {k: int(row[k]) for k in SIZES}
    policy, modules = _recompute(row["recompute"].strip())
    project = row["source"].split()[0].split("/")[-1]  # "NVIDIA-NeMo/Megatron-Bridge docs/..."
    return Recipe(
        source=project, row_id=row["id"], model=row["model"], hardware=row["hardware"],
        gpus=size["gpus"], dtype=PRECISIONS[row["precision"].upper()], tp=size["tp"],
        pp=size["pp"], vp=size["vp"], cp=size["cp"], ep=size["ep"], etp=size["etp"],
        micro_batch=size["mbs"], recompute=policy, recompute_modules=modules,
        dispatcher=row.get("dispatcher") or "flat", a2a_overlap=row.get("a2a_overlap") == "1",
        tokens_per_s_per_gpu=float(row.get("measured_tokens_per_s_per_gpu") or 0.0),
    )  # fmt: skip


def _recompute(text: str) -> tuple[str, tuple[str, ...]]:
    """ "selective(norm,act)" -> ("selective", ("layernorm", "moe_act")); none / full as is."""
    if text in ("none", "full", "selective"):
        return text, ()
    inner = text.removeprefix("selective(").removesuffix(")")
    names = tuple(SHORT_MODULES.get(n.strip(), n.strip()) for n in inner.split(","))
    if not text.startswith("selective(") or any(n not in RECOMPUTE_MODULES for n in names):
        raise ValueError(text)
    return "selective", names
