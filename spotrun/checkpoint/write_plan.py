"""What one rank writes of a step, as a plan over the encoded state (no collective, no bytes
moved): its share of the replicated tensors, its own tensors, its chunk of each DTensor, which
of those chunks rank 0 must be told, and the report it sends rank 0 once its files are written.

:func:`spotrun.checkpoint.save.prepare_save` and :func:`~spotrun.checkpoint.save.commit_save`
run these on live state; the scale model (``benchmarks/scale_plan.py``) runs them on meta
tensors for simulated ranks: ``docs/design/scale.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from spotrun.checkpoint.encode import EncodedState
from spotrun.checkpoint.manifest import FileRecord
from spotrun.checkpoint.manifest_build import tensor_fields
from spotrun.checkpoint.plan import assign_by_bytes
from spotrun.checkpoint.rank_index import chunk_key
from spotrun.checkpoint.sharded import local_box, predicted_box, predicted_grid, writes_chunk

#: chunk key -> (tensor name, offsets, lengths in the global tensor)
Chunks = dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]


@dataclass
class WritePlan:
    """One rank's part of a step.

    Attributes:
        tensors: chunk key (:func:`~spotrun.checkpoint.rank_index.chunk_key`) -> the tensor as
            held (a DTensor's local tensor), not yet in stored form; in file order: the rank's
            replicated tensors, its own tensors, then its DTensor chunks.
        chunks: chunk key -> (tensor name, offsets, lengths) of every tensor in :attr:`tensors`.
        reported: the part of :attr:`chunks` rank 0 must be told: all but the chunks of DTensors
            whose layout it derives from their placements
            (:func:`~spotrun.checkpoint.sharded.predicted_grid`).
    """

    tensors: dict[str, torch.Tensor]
    chunks: Chunks
    reported: Chunks


def replicated_owners(encoded: EncodedState, world_size: int) -> dict[str, int]:
    """Replicated tensor name -> the rank that writes it (:func:`~spotrun.checkpoint.plan.assign_by_bytes`:
    every rank computes the same answer)."""
    return assign_by_bytes({n: t.numel() * t.element_size() for n, t in encoded.tensors.items()}, world_size)


def plan_writes(encoded: EncodedState, rank: int, world_size: int, owner: dict[str, int] | None = None) -> WritePlan:
    """What ``rank`` writes of ``encoded`` (``owner``: :func:`replicated_owners`, computed here
    when not given).

    Raises:
        StateSerializationError: a DTensor whose local part is not one box.
    """
    if owner is None:
        owner = replicated_owners(encoded, world_size)
    whole = {n: t for n, t in encoded.tensors.items() if owner[n] == rank}
    whole.update(encoded.rank_tensors)
    tensors = dict(whole)
    chunks: Chunks = {n: (n, (0,) * t.dim(), tuple(t.shape)) for n, t in whole.items()}
    reported = dict(chunks)
    for name, tensor in encoded.sharded.items():  # DTensors: this rank's chunk, if it writes it
        offsets, lengths = local_box(tensor)
        if math.prod(lengths) == 0 or not writes_chunk(tensor, name):
            continue
        key = chunk_key(name, offsets, lengths, tuple(tensor.shape))
        tensors[key] = tensor.to_local()
        predicted = predicted_grid(tensor, name)
        if predicted is None or predicted_box(tensor, predicted[0]) != (offsets, lengths):
            reported[key] = (name, offsets, lengths)  # rank 0 cannot derive it from the placements
        chunks[key] = (name, offsets, lengths)
    return WritePlan(tensors, chunks, reported)


def save_report(encoded: EncodedState, reported: Chunks, records: list[FileRecord], write_s: float) -> dict[str, Any]:
    """What a rank that wrote its files sends rank 0 (gathered by every rank): its file records,
    the chunks rank 0 cannot derive, its own state's skeleton and tensor fields."""
    return {
        "ok": True,
        "write_s": write_s,
        "files": [vars(record) for record in records],
        # the chunks rank 0 cannot derive: it builds each tensor's chunk layout from them
        "chunks": [[name, list(offsets), list(lengths)] for name, offsets, lengths in reported.values()],
        "rank_state": encoded.rank_skeleton,
        "rank_tensors": {n: tensor_fields(t) for n, t in encoded.rank_tensors.items()},
    }
