"""Input types crossing every planner boundary: the model, the cluster and the training setup.

These are plain frozen dataclasses. Parsing (HF config.json, cluster YAML) lives in
`planner.inputs.models` and `planner.inputs.clusters`; this module holds only the types and their
invariants, so every other module can depend on it without pulling in I/O.

Shape letters used in names: L = transformer layers, E = routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

AttentionKind = Literal["mha", "gqa", "mla"]
LayerKind = Literal["dense", "moe"]
Recompute = Literal["none", "selective", "full"]
# Training precisions: fp8 = per-tensor current scaling, fp8_blockwise = 1 x 128 / 128 x 128
# block scaling, mxfp8 / mxfp4 / nvfp4 the block-scaled Blackwell (and CDNA4) formats
# (planner.resources.precision)
Dtype = Literal["bf16", "fp16", "fp8", "fp8_blockwise", "mxfp8", "nvfp4", "mxfp4", "fp32"]
# The cluster's `peak_tflops` key of a dtype whose GEMMs run at another format's rate: block
# scaling changes the scales, not the Tensor Core format (FP8 E4M3)
PEAK_KEYS = {"fp8_blockwise": "fp8"}
OptimizerDtype = Literal["fp32", "bf16"]

GIB = 2**30


class SpecError(ValueError):
    """A user input is invalid. The message names the input, the field and the fix."""


def peak_key(dtype: str) -> str:
    """The `peak_tflops` key whose rate `dtype`'s GEMMs run at."""
    return PEAK_KEYS.get(dtype, dtype)


@dataclass(frozen=True)
class AttentionSpec:
    """One attention block. For MLA the low-rank fields are set and num_kv_heads == num_heads."""

    kind: AttentionKind
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False  # q/k/v (and o when o_bias) projection biases (Qwen2, GPT-OSS)
    o_bias: bool = False
    sinks: bool = False  # per-head attention-sink logits (GPT-OSS)
    sliding_window: int | None = None  # tokens attended, None = full causal
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, OLMoE uses full-width)
    # MLA (DeepSeek-V2/V3, Kimi-K2); zero when not MLA
    q_lora_rank: int = 0  # 0 = full-rank q projection
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class MoESpec:
    """The routed (and shared) experts of one MoE layer."""

    num_experts: int
    top_k: int
    expert_ffn: int  # intermediate width of one routed expert
    gated: bool = True  # True = SwiGLU-style 3 matrices, False = 2 matrices
    num_shared_experts: int = 0
    shared_ffn: int = 0  # intermediate width of ONE shared expert
    shared_gate: bool = False  # Qwen2-MoE: sigmoid gate (d -> 1) on the shared expert
    expert_bias: bool = False  # GPT-OSS: biases in expert projections
    router_bias: bool = False


@dataclass(frozen=True)
class LayerSpec:
    """One transformer block: attention plus either a dense MLP, an MoE, or both (Arctic)."""

    kind: LayerKind
    attention: AttentionSpec
    dense_ffn: int = 0  # width of the dense MLP (dense layers, or Arctic's residual MLP)
    dense_gated: bool = True
    moe: MoESpec | None = None

    def __post_init__(self) -> None:
        # the planner keys per-layer costs by LayerSpec thousands of times per plan: hash once
        fields_ = (self.kind, self.attention, self.dense_ffn, self.dense_gated, self.moe)
        object.__setattr__(self, "_hash", hash(fields_))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only (MoE) transformer, normalized from whatever config it came from."""

    name: str
    family: str
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerSpec, ...]
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0  # DeepSeek-V3 multi-token-prediction modules (each one full layer)
    norm_params_per_layer: int = 0  # filled by the parser: RMSNorm/LayerNorm weights per layer
    max_position_embeddings: int = 4096
    published_total_params: float | None = None  # from the preset's metadata, for checks
    published_active_params: float | None = None
    source: str = ""  # file or preset it came from

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.kind == "moe")

    @property
    def first_moe(self) -> MoESpec | None:
        for layer in self.layers:
            if layer.moe is not None:
                return layer.moe
        return None

    @property
    def num_experts(self) -> int:
        moe = self.first_moe
        return moe.num_experts if moe else 0

    @property
    def top_k(self) -> int:
        moe = self.first_moe
        return moe.top_k if moe else 0


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (a GPU, or one GCD of an MI250X)."""

    name: str
    memory_gib: float  # HBM capacity in GiB (2**30 bytes)
    peak_tflops: tuple[tuple[str, float], ...]  # (dtype, dense peak TFLOPS), e.g. ("bf16", 191.5)
    hbm_gbps: float  # HBM bandwidth, GB/s (1e9)
    sms: int = 0  # streaming multiprocessors (compute units); 0 = unknown

    def peak(self, dtype: str) -> float:
        """Dense peak TFLOPS of `dtype`'s GEMMs (its PEAK_KEYS entry, else its own key)."""
        key = peak_key(dtype)
        for name, tflops in self.peak_tflops:
            if name == key:
                return tflops
        raise SpecError(f"device {self.name}: no peak_tflops for dtype '{key}'")


@dataclass(frozen=True)
class LevelSpec:
    """One topology level, innermost first. A domain of this level holds `devices` devices.

    `bw_gbps` is the per-device bandwidth (GB/s, one direction) for traffic that must cross
    this level's links, i.e. between devices in the same domain of this level but different
    domains of the level below. `taper` < 1 thins that bandwidth when many devices use it at
    once (dragonfly global links).
    """

    name: str
    devices: int
    bw_gbps: float
    latency_us: float
    taper: float = 1.0
    kind: str = ""  # free text: "nvlink", "infinity-fabric", "nic", "dragonfly-global", ...


@dataclass(frozen=True)
class EfficiencyTable:
    """Measured throughput by size: x (ascending) -> y. Interpolated linearly in log(x)."""

    # e.g. "gemm_bf16" (x = tokens per GEMM, y = TFLOPS) or "a2a_node" (x = bytes, y = GB/s)
    name: str
    x: tuple[float, ...]
    y: tuple[float, ...]


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster: device, node shape, NICs and topology levels innermost first."""

    name: str
    device: DeviceSpec
    gpus_per_node: int
    num_nodes: int
    nics_per_node: int
    nic_gbps: float  # one NIC, GB/s per direction
    levels: tuple[LevelSpec, ...]
    framework_overhead_gib: float = 4.0  # CUDA context, allocator fragmentation, workspaces
    gemm_efficiency: float = 0.7  # fraction of peak for large GEMMs when no table is measured
    attention_efficiency: float = 0.5
    msg_overhead_us: float = 1.0  # per-message software (posting) cost of the collective library
    # The named efficiencies `piper calibrate --fit` may fit (EFFICIENCIES below); the defaults
    # leave the analytic model as derived in planner/RESOURCE_MODEL.md.
    grouped_gemm_half_rows: float = 128.0  # tokens per expert at half the large-GEMM efficiency
    hbm_efficiency: float = 1.0  # fraction of HBM bandwidth memory-bound kernels reach
    layer_overhead_us: float = 0.0  # host/launch time per layer and micro-batch (fwd + bwd)
    cuda_graphs: bool = False  # CUDA graphs capture the layers: layer_overhead_us is not paid
    scale_up_efficiency: float = 1.0  # fraction of NVLink / Infinity Fabric bandwidth reached
    scale_out_efficiency: float = 1.0  # fraction of NIC (network level) bandwidth reached
    overlap_efficiency: float = 1.0  # fraction of overlappable communication that really hides
    # mean delay (exponential) each member of a collective crossing the network adds; a
    # collective of n ranks waits for its slowest member: network_jitter_us x H_n
    # (planner.resources.comm.straggler_s; RESOURCE_MODEL.md "Dragonfly and Frontier terms")
    network_jitter_us: float = 0.0
    calibration: tuple[tuple[str, str], ...] = ()  # where fitted constants come from, errors
    tables: tuple[EfficiencyTable, ...] = ()
    topology: str = ""  # "dragonfly", "fat-tree", "nvl72", ...
    source: str = ""

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def table(self, name: str) -> EfficiencyTable | None:
        for t in self.tables:
            if t.name == name:
                return t
        return None

    @property
    def hbm_bytes_per_s(self) -> float:
        """What memory-bound kernels stream per second: HBM bandwidth x hbm_efficiency."""
        return self.device.hbm_gbps * 1e9 * self.hbm_efficiency

    def link_bytes_per_s(self, level: LevelSpec) -> float:
        """Bytes per second one device's traffic gets across `level`: bw x taper x the
        scale-out efficiency for NIC levels, the scale-up efficiency for the others."""
        return level.bw_gbps * 1e9 * level.taper * self.level_efficiency(level)

    def level_efficiency(self, level: LevelSpec) -> float:
        """scale_out_efficiency for levels reached through NICs (a NIC kind, or no kind and
        wider than a node), else scale_up_efficiency."""
        nic = level.kind in NIC_KINDS or (not level.kind and level.devices > self.gpus_per_node)
        return self.scale_out_efficiency if nic else self.scale_up_efficiency

    def layer_overhead_s(self, graphs: CudaGraphs | None = None) -> float:
        """Host time per layer and micro-batch the GPU waits for under `graphs` (None: the
        profile's `cuda_graphs`): all of layer_overhead_us eagerly, PARTIAL_GRAPH_SHARE of it
        with the static modules captured, none with the whole iteration captured."""
        mode = graphs or ("full" if self.cuda_graphs else "none")
        share = {"none": 1.0, "partial": PARTIAL_GRAPH_SHARE, "full": 0.0}[mode]
        return share * self.layer_overhead_us * 1e-6


CudaGraphs = Literal["none", "partial", "full"]
CUDA_GRAPHS: tuple[str, ...] = ("none", "partial", "full")
# With only the static modules in CUDA graphs (attention, router, permutation preprocessing)
# the dropless experts, dispatch and combine still launch eagerly: about half of a MoE
# layer's kernels (ASSUMPTION; Megatron-Core's cuda_graph_scope leaves "moe" out for
# dropless MoE because its shapes change every step).
PARTIAL_GRAPH_SHARE = 0.5

# LevelSpec.kind values of network levels (reached through the NICs): scale_out_efficiency
NIC_KINDS = frozenset({"nic", "dragonfly-global", "dragonfly-group", "network"})


@dataclass(frozen=True)
class Efficiency:
    """One named constant of the cluster profile that calibration may fit: its bounds and
    its physical meaning. `log` fits in log space (scale-like constants)."""

    name: str
    low: float
    high: float
    meaning: str
    log: bool = False


EFFICIENCIES: tuple[Efficiency, ...] = (
    Efficiency("gemm_efficiency", 0.3, 0.95, "fraction of peak TFLOPS a large dense GEMM reaches"),
    Efficiency(
        "grouped_gemm_half_rows", 8.0, 4096.0,
        "tokens per local expert at which the grouped expert GEMM reaches half of "
        "gemm_efficiency", log=True,
    ),
    Efficiency(
        "attention_efficiency", 0.15, 0.9,
        "fraction of peak the fused attention kernel reaches (forward + backward)",
    ),
    Efficiency(
        "hbm_efficiency", 0.3, 1.0,
        "fraction of HBM bandwidth memory-bound kernels (norms, activations, permutes) reach",
    ),
    Efficiency(
        "layer_overhead_us", 0.0, 20000.0,
        "host time per layer and micro-batch, forward + backward (kernel launches, dropless "
        "routing's device-to-host sync) that the GPU waits for; removed by CUDA graphs",
    ),
    Efficiency(
        "scale_up_efficiency", 0.3, 1.0,
        "fraction of NVLink bandwidth the collectives reach (NCCL bus bandwidth / link rate)",
    ),
    Efficiency(
        "scale_out_efficiency", 0.2, 1.0,
        "fraction of NIC bandwidth the collectives reach across nodes",
    ),
    Efficiency(
        "overlap_efficiency", 0.0, 1.0,
        "fraction of the communication the schedule overlaps that really hides behind "
        "compute (the rest is exposed: SM contention, imperfect streams)",
    ),
)  # fmt: skip

# Constants of terms only some topologies use, fitted only when named (`--params`): they are
# outside the default fit of every stack (EFFICIENCIES), so its cap holds.
TOPOLOGY_EFFICIENCIES: tuple[Efficiency, ...] = (
    Efficiency(
        "network_jitter_us", 0.0, 50000.0,
        "mean of the exponential delay each member of a collective that crosses the network "
        "adds (congestion, adaptive routing, system noise); a collective of n ranks waits for "
        "the slowest: network_jitter_us x H_n",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class TrainingSpec:
    """How the model is trained: shapes, precision, optimizer accounting, recompute."""

    seq_len: int = 4096
    global_batch: int = 1024  # sequences per optimizer step
    dtype: Dtype = "bf16"
    bytes_per_param: int = 16  # 16 = paper (bf16 w + bf16 g + fp32 master + m + v); 18 = Megatron
    zero: bool = False  # distributed optimizer: shard fp32 master + moments over data-parallel
    recompute: Recompute = "none"
    flash_attention: bool = True
    routing_skew: float = 1.0  # hottest EP rank's tokens / mean; raises its activation memory
    schedule: Literal["1f1b", "interleaved"] = "1f1b"
    extra: tuple[tuple[str, str], ...] = field(default=())
    # FSDP: weights, gradients and optimizer state sharded over the data-parallel mesh, each
    # layer's weights gathered before use (Megatron-FSDP optim_grads_params, torch
    # fully_shard); the alternative to the distributed optimizer (`zero`).
    fsdp: bool = False
    optimizer_dtype: OptimizerDtype = "fp32"  # Adam moments (Megatron's --exp-avg-dtype)
    mtp_layers: int | None = None  # multi-token-prediction layers; None = the model config's
    # 1F1B all-to-all overlap: one micro-batch's dispatch/combine behind another's compute
    # (Megatron's --overlap-moe-expert-parallel-comm)
    a2a_overlap: bool = False
    # Data-parallel gradient reduction overlapped with the backward and, with the distributed
    # optimizer, the parameter all-gather with the next forward (Megatron-LM's
    # --overlap-grad-reduce --overlap-param-gather, both off by default in Megatron-LM; DeepSpeed
    # ZeRO's overlap_comm, off by default below stage 3). False: the reduction runs after the
    # last backward and the all-gather before the first forward, neither hidden. FSDP overlaps
    # either way.
    grad_overlap: bool = True
    # Router weights applied inside the expert activation, before fc2 (Megatron-Core's
    # experts.py `activation_func_with_probs`): the combine then keeps no expert outputs.
    # False: weighted at the combine (Piper's runtime), which keeps them for the gate gradient.
    gate_in_activation: bool = False
    # CUDA graphs: "full" (the whole iteration captured: no per-layer host time), "partial"
    # (the static modules, e.g. Megatron's cuda_graph_scope attn / moe_router /
    # moe_preprocess: the dropless experts stay eager), "none"; None = the cluster's
    # `cuda_graphs` (true = full).
    cuda_graphs: CudaGraphs | None = None
    # The recompute policy applies to every layer (Megatron-Core's selective modules and
    # uniform full recompute, torchtitan's activation checkpointing): no per-layer choice.
    uniform_recompute: bool = False
    # Memory kept free on every stage (GiB): a layout fits when each stage's total stays at
    # or below device memory minus this margin (planner/PLANNING.md, "Memory headroom").
    memory_margin_gib: float = 0.0
    # Share of this rank's optimizer parameters whose fp32 master copy and Adam moments live
    # in host memory and are updated by the CPU (Megatron's --optimizer-cpu-offload
    # --optimizer-offload-fraction F, HybridDeviceOptimizer); 0 keeps all on the device.
    optimizer_offload_fraction: float = 0.0
    # The gradient buffer's dtype: "fp32" (main grads accumulated and reduced in fp32,
    # Megatron's default for bf16) or "bf16" (--grad-reduce-in-bf16, Megatron-Bridge's
    # grad_reduce_in_fp32=False); None = the accounting's (bytes_per_param 16: bf16, 18: fp32).
    grad_dtype: OptimizerDtype | None = None
    # Megatron's --use-precision-aware-optimizer: Transformer Engine's FusedAdam keeps the fp32
    # master weights of bf16 parameters as the 16 bits bf16 lacks (store_param_remainders).
    precision_aware_optimizer: bool = False
    # FSDP under torch pipelining (torchtitan, pp > 1): each unit is gathered once per step and
    # stays unsharded through the step's micro-batches, its gradients accumulating unsharded
    # in the fp32 reduce dtype until the last backward reduce-scatters them (torch 2.13
    # distributed/pipelining/stage.py:844-847 and 1173-1177, fully_shard/_fsdp_param.py:
    # 802-813). False: gathered and reduce-scattered per unit and micro-batch (Megatron-FSDP,
    # Piper's runtime). Set by the target's conventions; it matters only with pp > 1.
    fsdp_hold_unsharded: bool = False
    # The dtype FSDP reduce-scatters gradients in: "fp32" (FSDP2's MixedPrecisionPolicy
    # reduce_dtype=float32: torchtitan's default mixed_precision_reduce, Piper's runtime) or
    # "bf16"; None = Megatron-FSDP's default, the model's gradient dtype (bf16 for bf16 and
    # FP8 models, fp32 for fp32 ones: --megatron-fsdp-grad-comm-dtype, megatron_fsdp.md). Set
    # by the target's conventions.
    fsdp_reduce_dtype: OptimizerDtype | None = None
    # An fp32 master copy of the weights beside the compute-dtype parameters (Megatron-Core,
    # torchtitan's FSDP2 mixed precision, Piper's runtime). False: the parameters themselves
    # are bf16 and the optimizer updates them in place (pure bf16 training, as NeMo AutoModel
    # builds its MoE models): no master bytes; then the gradients and Adam moments take the
    # parameters' dtype (grad_dtype and optimizer_dtype bf16). No engine target offers it:
    # runs priced for a check (RUNS.csv column master_weights).
    master_weights: bool = True
    # Megatron's --fine-grained-activation-offloading --offload-modules M1,M2: the inputs of
    # these submodules go to host memory in forward and come back before backward
    # (planner.resources.act_offload); comma-separated names of ACTIVATION_OFFLOAD_MODULES.
    activation_offload_modules: str = ""
    # Megatron's --first-last-layers-bf16 --num-layers-at-start-in-bf16 N
    # --num-layers-at-end-in-bf16 M: under a low-precision dtype the first N and last M
    # transformer layers run in bf16 (planner.resources.precision.layer_training)
    bf16_layers_start: int = 0
    bf16_layers_end: int = 0

    def __post_init__(self) -> None:
        if self.cuda_graphs is not None and self.cuda_graphs not in CUDA_GRAPHS:
            raise SpecError(
                f"training: cuda_graphs '{self.cuda_graphs}' is unknown; use "
                f"{', '.join(CUDA_GRAPHS)}"
            )
        for name in ("seq_len", "global_batch"):
            if getattr(self, name) <= 0:
                raise SpecError(f"training: {name} must be positive, got {getattr(self, name)}")
        if self.bytes_per_param not in (16, 18):
            raise SpecError("training: bytes_per_param must be 16 (paper) or 18 (Megatron)")
        if not 0.0 <= self.memory_margin_gib < float("inf"):
            raise SpecError(
                f"training: memory_margin_gib must be >= 0, got {self.memory_margin_gib}"
            )
        if self.routing_skew < 1.0:
            raise SpecError("training: routing_skew is max/mean load and must be >= 1.0")
        if self.fsdp and self.zero:
            raise SpecError(
                "training: fsdp and zero (the distributed optimizer) both shard the optimizer "
                "state; choose one"
            )
        if self.mtp_layers is not None and self.mtp_layers < 0:
            raise SpecError(f"training: mtp_layers must be >= 0, got {self.mtp_layers}")
        self._check_optimizer_state()
        if not self.master_weights and (
            self.dtype == "fp32"
            or self.precision_aware_optimizer
            or self.grad_dtype != "bf16"
            or self.optimizer_dtype != "bf16"
        ):
            raise SpecError(
                "training: master_weights false is pure bf16/fp16 training: it needs a bf16 or "
                "fp16 dtype, grad_dtype bf16 and optimizer_dtype bf16, and no "
                "precision-aware optimizer"
            )

    def _check_optimizer_state(self) -> None:
        """Offload fraction in [0, 1], on the device optimizer (not FSDP); known grad dtype."""
        f = self.optimizer_offload_fraction
        if not 0.0 <= f <= 1.0:
            raise SpecError(
                f"training: optimizer_offload_fraction must be between 0 and 1 (the share of "
                f"optimizer state in host memory), got {f}"
            )
        if f > 0.0 and self.fsdp:
            raise SpecError(
                "training: optimizer_offload_fraction prices Megatron's HybridDeviceOptimizer "
                "beside the distributed optimizer, not FSDP; drop fsdp or the offload"
            )
        if self.grad_dtype is not None and self.grad_dtype not in ("fp32", "bf16"):
            raise SpecError(
                f"training: grad_dtype '{self.grad_dtype}' is unknown; use fp32 or bf16"
            )
        if self.fsdp_reduce_dtype is not None and self.fsdp_reduce_dtype not in ("fp32", "bf16"):
            raise SpecError(
                f"training: fsdp_reduce_dtype '{self.fsdp_reduce_dtype}' is unknown; use fp32, "
                "bf16 or leave it out (the model's gradient dtype)"
            )
        self._check_bf16_layers()
        names = [n for n in self.activation_offload_modules.split(",") if n]
        unknown = [n for n in names if n not in ACTIVATION_OFFLOAD_MODULES]
        if unknown:
            raise SpecError(
                f"training: activation_offload_modules names '{unknown[0]}'; choose from "
                f"{', '.join(ACTIVATION_OFFLOAD_MODULES)}"
            )

    def _check_bf16_layers(self) -> None:
        """BF16-kept layers: counts >= 0, under a low-precision dtype only."""
        start, end = self.bf16_layers_start, self.bf16_layers_end
        if start < 0 or end < 0:
            raise SpecError(
                f"training: bf16_layers_start and bf16_layers_end count layers and must be "
                f">= 0, got {start} and {end}"
            )
        if (start or end) and self.dtype in ("bf16", "fp16", "fp32"):
            raise SpecError(
                f"training: bf16_layers_start / bf16_layers_end keep layers out of a "
                f"low-precision recipe, and dtype is {self.dtype}; set them to 0 or choose an "
                "fp8 or fp4 dtype"
            )


# Megatron-Core's --offload-modules whose input activations Piper prices off the device
# (docs/user-guide/features/fine_grained_activation_offloading.md)
ACTIVATION_OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
                              "expert_fc1", "moe_act")  # fmt: skip
