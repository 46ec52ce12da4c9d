"""make_dispatcher: the token dispatcher a run asks for (local, flat, HALO, HALO-dedup)."""

from __future__ import annotations

from planner.run.spec import RunSpec
from runtime.dispatch.base import TokenDispatcher
from runtime.dispatch.flat import FlatAllToAll
from runtime.dispatch.halo import Halo
from runtime.dispatch.halo_cost import HaloCost
from runtime.dispatch.local import LocalDispatcher


def make_dispatcher(spec: RunSpec, ep_group, kind: str | None = None) -> TokenDispatcher:
    """The EP all-to-all for this rank's stage: HALO, HALO-dedup or flat.

    Args:
      spec: the run (its dispatcher, ep, ranks_per_node and HALO options).
      ep_group: this rank's EP process group (runtime.parallel.mesh.Mesh.ep_group).
      kind: "halo", "halo-dedup" or "flat" instead of spec.dispatcher.

    Returns:
      LocalDispatcher when ep == 1, else the chosen dispatcher over ep_group.
    """
    kind = kind or spec.dispatcher
    if spec.ep == 1:
        return LocalDispatcher()
    if kind == "flat":
        return FlatAllToAll(ep_group, spec.ranks_per_node)
    options = {"dedup": kind == "halo-dedup"}
    if spec.halo_direct_below_bytes >= 0:
        options["direct_below_bytes"] = spec.halo_direct_below_bytes
    if spec.halo_cost:  # the plan's cluster: three phases only where they should pay
        options["cost"] = HaloCost(*spec.halo_cost)
    return Halo(ep_group, spec.ranks_per_node, **options)
