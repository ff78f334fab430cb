"""How the example GPT is spread over the ranks: DDP, FSDP2, tensor parallel, or FSDP2 + TP.

The ranks form a (dp, tp) grid, row-major, so the ranks of one tensor-parallel group are
neighbours (one node); they compute on the same batch, and the data loader deals the samples
over the ``dp`` coordinates. What each mode shards: ``docs/design/internals.md`` (Examples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from spotrun.errors import ConfigError
from spotrun.examples.gpt import GPT


@dataclass(frozen=True)
class Layout:
    """The parallel layout of a run: ``world_size`` ranks, ``tp`` of them per tensor-parallel
    group, FSDP2 on or off. ``dp`` = ``world_size // tp`` data-parallel coordinates."""

    world_size: int
    tp: int = 1
    fsdp: bool = False

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    def check(self, heads: int, distributed: bool) -> None:
        """Refuse a layout this model and launch cannot run.

        Raises:
            ConfigError: ``tp`` below 1 or not dividing the world size or ``heads``, or
                ``--fsdp`` / ``--tp`` above 1 without a process group (not under torchrun).
        """
        if self.tp < 1:
            raise ConfigError(f"--tp must be at least 1, got {self.tp}")
        if (self.fsdp or self.tp > 1) and not distributed:
            raise ConfigError("--fsdp and --tp need a process group: start the trainer with torchrun")
        if self.world_size % self.tp:
            raise ConfigError(f"--tp {self.tp} does not divide the world size {self.world_size}")
        if heads % self.tp:
            raise ConfigError(f"--tp {self.tp} does not divide --heads {heads}: a rank must hold whole heads")

    def per_rank_batch(self, global_batch: int) -> int:
        """Samples per step on each rank: ``global_batch / dp``.

        Raises:
            ConfigError: ``global_batch`` does not divide by ``dp``; the message names both.
        """
        if global_batch % self.dp:
            raise ConfigError(
                f"the global batch (--batch-size {global_batch}) does not divide by the "
                f"{self.dp} data-parallel ranks (world size {self.world_size} / --tp {self.tp})"
            )
        return global_batch // self.dp

    def describe(self) -> str:
        """One line for the log, e.g. ``FSDP2 over 2 data-parallel ranks x tensor parallel 2 (world size 4)``."""
        if self.fsdp:
            kind = f"FSDP2 over {self.dp} data-parallel rank(s)"
        elif self.dp == 1:
            kind = "one data-parallel rank"
        elif self.tp == 1:
            kind = f"DDP over {self.dp} ranks"
        else:
            kind = f"{self.dp} data-parallel ranks (gradients all-reduced)"
        tp = f" x tensor parallel {self.tp}" if self.tp > 1 else ""
        return f"{kind}{tp} (world size {self.world_size})"


class Parallel:
    """The process groups of a :class:`Layout` and the model wrapped for it.

    Args:
        layout: the checked layout.
        device: this rank's device (its type names the mesh's device type).

    Attributes:
        dp_rank: this rank's data-parallel coordinate (what the data loader deals by).
        dp_group: the process group of this rank's data-parallel peers (``None``: all ranks,
            or no process group at all).
        mesh: the device mesh (``None`` for DDP and single-process runs).
    """

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.mesh: DeviceMesh | None = None
        self.dp_group = None
        self.dp_rank = dist.get_rank() if dist.is_initialized() else 0
        if layout.tp > 1 and (layout.fsdp or layout.dp > 1):
            self.mesh = init_device_mesh(device.type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        elif layout.tp > 1:
            self.mesh = init_device_mesh(device.type, (layout.tp,), mesh_dim_names=("tp",))
        elif layout.fsdp:
            self.mesh = init_device_mesh(device.type, (layout.dp,), mesh_dim_names=("dp",))
        if self.mesh is not None and "dp" in (self.mesh.mesh_dim_names or ()):
            self.dp_rank = self.mesh.get_local_rank("dp")
            self.dp_group = self.mesh.get_group("dp")
        elif self.mesh is not None:  # tensor parallel over all ranks: one data-parallel coordinate
            self.dp_rank = 0

    def wrap(self, model: GPT, device: torch.device) -> nn.Module:
        """Shard ``model`` in place for the layout; returns the module to call for training
        (a DDP wrapper, or ``model`` itself). Build the optimizer afterwards: FSDP2 and TP
        replace the parameters with DTensors.

        Raises:
            RuntimeError: the head and the token embedding no longer share one parameter.
        """
        if self.layout.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"] if self.mesh.ndim == 2 else self.mesh)
        if self.layout.fsdp:
            apply_fsdp(model, self.mesh["dp"] if self.mesh.ndim == 2 else self.mesh)
        check_tied(model)
        if self.layout.tp == 1 and not self.layout.fsdp and self.layout.world_size > 1:
            return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return model

    def sync_gradients(self, model: nn.Module) -> None:
        """Average the gradients over the data-parallel group, where neither DDP nor FSDP does:
        tensor parallel without FSDP and with ``dp > 1``. Otherwise nothing."""
        if not (self.layout.tp > 1 and not self.layout.fsdp and self.layout.dp > 1):
            return
        for param in model.parameters():
            if param.grad is None:
                continue
            local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(local, group=self.dp_group)
            local /= self.layout.dp

    def clip_gradients(self, model: nn.Module, max_norm: float) -> None:
        """Clip the gradients' global 2-norm to ``max_norm``: ``torch.nn.utils.clip_grad_norm_``
        where all parameters are alike (plain, or DTensors on one mesh), else :func:`clip_grad_norm`."""
        if self.layout.tp == 1:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:
            clip_grad_norm(list(model.parameters()), max_norm)

    def mean_over_dp(self, value: torch.Tensor) -> float:
        """A scalar tensor averaged over the data-parallel ranks (the ranks of one
        tensor-parallel group hold the same value), as a Python float."""
        value = value.detach().clone()
        if self.layout.dp > 1:
            dist.all_reduce(value, group=self.dp_group)
            value /= self.layout.dp
        return value.item()


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Column-wise ``q``, ``k``, ``v``, ``mlp.fc``; row-wise ``attn.proj``, ``mlp.proj`` in every
    block, over the 1-D ``tp_mesh``; records each attention's first global head."""
    heads_per_rank = model.config.heads // tp_mesh.size()
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
        block.attn.head_offset = tp_mesh.get_local_rank() * heads_per_rank


def apply_fsdp(model: GPT, dp_mesh: DeviceMesh) -> None:
    """FSDP2 on every transformer block, then on the root (embeddings, final LayerNorm and
    the tied head: one unit, so the shared weight is one sharded parameter)."""
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def check_tied(model: GPT) -> None:
    """Raises RuntimeError unless the head's weight is the token embedding's parameter."""
    if model.head.weight is not model.tok_emb.weight:
        raise RuntimeError("the output head no longer shares its weight with the token embedding")


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients so that their global 2-norm is at most ``max_norm``; returns the
    norm before clipping (a float, the same on every rank).

    For a mix of plain tensors and DTensors on different meshes (tensor parallel leaves the
    embeddings, LayerNorms and head replicated, FSDP2 + TP puts them on the ``dp`` mesh and
    the split layers on (dp, tp)), which ``torch.nn.utils.clip_grad_norm_`` refuses. Every
    rank sums the squares of its local gradient pieces, each weighted by 1 / (number of ranks
    holding a copy of that piece: the world size over the product of the mesh sizes of the
    sharded dimensions, ``Shard`` or FSDP2's strided shard; a plain tensor is on every rank),
    and one all-reduce over all ranks adds them up, in float64.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    grads = [param.grad for param in parameters if param.grad is not None]
    squares = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for grad in grads:
        local, pieces = grad, 1
        if isinstance(grad, DTensor):
            local = grad.to_local()
            for dim, placement in enumerate(grad.placements):
                if placement.is_partial():
                    raise RuntimeError(f"gradient with an unreduced placement {grad.placements}")
                if not placement.is_replicate():  # Shard, or FSDP2's _StridedShard under TP
                    pieces *= grad.device_mesh.size(dim)
        squares += local.double().pow(2).sum() * (pieces / world_size)
    if world_size > 1:
        dist.all_reduce(squares)
    total = math.sqrt(squares.item())
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for grad in grads:
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale)
    return total
