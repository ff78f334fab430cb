"""How a checkpoint's ranks were laid out, in words: for ``spotrun ls``, the supervisor's start
log and the workers' restore log.

A step's layout is its world size and the device meshes of its sharded (DTensor) tensors, as
the manifest records them (``Manifest.world_size``, ``Manifest.meshes``: a list of
``{"shape": [..], "dim_names": [..] | None}``, empty for replicated DDP state and in
manifests written before meshes were recorded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def ranks(count: int) -> str:
    """``"1 rank"``, ``"4 ranks"``."""
    return f"{count} rank" if count == 1 else f"{count} ranks"


def mesh_shape(mesh: dict[str, Any]) -> str:
    """One mesh's shape: ``"2x2"``, ``"4"``."""
    return "x".join(str(size) for size in mesh["shape"])


def describe_layout(world_size: int, meshes: Sequence[dict[str, Any]]) -> str:
    """A step's layout: ``"2 ranks"``, ``"4 ranks, mesh 2x2"``, ``"8 ranks, meshes 2x4 and 8"``.

    Args:
        world_size: ranks that saved the step (``Manifest.world_size``).
        meshes: ``Manifest.meshes``; each distinct shape is named once, in order.
    """
    shapes = list(dict.fromkeys(mesh_shape(m) for m in meshes))
    if not shapes:
        return ranks(world_size)
    if len(shapes) == 1:
        return f"{ranks(world_size)}, mesh {shapes[0]}"
    return f"{ranks(world_size)}, meshes {', '.join(shapes[:-1])} and {shapes[-1]}"


def describe_mesh_names(meshes: Sequence[dict[str, Any]]) -> str:
    """The meshes with their dimension names, for a log line: ``"2x2 (dp_replicate, dp_shard)"``;
    ``""`` without meshes. A mesh without names shows its shape alone."""
    parts = []
    for mesh in meshes:
        names = mesh.get("dim_names")
        parts.append(f"{mesh_shape(mesh)} ({', '.join(names)})" if names else mesh_shape(mesh))
    return ", ".join(dict.fromkeys(parts))


def restored_onto(
    step: int,
    saved_world_size: int,
    saved_meshes: Sequence[dict[str, Any]],
    world_size_now: int,
    meshes_now: Sequence[dict[str, Any]] | None = None,
) -> str:
    """The workers' restore log line (rank 0), with the rank count known after the rendezvous:
    ``"restored step 200 (saved by 4 ranks, mesh 2x2) onto 2 ranks (another world size: resharded)"``,
    ``"restored step 200 (saved by 2 ranks) onto 2 ranks (the same world size)"``,
    ``"restored step 200 (saved by 2 ranks, mesh 2) onto 2 ranks, mesh 2x1 (the same world size, another
    layout: resharded)"`` when ``meshes_now`` (the meshes of the state's DTensors now) differ.

    For :meth:`spotrun.Checkpointer.restore`: the supervisor logs the saved layout and the count
    it launches before the rendezvous (for an elastic ``--nnodes MIN:MAX`` only a range), the
    workers this line.
    """
    now = ranks(world_size_now) if meshes_now is None else describe_layout(world_size_now, meshes_now)
    if saved_world_size != world_size_now:
        how = "another world size: resharded"
    elif meshes_now is not None and sorted(m["shape"] for m in meshes_now) != sorted(m["shape"] for m in saved_meshes):
        how = "the same world size, another layout: resharded"
    else:
        how = "the same world size"
    return f"restored step {step} (saved by {describe_layout(saved_world_size, saved_meshes)}) onto {now} ({how})"
