"""Thin helpers over ``torch.distributed`` that also work in a single process.

When no process group is initialised every helper behaves as world size 1, so the
library runs unchanged in a plain ``python train.py``. Collectives run on the device
the backend needs (CUDA for NCCL, CPU for gloo).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """World size (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """Rank within this node, from torchrun's ``LOCAL_RANK`` (falls back to the global rank)."""
    raw = os.environ.get("LOCAL_RANK")
    return int(raw) if raw and raw.isdigit() else rank()


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on at least one (one 1-element all-reduce)."""
    if not is_distributed():
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def any_rank_each(flags: list[bool]) -> list[bool]:
    """Element-wise :func:`any_rank` of several flags in one all-reduce."""
    if not is_distributed():
        return list(flags)
    value = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return [bool(v) for v in value.tolist()]


def all_gather_json(value: Any, group: Any = None) -> list[Any]:
    """Every rank's JSON-serialisable ``value``, indexed by rank.

    Values travel as JSON text (the transport is torch's object collective); nothing
    but JSON is ever accepted, so no arbitrary object is unpickled on receipt.
    ``group``: the process group (default: the default group); a background thread uses
    its own group (:func:`new_background_group`), so its collectives never interleave
    with the training thread's.
    """
    if not is_distributed():
        return [value]  # nothing travels
    text = json.dumps(value, allow_nan=False)
    gathered: list[str | None] = [None] * world_size()
    dist.all_gather_object(gathered, text, group=group)
    return [json.loads(t) for t in gathered]  # type: ignore[arg-type]


def broadcast_json(value: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s (global rank) JSON-serialisable ``value`` on every rank of ``group``."""
    if not is_distributed():
        return value  # nothing travels
    text = json.dumps(value, allow_nan=False)
    box = [text if rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return json.loads(box[0])  # type: ignore[arg-type]


def new_background_group() -> Any:
    """A gloo process group over all ranks for a background thread's collectives
    (collective: every rank must call it, in the same order); ``None`` without a process group.

    Collectives of one group must be issued in the same order on every rank; a thread that
    shares the training thread's group could interleave with its all-reduces. gloo runs on
    CPU whatever the training backend, so JSON collectives need no device.
    """
    if not is_distributed():
        return None
    return dist.new_group(backend="gloo")
