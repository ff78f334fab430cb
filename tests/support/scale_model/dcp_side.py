"""DCP's layout of the same state, for comparison: each rank writes ``__<rank>_0.distcp`` (its
chunks, the replicated tensors spread over the ranks as spotrun spreads them; no per-rank state:
DCP saves none), and rank 0 writes ``.metadata``: torch's own ``Metadata`` object, pickled, which
lists every chunk of every tensor and where it lies, and which every rank reads whole at load.

The ``.metadata`` size is measured by building DCP's objects and pickling them (as
``FileSystemWriter.finish`` does). Past :data:`EXACT_CHUNKS` chunks it is built for every
``m``-th tensor and every ``2m``-th, and extrapolated linearly (:func:`metadata_bytes` says which).
"""

from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tests.support.scale_model.save_side import SavePlanner
from tests.support.scale_model.store import Store

#: Up to this many chunks the ``.metadata`` is built whole.
EXACT_CHUNKS = 300_000


@dataclass
class DcpSave:
    metadata_bytes: int
    how: str  # "exact" or "extrapolated from every m-th tensor"
    chunks: int
    file_bytes: list[int]  # each rank's __<rank>_0.distcp (tensor bytes only: torch.save's framing left out)


def _tensors(saved: SavePlanner) -> list[tuple[str, torch.dtype, tuple[int, ...], list[tuple[tuple, tuple, int]]]]:
    """Every tensor of the state (DCP's flattened name, dtype, shape, chunks (offsets, lengths, writer))."""
    found = []
    for name, t in saved.encoded.tensors.items():
        found.append(
            (name.replace("/", "."), t.dtype, tuple(t.shape), [((0,) * t.dim(), tuple(t.shape), saved.owner[name])])
        )
    for name, t in saved.encoded.sharded.items():
        group = saved.group(name)
        chunks = [(o, n, rank) for rank, (o, n, _) in group.chunks.items()]
        found.append((name.replace("/", "."), t.dtype, tuple(t.shape), chunks))
    return found


def _metadata(tensors: list, world_size: int) -> Metadata:
    state: dict = {"optimizer.param_groups": BytesStorageMetadata()}
    storage: dict = {}
    planner: dict = {"optimizer.param_groups": ("optimizer", "param_groups")}
    paths = [f"__{rank}_0.distcp" for rank in range(world_size)]
    written = [0] * world_size
    for fqn, dtype, shape, chunks in tensors:
        listed = []
        for i, (offsets, lengths, rank) in enumerate(chunks):
            listed.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(lengths)))
            nbytes = dtype.itemsize
            for n in lengths:
                nbytes *= n
            # each rank's results reach rank 0 through a pickle of their own: its names are its own objects
            index = MetadataIndex("".join(fqn), torch.Size(offsets), i)
            storage[index] = _StorageInfo(paths[rank], written[rank], nbytes)
            written[rank] += nbytes
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), listed)
        planner[fqn] = tuple(fqn.split(".", 1))
    return Metadata(state, planner_data=planner, storage_data=storage, storage_meta=StorageMeta(), version="1.0.0")


def dcp_save(saved: SavePlanner) -> DcpSave:
    """DCP's ``.metadata`` size and each rank's data file for ``saved``'s state."""
    tensors = _tensors(saved)
    chunks = sum(len(t[3]) for t in tensors)
    files = [0] * saved.world_size
    for _, dtype, _, listed in tensors:
        for _, lengths, rank in listed:
            nbytes = dtype.itemsize
            for n in lengths:
                nbytes *= n
            files[rank] += nbytes
    if chunks <= EXACT_CHUNKS:
        return DcpSave(len(pickle.dumps(_metadata(tensors, saved.world_size))), "exact", chunks, files)
    every = -(-chunks // (EXACT_CHUNKS // 2))
    every -= every % 2
    one = len(pickle.dumps(_metadata(tensors[::every], saved.world_size)))
    two = len(pickle.dumps(_metadata(tensors[:: every // 2], saved.world_size)))
    # every (m/2)-th tensor is the m-th ones and as many more: per m-th share, (two - one)
    estimate = one + (every - 1) * (two - one)
    return DcpSave(estimate, f"extrapolated from every {every}th and {every // 2}th tensor", chunks, files)


def dcp_save_requests(store: Store, dcp: DcpSave) -> Counter:
    """Requests of DCP's save through the same store: each rank's file, then the metadata."""
    asked: Counter = Counter()
    for size in dcp.file_bytes:
        asked.update(store.upload_requests(size, streamed=True))
    asked.update(store.upload_requests(dcp.metadata_bytes, streamed=False))
    return asked
