"""Where each of a rank's tensors sits in the model's whole weights, for checkpoints.

A checkpoint names every weight by what it is in the whole model (runtime/checkpoint.py), so
a rank that holds a slice of a weight saves that slice as a DTensor whose global shape is
the whole weight's, and DCP records its offsets; loading asks DCP for the slice this rank
holds now, whatever layout wrote the checkpoint (DCP reads the overlapping parts of the
saved slices). No rank gathers a whole weight. The slices, by layout:
- tensor parallel (runtime/parallel/tensor_parallel.py): a column-parallel weight and bias
  split on axis 0, a row-parallel weight on axis 1, the vocabulary-parallel embedding and head
  on axis 0 (the real rows only: padding rows are not part of the whole), attention sinks on
  their heads; the TP group in plan order is the mesh (rank i holds torch.chunk slice i).
- expert tensor parallel (runtime/parallel/expert_tp.py): each expert's FFN-width axis over
  the expert-TP group; b_out whole, on etp rank 0 only.
- FSDP (runtime/parallel/fsdp.py): fully_shard's dim-0 chunks over the data-parallel group
  (dense) or the expert-DP group (experts). A dense weight that TP also splits is a 2-D mesh
  (TP outer, the FSDP chunks of each TP slice inner); an expert's stacked parameter is
  chunked on the slot axis, so each slot is whole on one rank of its expert-DP group.
Adam's moments have their parameter's layout; its step count is one number per weight.

Shape letters: X = local expert slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from planner.run.spec import EMPTY
from runtime.parallel.expert_tp import width_axis
from runtime.parallel.mesh import Mesh
from runtime.parallel.pipeline import chunks_of
from runtime.parallel.tensor_parallel import tp_layout


@dataclass(frozen=True)
class Piece:
    """This rank's part of one whole weight.

    key: the whole weight's name (`layers.3.attn.q.weight`, `layers.3.experts.5.w_in`).
    param: the live parameter holding it. index: what to take of the parameter's local
    tensor (a slot, the real rows). shape: the whole weight's shape. mesh, placements: how
    the part sits in the whole (mesh None: it is the whole weight).
    """

    key: str
    param: nn.Parameter
    index: tuple
    shape: torch.Size
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] = ()

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of `t`: the parameter's data or an Adam moment of it."""
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.detach()[self.index]

    def saved(self, local: torch.Tensor) -> torch.Tensor:
        """`local` (this piece's tensor) as DCP should see it: a DTensor of the whole shape."""
        if self.mesh is None:
            return local
        stride = torch.empty(self.shape, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=stride
        )


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of torch.chunk's slice `index` of `parts` (DTensor's Shard split)."""
    per = -(-length // parts)
    start = min(index * per, length)
    return start, min(per, length - start)


class _Meshes:
    """The DeviceMeshes a rank's pieces sit on, built from the run's process groups."""

    def __init__(self, mesh: Mesh, device: str) -> None:
        self.mesh, self.device = mesh, device
        self._made: dict[tuple[str, ...], DeviceMesh] = {}

    def _from(self, names: tuple[str, ...], groups: list, ranks: list) -> DeviceMesh:
        """A mesh of `ranks` (nested lists, one level per group), in the order given."""
        if names not in self._made:
            self._made[names] = DeviceMesh.from_group(
                groups, self.device, mesh=torch.tensor(ranks), mesh_dim_names=names
            )
        return self._made[names]

    def tp(self) -> DeviceMesh:
        """The TP group in plan order (rank i: slice i)."""
        return self._from(("tp",), [self.mesh.tp_group], self.mesh.tp_ranks)

    def etp(self) -> DeviceMesh:
        """The expert-TP group in plan order."""
        return self._from(("etp",), [self.mesh.etp_group], self.mesh.etp_ranks)

    def tp_dp(self) -> DeviceMesh:
        """TP positions x each one's data-parallel group in its sorted order (FSDP's mesh)."""
        me = self.mesh.me
        rows = [
            sorted(c.physical for c in self.mesh.coords if c.stage == me.stage and c.tp_idx == i)
            for i in range(len(self.mesh.tp_ranks))
        ]
        return self._from(("tp", "dp"), [self.mesh.tp_group, self.mesh.dp_group], rows)


def _dense_key(chunk, name: str) -> str:
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"layers.{chunk.layer_ids[int(i)]}.{rest}"
    return name


def _dense_piece(key: str, p: nn.Parameter, meshes: _Meshes) -> Piece:
    """A weight outside the routed experts: whole, a TP slice, FSDP chunks of either."""
    tp = tp_layout(p, len(meshes.mesh.tp_ranks))
    fsdp = isinstance(p, DTensor)
    if tp is None:
        if fsdp:
            return Piece(key, p, (), p.shape, p.device_mesh, tuple(p.placements))
        return Piece(key, p, (), p.shape)
    dim, whole = tp
    shape = torch.Size(whole if d == dim else n for d, n in enumerate(p.shape))
    if fsdp:  # FSDP chunks the whole TP slice, padding rows included
        if whole != p.shape[dim] * len(meshes.mesh.tp_ranks):
            raise ValueError(
                f"{key}: FSDP chunks of a padded vocabulary slice (checked before launch)"
            )
        return Piece(key, p, (), shape, meshes.tp_dp(), (Shard(dim), Shard(0)))
    _, rows = _chunk(whole, len(meshes.mesh.tp_ranks), meshes.mesh.me.tp_idx)
    index = (slice(None),) * dim + (slice(0, rows),)  # the vocabulary's real rows
    return Piece(key, p, index, shape, meshes.tp(), (Shard(dim),))


def _expert_pieces(layer: int, name: str, p: nn.Parameter, ids: list[int], meshes: _Meshes):
    """One piece per expert slot this rank holds of a stacked parameter [X, ...]."""
    first, held = 0, len(ids)
    if isinstance(p, DTensor):  # FSDP: a dim-0 chunk of the slots over the expert-DP group
        mesh = p.device_mesh
        first, held = _chunk(len(ids), mesh.size(), mesh.get_local_rank())
    shape, mesh, placements = p.shape[1:], None, ()
    axis = width_axis(name)
    etp = len(meshes.mesh.etp_ranks)
    if etp > 1 and axis is not None:
        shape = torch.Size(n * etp if d == axis else n for d, n in enumerate(shape))
        mesh, placements = meshes.etp(), (Shard(axis),)
    return [
        Piece(f"layers.{layer}.experts.{e}.{name}", p, (slot - first,), shape, mesh, placements)
        for slot, e in enumerate(ids[first : first + held], start=first)
        if e != EMPTY
    ]


def pieces(module, mesh: Mesh) -> list[Piece]:
    """Every piece of a whole weight this rank holds (module: StageModule or RankChunks);
    a tied weight is one piece."""
    device = next(module.parameters()).device.type
    meshes, out = _Meshes(mesh, device), []
    for chunk in chunks_of(module):
        stacked = {
            id(p): (layer, name, moe.experts.expert_ids)
            for layer, moe in chunk.moe_layers().items()
            for name, p in moe.experts.named_parameters()
        }
        for name, p in chunk.named_parameters():
            if id(p) in stacked:
                layer, pname, ids = stacked[id(p)]
                out.extend(_expert_pieces(layer, pname, p, ids, meshes))
            else:
                out.append(_dense_piece(_dense_key(chunk, name), p, meshes))
    return out
