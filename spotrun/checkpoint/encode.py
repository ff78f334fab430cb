"""Encoding the state to save: state dicts split into JSON skeletons and tensors, tied
tensors stored once, and a digest of the structure that ranks compare before writing.

Raises :class:`~spotrun.errors.StateSerializationError` for a value that can be neither,
naming its key (at ``Checkpointer.restore()``, before training starts, and at every save).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from spotrun.checkpoint import tree
from spotrun.checkpoint.dtypes import dtype_name
from spotrun.checkpoint.sharded import check_placements, is_dtensor, local_tensor, placement_signature
from spotrun.errors import StateSerializationError


@dataclass
class EncodedState:
    """Replicated and rank-local state split into JSON skeletons and tensors.

    Attributes:
        skeleton: JSON skeleton of the replicated state, keyed by top-level name.
        tensors: replicated tensors by name, aliases (tied weights) removed.
        aliases: alias name -> canonical name, for tensors that are the same tensor.
        sharded: DTensors (FSDP2, tensor parallel) by name, aliases removed: each rank
            holds part of each (:mod:`spotrun.checkpoint.sharded`).
        rank_skeleton: JSON skeleton of this rank's own state.
        rank_tensors: this rank's own tensors by name.
    """

    skeleton: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str]
    rank_skeleton: dict[str, Any]
    rank_tensors: dict[str, torch.Tensor]
    sharded: dict[str, torch.Tensor] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.sharded is None:
            self.sharded = {}


def encode_state(replicated: dict[str, Any], rank_local: dict[str, Any], rank: int) -> EncodedState:
    """Encode state dicts (values already produced by ``state_dict()``).

    Raises:
        StateSerializationError: a value is neither a tensor nor JSON; names its key.
    """
    skeleton: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, value in replicated.items():
        skeleton[name], found = tree.encode(value, name)
        tensors.update(found)
    tensors, aliases = _dedupe(tensors)
    sharded = {n: t for n, t in tensors.items() if is_dtensor(t)}
    for n, t in sharded.items():
        check_placements(t, n)
        del tensors[n]
    rank_prefix = f"rank-{rank:05d}"
    rank_skeleton: dict[str, Any] = {}
    rank_tensors: dict[str, torch.Tensor] = {}
    for name, value in rank_local.items():
        rank_skeleton[name], found = tree.encode(value, f"{rank_prefix}/{name}")
        for n, t in found.items():
            if is_dtensor(t):
                raise StateSerializationError(
                    f"rank state {n!r} is a DTensor; a rank's own state holds plain "
                    "tensors (pass sharded state in Checkpointer(state=...))"
                )
        rank_tensors.update(found)
    return EncodedState(skeleton, tensors, aliases, rank_skeleton, rank_tensors, sharded)


def _dedupe(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store each distinct tensor once: tied weights (same storage, same view) become aliases."""
    canonical: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            unique[name] = t
            continue
        if is_dtensor(t):
            # its local part's storage object, not its address: a rank whose shard of several
            # DTensors is empty holds storages without memory (address 0) that are still
            # distinct objects, so every rank finds the same ties
            local = local_tensor(t)
            identity = (
                t.device,
                local.untyped_storage()._cdata,
                local.storage_offset(),
                t.dtype,
                tuple(t.shape),
                local.stride(),
                placement_signature(t),
            )
        else:
            identity = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if identity in canonical:
            aliases[name] = canonical[identity]
        else:
            canonical[identity] = name
            unique[name] = t
    return unique, aliases


def structure_digest(encoded: EncodedState) -> str:
    """SHA-256 of the state's structure (skeleton, aliases, each tensor's dtype and global
    shape, each DTensor's mesh and placements): equal on every rank exactly when the state
    has the same layout."""
    layout = {
        "skeleton": encoded.skeleton,
        "aliases": encoded.aliases,
        "tensors": {n: (dtype_name(t.dtype), t.shape) for n, t in encoded.tensors.items()},  # sort_keys sorts
        "sharded": {n: (dtype_name(t.dtype), t.shape, placement_signature(t)) for n, t in encoded.sharded.items()},
    }
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()
