"""A DDP or HSDP model and its AdamW state saved and restored by any number of ranks; run by
tests/unit/checkpoint/test_cooperative_restore.py with real torchrun and gloo (issue 26, point 3).

``python coop_job.py --mode save|restore --uri URI --layout ddp|hsdp --width W --out-dir DIR
[--steps N] [--continue K] [--extra-state-rank R]``

Each rank points ``AWS_ENDPOINT_URL`` at entry ``RANK`` of the comma-separated
``SPOTRUN_TEST_RANK_ENDPOINTS`` when that is set (one counting proxy per rank, as
sharded_s3_job.py does).

* ``ddp``: ``Linear(W, 2W) -> ReLU -> Linear(2W, W)`` replicated on every rank (plain tensors,
  the same everywhere), each gradient averaged by its own all-reduce: torch's
  ``DistributedDataParallel`` would do the same but regroups its gradient buckets after its
  first step, which changes gloo's summation order, so a resumed run's losses would differ from
  the uninterrupted run's in the last bits for reasons of its own; ``hsdp``: the same layers
  under FSDP2 on a ``(2, world / 2)`` mesh (replicated over dimension 0, sharded over dimension 1).
* ``save``: trains steps 1..N (each rank its own batch, drawn from a generator seeded by the
  step and the rank), saves every step, then trains K more steps without saving (the
  uninterrupted run).
* ``restore``: restores, then trains K steps without saving. ``--extra-state-rank R``: rank R
  also asks for a state named ``extra`` that no checkpoint holds (its objects refuse the step).

Each rank writes ``rank-R.json``: ``restored`` (step, or ``None`` when the restore raised),
``error`` (the restore's exception, type and message), ``tensors`` (name -> SHA-256 of the full
tensor, right after the restore in ``restore`` mode, at step N in ``save`` mode), ``losses``
(the K steps after), ``restore_bytes_read`` and ``restore_bytes_received``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown
from sharded_s3_job import digest, named_state
from torch import nn


def build(layout: str, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
    if layout == "ddp":
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: nn.Module, opt: torch.optim.Optimizer, step: int, width: int, replicas: bool) -> float:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(4, width, generator=g)
    loss = nn.functional.mse_loss(model(x), x)
    opt.zero_grad()
    loss.backward()
    if replicas:
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
    opt.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("save", "restore"), required=True)
    parser.add_argument("--uri", required=True)
    parser.add_argument("--layout", choices=("ddp", "hsdp"), required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--continue", dest="more", type=int, default=0)
    parser.add_argument("--extra-state-rank", type=int, default=-1)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    endpoints = os.environ.get("SPOTRUN_TEST_RANK_ENDPOINTS")
    if endpoints:
        os.environ["AWS_ENDPOINT_URL"] = endpoints.split(",")[rank]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="rank %(process)d %(name)s: %(message)s")  # spotrun's INFO lines

    import spotrun
    from spotrun.errors import SpotrunError

    model = build(args.layout, args.width)
    replicas = args.layout == "ddp"
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt}
    if rank == args.extra_state_rank:
        state["extra"] = {"epoch": 0}
    ckpt = spotrun.Checkpointer(state, uri=args.uri, handle_signals=False, background_saves=False)
    report = {"restored": None, "error": None, "losses": []}
    try:
        report["restored"] = step = ckpt.restore()
    except SpotrunError as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    if report["error"] is None:
        if args.mode == "save":
            while step < args.steps:
                step += 1
                train(model, opt, step, args.width, replicas)
                ckpt.save(step)
        report["tensors"] = {name: digest(t) for name, t in named_state(model, opt).items()}
        report["losses"] = [train(model, opt, step + k + 1, args.width, replicas) for k in range(args.more)]
    report["restore_bytes_read"] = ckpt.restore_bytes_read
    report["restore_bytes_received"] = ckpt.restore_bytes_received
    ckpt.close()
    with open(os.path.join(args.out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
