"""A small training job on CUDA devices, checkpointed with spotrun; run by tests/gpu under torchrun.

``torchrun --nproc-per-node N cuda_job.py --ckpt DIR --steps S --out FILE [--layout ddp|fsdp]``

Each rank trains on its own device (``LOCAL_RANK``), process group NCCL (``--device cpu``: a
dry run on gloo): a Linear-GELU-Dropout-Linear model in bf16 autocast, AdamW, OneCycleLR, and inputs drawn every
step on the device from the CUDA generator, so an exact resume needs the CUDA RNG, the pinned
staging of a background save (every 4 steps) and the restore into device tensors. ``layout``
``fsdp``: FSDP2 (``fully_shard``) over all ranks, DTensors on the device. Resumes from ``--ckpt``
when it holds a step; ``$SPOTRUN_STOP_AT_STEP`` stops with an emergency checkpoint. Rank 0 writes
``{"restored": step, "losses": {step: float.hex}, "final": sha256 of every parameter}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import spotrun


def build(layout: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.2), nn.Linear(256, 8)).to(device)
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
        return model
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def full_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(name.encode())
        digest.update(full.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layout", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the job (gloo)")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    # the same kernels in every run: the uninterrupted and the resumed runs compute alike
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    model = build(args.layout, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=args.steps)
    ckpt = spotrun.Checkpointer(
        {"model": model, "optimizer": optimizer, "scheduler": scheduler},
        uri=args.ckpt,
        interval_steps=4,
        background_saves=True,
    )
    torch.manual_seed(1234 + dist.get_rank())  # every generator, the CUDA ones included
    restored = step = ckpt.restore()
    losses = {}
    target = torch.arange(8, device=device, dtype=torch.float32)
    while step < args.steps:
        x = torch.randn(32, 64, device=device)  # drawn from the CUDA generator: restored, or not exact
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = ((model(x).float() - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1
        losses[step] = loss.item().hex()
        if ckpt.end_of_step(step):
            break
    if step >= args.steps:
        ckpt.save(step, reason="final")
    ckpt.close()
    digest = full_digest(model)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"restored": restored, "losses": losses, "final": digest, "step": step}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
