"""DCP's layout of the same state, for comparison: each rank writes ``__<rank>_0.distcp`` (its
chunks, the replicated tensors spread over the ranks as spotrun spreads them; no per-rank state:
DCP saves none), and rank 0 writes ``.metadata``: torch's own ``Metadata`` object, pickled, which
lists every chunk of every tensor and where it lies, and which every rank reads whole at load.

The ``.metadata`` size is measured by building DCP's objects and pickling them (as
``FileSystemWriter.finish`` does). Past :data:`EXACT_CHUNKS` chunks it is built for one tensor of
each kind (dtype, shape, chunk count) and for one more, and each further tensor of a kind adds
what that one added, corrected for its name's length (:attr:`DcpSave.how` says which).
"""

from __future__ import annotations

import math
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


def _metadata(tensors: list, world_size: int, at: list[int] | None = None) -> Metadata:
    """DCP's ``Metadata`` of ``tensors``; ``at``: where each tensor's chunks start in their files
    (default: each writer's file filled in order)."""
    state: dict = {"optimizer.param_groups": BytesStorageMetadata()}
    storage: dict = {}
    planner: dict = {"optimizer.param_groups": ("optimizer", "param_groups")}
    paths = [f"__{rank}_0.distcp" for rank in range(world_size)]
    written = [0] * world_size
    for t, (fqn, dtype, shape, chunks) in enumerate(tensors):
        listed = []
        for i, (offsets, lengths, rank) in enumerate(chunks):
            listed.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(lengths)))
            nbytes = dtype.itemsize
            for n in lengths:
                nbytes *= n
            # each rank's results reach rank 0 through a pickle of their own: its names are its own objects
            index = MetadataIndex("".join(fqn), torch.Size(offsets), i)
            storage[index] = _StorageInfo(paths[rank], written[rank] if at is None else at[t], nbytes)
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
            files[rank] += dtype.itemsize * math.prod(lengths)
    if chunks <= EXACT_CHUNKS:
        return DcpSave(len(pickle.dumps(_metadata(tensors, saved.world_size))), "exact", chunks, files)
    # tensors of one kind (dtype, shape, chunk count) add the same bytes but for their names,
    # which every chunk's index repeats
    kinds: dict[tuple, list[int]] = {}
    for i, (_, dtype, shape, listed) in enumerate(tensors):
        kinds.setdefault((dtype, shape, len(listed)), []).append(i)
    at, filled = [], 0  # where a tensor's chunks start in the files, as in the whole (the size of the numbers)
    for _, dtype, _, listed in tensors:
        at.append(filled)
        filled += dtype.itemsize * max(math.prod(lengths) for _, lengths, _ in listed)
    base = [found[0] for found in kinds.values()]

    def size(picked: list[int]) -> int:
        return len(pickle.dumps(_metadata([tensors[i] for i in picked], saved.world_size, [at[i] for i in picked])))

    base_bytes = size(base)
    estimate = base_bytes
    for found in kinds.values():
        if len(found) < 2:
            continue
        reference = tensors[found[1]]
        added = size(base + [found[1]]) - base_bytes
        for i in found[1:]:
            estimate += added + (len(tensors[i][3]) + 1) * (len(tensors[i][0]) - len(reference[0]))
    return DcpSave(estimate, f"extrapolated from one tensor of each of {len(kinds)} kinds", chunks, files)


def dcp_save_requests(store: Store, dcp: DcpSave) -> Counter:
    """Requests of DCP's save through the same store: each rank's file, then the metadata."""
    asked: Counter = Counter()
    for size in dcp.file_bytes:
        asked.update(store.upload_requests(size, streamed=True))
    asked.update(store.upload_requests(dcp.metadata_bytes, streamed=False))
    return asked
