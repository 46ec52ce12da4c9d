"""DeepEP / HybridEP dispatch: node-deduplicated hierarchical all-to-all, analytic.

Megatron-Core's flex dispatcher with the DeepEP or HybridEP backend
(`--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep|hybridep`) sends
each token once per destination rank (`get_dispatch_layout`: `num_tokens_per_rank`,
`is_token_in_rank`, deepseek-ai/DeepEP `deep_ep/buffer.py`) and, across local domains, once
per destination domain: over RDMA to the peer GPU with the same local index, which forwards
it over NVLink to the ranks of that domain that hold its experts (DeepEP `docs/legacy.md`,
"normal kernels with NVLink and RDMA forwarding"; HybridEP `docs/Hybrid-EP_Implementation.md`
section 8). Combine is the mirror (reduced inside the domain before the RDMA send back).

Under uniform routing of k of E experts, the expected number of distinct groups of E / R
experts a token reaches is D(R) = R (1 - C(E - E/R, k) / C(E, k)). For a rank of an EP group
of n members, g of them per local domain (NVLink; the 72-GPU rack on GB200 NVL72), Q = n / g
domains, and B bytes per token:
    RDMA bytes   = T B D(Q) (Q - 1) / Q        in Q - 1 messages, one per remote domain
    NVLink bytes = T B D(n) (g - 1) / g        its own tokens to local ranks and the forwarded
                                               tokens of other domains, in g - 1 messages
The two run concurrently (the kernels pipeline RDMA and NVLink forwarding):
    t = max(t_RDMA, t_NVLink), each lat + max(messages x o, o + bytes / bandwidth)
(planner.resources.comm's phase model). Inside one domain only the NVLink part remains.
"""

from __future__ import annotations

from planner.resources import comm
from planner.specs import ClusterSpec


def _normalized(parts: list[comm.Crossing]) -> list[comm.Crossing]:
    total = sum(c.fraction for c in parts)
    return [comm.Crossing(c.level, c.fraction / total, c.peers) for c in parts] if total else []


def deepep_all_to_all_s(
    cluster: ClusterSpec,
    group_devices: int,
    token_bytes: float,
    top_k: int,
    experts: int,
    stride: int = 1,
) -> float:
    """Seconds of one DeepEP dispatch (or combine) in which each of `group_devices` ranks
    (`stride` apart) sends its tokens, `token_bytes` = T x B one copy of each, to the
    ranks holding their top_k of `experts` experts."""
    n = group_devices
    if n <= 1 or token_bytes <= 0:
        return 0.0
    g = min(max(comm.local_domain_devices(cluster) // stride, 1), n)
    nvl_bytes = token_bytes * comm.distinct_groups(n, experts, top_k) * (g - 1) / g
    inner = _normalized(comm.crossings(cluster, g, stride))
    t_nvl = 0.0
    if inner:
        bw = comm.bandwidth_s(cluster, nvl_bytes, inner)
        t_nvl = comm.phase_s(cluster, g - 1, bw, comm.latency_s(inner))
    if n <= g:
        return t_nvl
    q = n // g
    rdma_bytes = token_bytes * comm.distinct_groups(q, experts, top_k) * (q - 1) / q
    remote = [c for c in comm.crossings(cluster, n, stride) if c.level.devices > g * stride]
    remote = _normalized(remote)
    bw = comm.bandwidth_s(cluster, rdma_bytes, remote)
    t_rdma = comm.phase_s(cluster, q - 1, bw, comm.latency_s(remote))
    return max(t_nvl, t_rdma)


# DeepEP's communication buffers (deepseek-ai/DeepEP `csrc/legacy/config.hpp`,
# `get_nvl_buffer_size_hint` / `get_rdma_buffer_size_hint`, with Megatron-Core sizing them by
# the hidden bytes and the group, `megatron/core/transformer/moe/fused_a2a.py` `get_buffer`):
# per channel (num_sms / 2 = 12 for the training kernels' 24 SMs) and peer, a ring of
# recv-token slots, each the token's hidden bytes plus its routing metadata (128 top-k
# indices int64, 128 weights and 128 scales fp32). Slots per peer: 288 NVLink, 128 RDMA (x 2,
# send and receive), the `get_dispatch_config` / `get_combine_config` values for 16-64 ranks.
DEEPEP_CHANNELS = 12
DEEPEP_NVL_PEERS = 8
DEEPEP_NVL_SLOTS = 288
DEEPEP_RDMA_SLOTS = 128
DEEPEP_SLOT_META_BYTES = 128 * 8 + 128 * 4 + 128 * 4


def deepep_buffer_bytes(hidden_bytes: float, group: int) -> float:
    """Bytes of DeepEP's NVLink and RDMA buffers on one rank of an EP group of `group` ranks
    whose tokens carry `hidden_bytes` each (the buffers above; no RDMA part within 8 ranks)."""
    if group <= 1:
        return 0.0
    slot = hidden_bytes + DEEPEP_SLOT_META_BYTES
    nvl_peers = min(group, DEEPEP_NVL_PEERS)
    nvl = DEEPEP_CHANNELS * nvl_peers * DEEPEP_NVL_SLOTS * slot
    if group <= DEEPEP_NVL_PEERS:
        return nvl
    rdma_peers = group // DEEPEP_NVL_PEERS
    return nvl + DEEPEP_CHANNELS * rdma_peers * DEEPEP_RDMA_SLOTS * 2 * slot
