"""The manifest of a step (rank 0): every tensor's chunk layout built from what each rank
reported writing, the device meshes, the files and the rank states.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from spotrun._version import __version__
from spotrun.checkpoint.chunks import Chunk, ChunkLayout
from spotrun.checkpoint.dtypes import dtype_name, stored_as
from spotrun.checkpoint.encode import EncodedState
from spotrun.checkpoint.key_layout import SPREAD_LAYOUT_FORMAT_VERSION, SpreadLayout
from spotrun.checkpoint.manifest import STEP_LAYOUT_FORMAT_VERSION, FileRecord, Manifest, SaveTiming, TensorRecord
from spotrun.checkpoint.sharded import mesh_description, predicted_grid


def tensor_fields(tensor: torch.Tensor) -> dict[str, Any]:
    """dtype, global shape and stored form of a tensor (a DTensor's global ones)."""
    return {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "stored_as": stored_as(tensor.dtype)}


def build_manifest(
    step: int,
    encoded: EncodedState,
    reports: list[dict[str, Any]],
    context: Any,
    world_size: int,
    layout: SpreadLayout | None = None,
) -> Manifest:
    """The manifest of ``step`` from rank 0's encoded state and every rank's save report
    (``chunks``, ``rank_tensors``, ``rank_state``, ``files``, ``write_s``); ``context`` is the
    save's :class:`~spotrun.checkpoint.save.SaveContext`; ``layout`` where the files lie (format
    5 when spread, else 4)."""
    fields_of = {n: tensor_fields(t) for n, t in {**encoded.tensors, **encoded.sharded}.items()}
    for rep in reports:
        fields_of.update(rep["rank_tensors"])
    written: dict[str, list[Chunk]] = {n: [] for n in fields_of}
    for rank, rep in enumerate(reports):
        for name, offsets, lengths in rep["chunks"]:
            written[name].append(Chunk(tuple(offsets), tuple(lengths), rank))
    tensors: dict[str, TensorRecord] = {}
    for name, fields in fields_of.items():
        tensors[name] = TensorRecord(
            file=None,
            dtype=fields["dtype"],
            shape=fields["shape"],
            stored_as=fields["stored_as"],
            chunks=_layout(fields["shape"], written[name], encoded.sharded.get(name), name),
        )
    meshes: list[dict[str, Any]] = []
    for tensor in encoded.sharded.values():
        mesh = mesh_description(tensor)
        if mesh not in meshes:
            meshes.append(mesh)
    return Manifest(
        step=step,
        world_size=world_size,
        files=[FileRecord(**f) for rep in reports for f in rep["files"]],
        tensors=tensors,
        state=encoded.skeleton,
        rank_state=[rep["rank_state"] for rep in reports],
        aliases=encoded.aliases,
        reason=context.reason,
        created_unix_s=time.time(),
        run_id=context.run_id,
        incarnation=context.incarnation,
        spotrun_version=__version__,
        torch_version=torch.__version__,
        timing=SaveTiming(
            write_s=round(max(rep["write_s"] for rep in reports), 6),
            step_time_s=None if context.step_time_s is None else round(context.step_time_s, 6),
        ),
        meshes=meshes,
        key_layout=layout,
        format_version=STEP_LAYOUT_FORMAT_VERSION if layout is None else SPREAD_LAYOUT_FORMAT_VERSION,
    )


def _layout(shape: list[int], reported: list[Chunk], tensor: Any, name: str) -> ChunkLayout:
    """A tensor's chunk layout: derived from a DTensor's placements where they allow, with any
    chunk a rank reported (because it differs from that) taking the place of its writer's cell."""
    predicted = predicted_grid(tensor, name) if tensor is not None else None
    if predicted is None:
        return ChunkLayout.of(shape, reported)
    layout = ChunkLayout(shape, grid=predicted[0], writers=predicted[1])
    if not reported:
        return layout
    replaced = {c.writer for c in reported}
    return ChunkLayout.of(shape, [c for c in layout.chunks() if c.writer not in replaced] + reported)
