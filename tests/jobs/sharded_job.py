"""A small model trained under FSDP2, tensor parallelism or DDP-style replicas, checkpointed
with spotrun; run by the sharded-state tests with real torchrun and gloo.

``python sharded_job.py --jobs JSON --out FILE``: runs each job of the JSON list in turn,
``{"layout": "fsdp"|"tp"|"ddp"|"hsdp"|"fsdp_tp"|"single", "ckpt": DIR, "steps": N}`` (and
``"model": "head"`` for :class:`NetWithHead`): builds
the model in that layout, restores from DIR (any layout may have written it), trains up to
``steps`` and saves the final step. Rank 0 writes to ``--out`` a JSON list, one object per job:
``restored`` (step), ``losses`` ({step: loss}), ``restored_tensors`` and ``tensors`` ({name:
SHA-256 prefix of the full tensor's bytes} right after the restore and at the end) for every
parameter and every optimizer state tensor, gathered to full, ``bytes_read`` and
``bytes_received`` (each rank's ``restore_bytes_read`` and ``restore_bytes_received``).
``hsdp`` and ``fsdp_tp`` need 4 ranks (a 2 x 2 mesh).

Every rank trains on the same global batch (drawn from a generator seeded by the step), so
the loss does not depend on the layout beyond the order of floating-point reductions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown
from torch import nn

import spotrun

WIDTH_IN, WIDTH_HIDDEN = 12, 20  # sizes 20 and 12 do not divide by 3: uneven shards


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH_IN, WIDTH_HIDDEN)
        self.down = nn.Linear(WIDTH_HIDDEN, WIDTH_IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class NetWithHead(Net):
    """Net plus a one-output head: its bias has one element, so every rank but one holds an
    empty shard of it (and of its optimizer state) under FSDP2."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH_IN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.head(x)


def build(layout: str, model_name: str = "net") -> nn.Module:
    torch.manual_seed(0)
    model = NetWithHead() if model_name == "head" else Net()
    if layout in ("hsdp", "fsdp_tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if layout == "hsdp":  # replicated over dim 0, sharded over dim 1
            mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
            fully_shard(model.up, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(model.up, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    elif layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        fully_shard(model.up, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def digest(t: torch.Tensor) -> str:
    t = full(t).detach().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def tensor_digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Digest of every parameter and optimizer state tensor, gathered to full (collective)."""
    tensors = {f"model/{n}": digest(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in opt.state.items():
        for key, value in state.items():
            tensors[f"optimizer/{names[id(param)]}/{key}"] = digest(value)
    return tensors


def run_job(layout: str, ckpt_dir: str, steps: int, distributed: bool, model_name: str = "net") -> dict:
    model = build(layout, model_name)
    replicas = layout == "ddp" and distributed
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ckpt = spotrun.Checkpointer(
        {"model": model, "optimizer": opt, "scheduler": sched},
        uri=ckpt_dir,
        handle_signals=False,
        background_saves=False,
    )
    step = ckpt.restore()
    restored, restored_tensors = step, tensor_digests(model, opt)
    bytes_read = [None] * (dist.get_world_size() if distributed else 1)
    bytes_received = list(bytes_read)
    if distributed:
        dist.all_gather_object(bytes_read, ckpt.restore_bytes_read)
        dist.all_gather_object(bytes_received, ckpt.restore_bytes_received)
    else:
        bytes_read, bytes_received = [ckpt.restore_bytes_read], [ckpt.restore_bytes_received]
    losses = {}
    while step < steps:
        step += 1
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, WIDTH_IN, generator=g)
        y = torch.randn(8, WIDTH_IN, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if replicas:  # identical batches on every replica: the mean gradient is each rank's own
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        opt.step()
        sched.step()
        losses[step] = loss.item()
    ckpt.save(step, reason="final")
    ckpt.close()
    return {
        "restored": restored,
        "losses": losses,
        "restored_tensors": restored_tensors,
        "tensors": tensor_digests(model, opt),
        "lr": sched.get_last_lr(),
        "bytes_read": bytes_read,
        "bytes_received": bytes_received,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = [
        run_job(job["layout"], job["ckpt"], job["steps"], distributed, job.get("model", "net"))
        for job in json.loads(args.jobs)
    ]
    if not distributed or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
