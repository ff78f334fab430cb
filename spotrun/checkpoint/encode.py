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

from spotrun.checkpoint.dtypes import dtype_name
from spotrun.state import tree


@dataclass
class EncodedState:
    """Replicated and rank-local state split into JSON skeletons and tensors.

    Attributes:
        skeleton: JSON skeleton of the replicated state, keyed by top-level name.
        tensors: replicated tensors by name, aliases (tied weights) removed.
        aliases: alias name -> canonical name, for tensors that are the same tensor.
        rank_skeleton: JSON skeleton of this rank's own state.
        rank_tensors: this rank's own tensors by name.
    """

    skeleton: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str]
    rank_skeleton: dict[str, Any]
    rank_tensors: dict[str, torch.Tensor]


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
    rank_prefix = f"rank-{rank:05d}"
    rank_skeleton: dict[str, Any] = {}
    rank_tensors: dict[str, torch.Tensor] = {}
    for name, value in rank_local.items():
        rank_skeleton[name], found = tree.encode(value, f"{rank_prefix}/{name}")
        rank_tensors.update(found)
    return EncodedState(skeleton, tensors, aliases, rank_skeleton, rank_tensors)


def _dedupe(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store each distinct tensor once: tied weights (same storage, same view) become aliases."""
    canonical: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            unique[name] = t
            continue
        identity = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if identity in canonical:
            aliases[name] = canonical[identity]
        else:
            canonical[identity] = name
            unique[name] = t
    return unique, aliases


def structure_digest(encoded: EncodedState) -> str:
    """SHA-256 of the state's structure (skeleton, aliases, each tensor's dtype and shape):
    equal on every rank exactly when the replicated state has the same layout."""
    layout = {
        "skeleton": encoded.skeleton,
        "aliases": encoded.aliases,
        "tensors": {n: (dtype_name(t.dtype), t.shape) for n, t in encoded.tensors.items()},  # sort_keys sorts
    }
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()
