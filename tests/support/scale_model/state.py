"""The simulated job's training state on one rank: the model's parameters and AdamW's state
(``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter, keyed by parameter name as
:class:`spotrun.state.optimizer.OptimizerState` saves them) as DTensors placed as FSDP2, HSDP or
FSDP2 + tensor parallelism place them (or plain tensors for DDP), and the rank's own state (RNGs,
numerics), with no tensor data: every local tensor is on the meta device.

A rank's DTensors hang off a ``DeviceMesh`` built for that rank without a process group
(``_init_backend=False``, ``_rank``), so one process can be any rank.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard

from spotrun.checkpoint.encode import EncodedState, encode_state
from spotrun.state.ddp_buckets import DDP_BUCKETS_STATE_NAME, encode_layout
from spotrun.state.numerics import NUMERICS_STATE_NAME, NumericsState
from spotrun.state.rng import RNGState
from tests.support.scale_model.shapes import ModelShape

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Layout:
    """How the state is spread over ``world_size`` ranks.

    ``ddp``: every tensor replicated (plain tensors); ``fsdp``: FSDP2, ``Shard(0)`` over all ranks;
    ``hsdp:RxS``: a (replicate R) x (shard S) mesh, ``(Replicate(), Shard(0))``; ``fsdp+tp:T``: a
    (dp) x (tp T) mesh, FSDP2 over dp on top of torchtitan's tensor parallelism (what ``fully_shard``
    makes of it: ``_StridedShard`` where both cut dimension 0).
    """

    kind: str
    world_size: int
    mesh_shape: tuple[int, ...] = ()
    dim_names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, world_size: int) -> Layout:
        """``ddp``, ``fsdp``, ``hsdp:RxS`` or ``fsdp+tp:T`` over ``world_size`` ranks.

        Raises:
            ValueError: an unknown layout, or a mesh that does not multiply to ``world_size``.
        """
        if text in ("ddp", "fsdp"):
            return cls(text, world_size, (world_size,), ("dp",))
        match = re.fullmatch(r"hsdp:(\d+)x(\d+)", text)
        if match:
            r, s = int(match.group(1)), int(match.group(2))
            if r * s != world_size:
                raise ValueError(f"hsdp:{r}x{s} has {r * s} ranks, not {world_size}")
            return cls("hsdp", world_size, (r, s), ("replicate", "shard"))
        match = re.fullmatch(r"fsdp\+tp:(\d+)", text)
        if match:
            t = int(match.group(1))
            if t < 1 or world_size % t:
                raise ValueError(f"tensor parallelism of {t} does not divide {world_size} ranks")
            return cls("fsdp+tp", world_size, (world_size // t, t), ("dp", "tp"))
        raise ValueError(f"unknown layout {text!r}: ddp, fsdp, hsdp:RxS or fsdp+tp:T")

    @property
    def name(self) -> str:
        if self.kind == "hsdp":
            return f"hsdp:{self.mesh_shape[0]}x{self.mesh_shape[1]}"
        if self.kind == "fsdp+tp":
            return f"fsdp+tp:{self.mesh_shape[1]}"
        return self.kind

    def placements(self, tp: str) -> tuple[Any, ...] | None:
        """The placements of a parameter that tensor parallelism cuts as ``tp``; ``None`` for DDP."""
        if self.kind == "ddp":
            return None
        if self.kind == "fsdp":
            return (Shard(0),)
        if self.kind == "hsdp":
            return (Replicate(), Shard(0))
        t = self.mesh_shape[1]
        if tp == "dim0":
            return (_StridedShard(0, split_factor=t), Shard(0))
        if tp == "dim1":
            return (Shard(0), Shard(1))
        return (Shard(0), Replicate())

    def mesh(self, rank: int) -> DeviceMesh:
        """The job's device mesh as ``rank`` sees it (no process group)."""
        ranks = torch.arange(self.world_size).view(self.mesh_shape)
        return DeviceMesh("cpu", ranks, mesh_dim_names=self.dim_names, _init_backend=False, _rank=rank)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinates in the mesh (row-major)."""
        found = []
        for size in reversed(self.mesh_shape):
            found.append(rank % size)
            rank //= size
        return tuple(reversed(found))


#: A box in a global tensor: (offsets, lengths).
Box = tuple[tuple[int, ...], tuple[int, ...]]


def box_at(layout: Layout, shape: tuple[int, ...], placements: tuple, rank: int, cache: dict[tuple, Box]) -> Box:
    """The box of a DTensor of ``shape`` and ``placements`` that ``rank`` holds, by torch's own
    sharding arithmetic (what ``DTensor`` reports as its local shape and offset), memoized in
    ``cache``: a rank's coordinate along a dimension its placement replicates does not move it,
    so ranks that differ only there share one entry (torch's arithmetic for ``_StridedShard``
    costs milliseconds per call)."""
    coordinate = layout.coordinate(rank)
    key = (
        layout.mesh_shape,
        shape,
        repr(placements),
        tuple(0 if p.is_replicate() else c for p, c in zip(placements, coordinate)),
    )
    if key not in cache:
        lengths, offsets = _compute_local_shape_and_global_offset(
            shape, layout.mesh_shape, list(coordinate), placements
        )
        cache[key] = (tuple(offsets), tuple(lengths))
    return cache[key]


@functools.cache
def _adamw_group() -> dict[str, Any]:
    """AdamW's parameter-group settings as this torch writes them (without ``params``)."""
    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


def rank_state(rank: int, ddp_parameters: int = 0) -> dict[str, Any]:
    """A rank's own state as the Checkpointer saves it: numerics, DDP's bucket layout (a DDP
    model's ``ddp_parameters`` indices, in DDP's rebuilt order as runs; none without DDP), then every RNG
    (this process's, with one CUDA generator's 16 bytes added, as on a rank that drives one GPU)."""
    rng = RNGState().state_dict()
    rng["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    numerics = NumericsState().state_dict()
    numerics["cuda_devices"] = ["NVIDIA H100 80GB HBM3"]
    layouts = {"model": encode_layout([list(range(ddp_parameters - 1, -1, -1))])} if ddp_parameters else {}
    return {NUMERICS_STATE_NAME: numerics, DDP_BUCKETS_STATE_NAME: {"layouts": layouts}, "rng": rng}


class StateBuilder:
    """Builds the state of any rank of one simulated job."""

    def __init__(self, shape: ModelShape, layout: Layout, dtype: str) -> None:
        self.shape, self.layout, self.dtype = shape, layout, DTYPES[dtype]
        self.parameters = shape.parameters()

    def state(self, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(replicated, rank_local)`` state dicts of ``rank``, as the Checkpointer hands them to a save."""
        mesh = None if self.layout.kind == "ddp" else self.layout.mesh(rank)
        local_shapes: dict[tuple, tuple[int, ...]] = {}
        # DDP's plain tensors: one element each, expanded (a meta tensor has no address, and
        # encode_state would take tensors of one shape at address 0 for tied weights)
        elements = iter(torch.empty(3 * len(self.parameters), dtype=self.dtype))

        def tensor(shape: tuple[int, ...], tp: str) -> torch.Tensor:
            placements = self.layout.placements(tp)
            if placements is None:
                return next(elements).expand(shape)
            key = (shape, placements)
            if key not in local_shapes:
                local_shapes[key] = tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[0])
            local = torch.empty(local_shapes[key], dtype=self.dtype, device="meta")
            meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), self.dtype)
            return DTensor(local, DTensorSpec(mesh, placements, meta), requires_grad=False)

        model = {name: tensor(shape, tp) for name, shape, tp in self.parameters}
        optimizer = {
            "state": {
                name: {
                    "step": torch.tensor(1.0),  # AdamW keeps it a plain CPU tensor, also for DTensors
                    "exp_avg": tensor(shape, tp),
                    "exp_avg_sq": tensor(shape, tp),
                }
                for name, shape, tp in self.parameters
            },
            "param_groups": [{**_adamw_group(), "params": [name for name, _, _ in self.parameters]}],
        }
        ddp_parameters = len(self.parameters) if self.layout.kind == "ddp" else 0
        return {"model": model, "optimizer": optimizer}, rank_state(rank, ddp_parameters)

    def encoded(self, rank: int) -> EncodedState:
        """``rank``'s state as :func:`spotrun.checkpoint.encode.encode_state` encodes it for a save."""
        replicated, rank_local = self.state(rank)
        return encode_state(replicated, rank_local, rank)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, found = 1, []
    for size in reversed(shape):
        found.append(stride)
        stride *= size
    return tuple(reversed(found))
