"""DTensors (FSDP2, tensor parallel, HSDP): the local chunk a rank holds and whether it writes it.

A DTensor is a global tensor spread over a device mesh by its placements: ``Shard(d)``
cuts dimension ``d`` over a mesh dimension, ``Replicate()`` copies it, ``Partial()`` holds
a term of a pending sum. Each rank holds one local tensor: one box of the global tensor
(its offsets and lengths, from torch's own sharding arithmetic, the one DCP uses:
``DTensor.__create_chunk_list__``). A box replicated over mesh dimensions is written
once in total: by the replica whose index over the replicated dimensions equals a hash of
the tensor's name modulo the number of replicas, so replicated state is spread over the
replica groups instead of all landing on one.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from spotrun.errors import StateSerializationError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch without DTensor (built without distributed)
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    return DTensor is not None and isinstance(value, DTensor)


def local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, lengths)`` of the part of ``tensor``'s global tensor this rank holds
    (for a plain tensor: all of it).

    Raises:
        StateSerializationError: a DTensor whose local part is not one box.
    """
    if not is_dtensor(tensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1:
        raise StateSerializationError(
            f"a DTensor of placements {tensor.placements} holds {len(chunks)} "
            "boxes of its global tensor on one rank; spotrun saves one"
        )
    return tuple(chunks[0].offsets), tuple(chunks[0].sizes)


def check_placements(tensor: Any, path: str) -> None:
    """Refuse placements that cannot be saved as they are.

    Raises:
        StateSerializationError: a ``Partial`` placement (a pending reduction), naming ``path``.
    """
    for placement in tensor.placements:
        if placement.is_partial():
            raise StateSerializationError(
                f"state value {path!r} is a DTensor with a Partial placement ({tensor.placements}): its "
                "value is a pending sum over ranks; reduce it (redistribute to Shard or Replicate) before saving"
            )


def writes_chunk(tensor: Any, name: str) -> bool:
    """Whether this rank writes its local chunk of DTensor ``tensor`` (named ``name``):
    always, unless the chunk is replicated over mesh dimensions and another replica is
    the one chosen for ``name``."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh
        return False
    return all(coordinate[d] == c for d, c in _replica_coordinates(tensor, name).items())


def _replica_coordinates(tensor: Any, name: str) -> dict[int, int]:
    """Mesh dimension -> coordinate of the replica chosen to write ``name`` (the replicated
    dimensions only; see :func:`writes_chunk`)."""
    shape = tuple(tensor.device_mesh.shape)
    replicated = [d for d, p in enumerate(tensor.placements) if p.is_replicate()]
    chosen = zlib.crc32(name.encode()) % math.prod(shape[d] for d in replicated) if replicated else 0
    coordinates = {}
    for d in reversed(replicated):
        coordinates[d] = chosen % shape[d]
        chosen //= shape[d]
    return coordinates


def predicted_grid(tensor: Any, name: str) -> tuple[list[int], list[int]] | None:
    """``(grid, writers)`` of a DTensor's chunks, computed from its placements alone (no
    communication), when every placement is ``Shard`` or ``Replicate`` and no tensor dimension
    is sharded over two mesh dimensions: dimension ``d`` sharded over a mesh dimension of size
    ``n`` is cut into ``n`` parts as ``torch.chunk`` cuts it (DTensor's rule for uneven
    shards); cells in row-major order, each written by the rank at its mesh coordinates (the
    chosen replica's on replicated mesh dimensions). ``None`` for anything else
    (``_StridedShard`` of FSDP2 + TP on one dimension, ``Partial``): the ranks then report
    their chunks.

    Each rank checks its own chunk against this prediction when it saves
    (:func:`spotrun.checkpoint.save.prepare_save`) and reports any chunk that differs.
    """
    from torch.distributed.tensor import Shard

    mesh = tensor.device_mesh
    ndim = len(tensor.shape)
    grid = [1] * ndim
    sharding: dict[int, int] = {}  # mesh dimension -> tensor dimension it cuts
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Shard:
            dim = placement.dim % ndim if ndim else 0
            if grid[dim] != 1 or dim in sharding.values():
                return None
            grid[dim] = mesh.shape[mesh_dim]
            sharding[mesh_dim] = dim
        elif not placement.is_replicate():
            return None
    fixed = _replica_coordinates(tensor, name)
    ranks = mesh.mesh[tuple(fixed.get(d, slice(None)) for d in range(len(mesh.shape)))]
    # the remaining dimensions are the sharding mesh dimensions, in mesh order: put them in
    # the order of the tensor dimensions they cut
    order = sorted(range(len(sharding)), key=lambda i: sharding[sorted(sharding)[i]])
    writers = ranks.permute(order) if len(order) > 1 else ranks
    return grid, writers.reshape(-1).tolist()  # Python ints


def predicted_box(tensor: Any, grid: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box :func:`predicted_grid` gives this rank (by its mesh coordinates)."""
    from spotrun.checkpoint.chunks import grid_bounds

    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    offsets, lengths = [], []
    cut_by = {p.dim % len(tensor.shape): m for m, p in enumerate(tensor.placements) if p.is_shard()}
    for dim, size in enumerate(tensor.shape):
        if dim in cut_by:
            bounds = grid_bounds(size, grid[dim])
            i = coordinate[cut_by[dim]]
            offsets.append(bounds[i])
            lengths.append(bounds[i + 1] - bounds[i])
        else:
            offsets.append(0)
            lengths.append(size)
    return tuple(offsets), tuple(lengths)


def mesh_description(tensor: Any) -> dict[str, Any]:
    """``{"shape": [...], "dim_names": [...] | None}`` of a DTensor's device mesh (for the
    manifest and ``spotrun ls``)."""
    mesh = tensor.device_mesh
    names = getattr(mesh, "mesh_dim_names", None)
    return {"shape": list(mesh.shape), "dim_names": list(names) if names else None}


def placement_signature(tensor: Any) -> str:
    """Mesh shape and placements as text, e.g. ``"(2,)[Shard(dim=0)]"`` (compared between
    ranks: equal on every rank for the same tensor)."""
    return f"{tuple(tensor.device_mesh.shape)}{list(tensor.placements)}"


def local_tensor(tensor: Any) -> torch.Tensor:
    """The rank's local tensor of a DTensor (a plain tensor is its own)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
