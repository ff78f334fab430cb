"""torchrun worker for the S3 fault tests: save and restore a small model + AdamW.

Usage (2 ranks, gloo; the S3 endpoint comes from the environment, e.g. a fault proxy):

    torchrun --standalone --nproc-per-node 2 s3_ckpt.py --uri s3://bucket/job --out-dir DIR
        [--restore] [--save-steps 1 2 ...] [--save-timeout-s S] [--emergency-deadline-s S]

Each rank optionally restores first, then for every step in ``--save-steps`` takes one
deterministic optimizer step and saves it: with ``Checkpointer.save`` (bounded by
``--save-timeout-s``), or with ``--emergency-deadline-s`` as an emergency save that rank 0
requests through ``$SPOTRUN_CONTROL_DIR`` the way the supervisor does, with a deadline
that many seconds ahead. Each rank writes ``DIR/rank-R.json``::

    {"rank": R, "restored": {"step": int, "digest": str} | null,
     "saves": [{"step": int, "ok": bool, "error": str | null, "elapsed_s": float,
                "digest": str | null}, ...]}

``digest`` is a SHA-256 over every model and optimizer tensor (bytes, dtype, shape) and
the optimizer's hyper-parameters, so equal digests mean a bit-identical state. Shards are
sent as multipart uploads above 5 MiB (part size 5 MiB), so large and small paths are both
exercised. The process exits 0 whether or not the saves succeeded: the JSON says which.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown
from torch import nn

import spotrun
from spotrun.control import files as control
from spotrun.control.env import CONTROL_DIR
from spotrun.errors import CheckpointSaveError
from spotrun.storage import open_storage

MIB = 1024 * 1024
#: Model width: one 1024x1024 layer, so model + AdamW state is about 12 MiB.
WIDTH = 1024


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--uri", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--restore", action="store_true")
    p.add_argument("--save-steps", type=int, nargs="*", default=[])
    p.add_argument("--save-timeout-s", type=float, default=300.0)
    p.add_argument("--emergency-deadline-s", type=float, default=None)
    return p.parse_args()


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(WIDTH, WIDTH)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, WIDTH, generator=generator)  # (B, C), the same on every rank
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()

    def add(name: str, value: object) -> None:
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{list(value.shape)}".encode())
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(json.dumps(value, sort_keys=True, default=str).encode())

    for name, tensor in sorted(model.state_dict().items()):
        add(f"model/{name}", tensor)
    opt_state = opt.state_dict()
    for index, state in sorted(opt_state["state"].items()):
        for name, value in sorted(state.items()):
            add(f"opt/{index}/{name}", value)
    add("opt/param_groups", opt_state["param_groups"])
    return h.hexdigest()


def save(ckpt: spotrun.Checkpointer, step: int, args: argparse.Namespace, rank: int) -> bool:
    """Save ``step`` as asked; True when a save ran (it raises when it failed)."""
    if args.emergency_deadline_s is None:
        ckpt.save(step, reason="test")
        return True
    if rank == 0:
        now_s = time.time()
        control.write_save_request(
            os.environ[CONTROL_DIR],
            control.SaveRequest("test notice", now_s, now_s + args.emergency_deadline_s),
        )
    return ckpt.end_of_step(step)


def main() -> int:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format=f"[rank {rank}] %(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("spotrun").setLevel(logging.INFO)
    storage = open_storage(
        args.uri, multipart_threshold_bytes=5 * MIB, part_size_bytes=5 * MIB, max_part_size_bytes=5 * MIB
    )
    model, opt = build(seed=99 if args.restore else 0)
    ckpt = spotrun.Checkpointer(
        state={"model": model, "optimizer": opt},
        storage=storage,
        save_timeout_s=args.save_timeout_s,
        handle_signals=False,
    )
    result: dict = {"rank": rank, "restored": None, "saves": []}
    if args.restore:
        restored_step = ckpt.restore()
        result["restored"] = {"step": restored_step, "digest": digest(model, opt)}
    for step in args.save_steps:
        train_step(model, opt, step)
        started_s = time.monotonic()
        entry: dict = {"step": step, "ok": False, "error": None, "digest": None}
        try:
            if save(ckpt, step, args, rank):
                entry.update(ok=True, digest=digest(model, opt))
            else:
                entry["error"] = "no save ran: the save request was not seen"
        except CheckpointSaveError as exc:
            entry["error"] = str(exc)
        entry["elapsed_s"] = time.monotonic() - started_s
        result["saves"].append(entry)
    with open(os.path.join(args.out_dir, f"rank-{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    ckpt.close()
    dist.barrier()  # no rank tears gloo down while a peer still receives
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
