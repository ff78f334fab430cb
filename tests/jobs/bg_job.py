"""Worker for tests/unit/train/test_background_saves.py: trains a small deterministic model with background
periodic saves, and holds the background write of one step until the test lets it go.

Usage (alone, under torchrun, or under `spotrun run -- torchrun`):
    python bg_job.py CKPT_DIR_OR_S3_URI OUT_DIR --steps N --interval K [--gate-from S] [--gate-parts-from P]
                     [--gate-memory-from M] [--hold-at H] [--dump-at D ...] [--max-file-bytes B] [--slow-progress]

* ``--gate-from S``: on this rank, the first save of a step >= S holds its shard writes (of
  parts >= ``--gate-parts-from``, default 0): it writes OUT_DIR/blocked-rank-R (the step),
  then waits until the test opens the FIFO OUT_DIR/release-rank-R (made by the test) for
  writing. Writes after that pass. So the test knows the background write is in progress.
* ``--gate-memory-from M``: the same for the fast tier's saves (``spotrun run --memory-interval-steps``):
  the first of a step >= M writes OUT_DIR/blocked-memory-rank-R, then waits on the FIFO
  OUT_DIR/release-memory-rank-R.
* ``--hold-at H``: before ``end_of_step(H)``, wait until the supervisor's (or the test's)
  save request exists in ``$SPOTRUN_CONTROL_DIR``, so that every rank sees it at step H.
* ``--dump-at D``: after step D, write the model and optimizer tensors to
  OUT_DIR/state-D-rank-R.safetensors (the state at that step boundary).
* ``--slow-progress``: every save in flight reports that its write needs 1e6 s more (the
  emergency decision then sees a save in flight that cannot finish in time).
Each rank appends its progress to OUT_DIR/progress-rank-R (one step per line) and writes
OUT_DIR/result-rank-R.json at the end: {"resumed", "stopped_at", "last_saved_step", "preempted"}.
"""

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import spotrun
from spotrun.checkpoint import save as save_module
from spotrun.control import files as control
from spotrun.storage import LocalStorage
from spotrun.storage.s3 import S3Storage
from spotrun.train import fast_tier

parser = argparse.ArgumentParser()
parser.add_argument("ckpt_dir")
parser.add_argument("out_dir")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--interval", type=int, required=True)
parser.add_argument("--gate-from", type=int, default=None)
parser.add_argument("--gate-parts-from", type=int, default=0)
parser.add_argument("--gate-memory-from", type=int, default=None)
parser.add_argument("--hold-at", type=int, default=None)
parser.add_argument("--dump-at", type=int, action="append", default=[])
parser.add_argument("--max-file-bytes", type=int, default=4 * 2**30)
parser.add_argument("--slow-progress", action="store_true")
args = parser.parse_args()

logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s", stream=sys.stderr)
distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
rank = dist.get_rank() if distributed else 0
out = args.out_dir
if args.slow_progress:
    save_module.SaveProgress.remaining_s = lambda self: 1e6


def write_atomically(path: str, text: str) -> None:
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


class Gate:
    """Holds the shard writes of the first save of a step >= --gate-from until the test releases it
    (a mixin over a storage backend)."""

    gated_step = None
    released = False
    tier = ""  # the files' infix: "" for storage, "memory-" for the fast tier

    def gate_from(self) -> int | None:
        return args.gate_from

    def _hold(self, key: str) -> None:
        if self.gate_from() is None or self.released or not key.startswith("step-") or "/rank-" not in key:
            return
        step = int(key.split("/")[0].removeprefix("step-"))
        part = int(key.rsplit(".part-", 1)[1].split(".")[0]) if ".part-" in key else 0
        if step < self.gate_from() or part < args.gate_parts_from:
            return
        if self.gated_step is None:
            self.gated_step = step
        if step != self.gated_step:
            return
        write_atomically(os.path.join(out, f"blocked-{self.tier}rank-{rank}"), str(step))
        print(
            f"bg_job: rank {rank} holds its {self.tier or 'storage-'}write of step {step}", file=sys.stderr, flush=True
        )
        with open(os.path.join(out, f"release-{self.tier}rank-{rank}"), "rb") as fifo:  # blocks until opened
            fifo.read()
        self.released = True

    def put(self, key, data):
        self._hold(key)
        super().put(key, data)

    def put_stream(self, key, source, **kwargs):
        self._hold(key)
        super().put_stream(key, source, **kwargs)


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)


class GatedStorage(Gate, LocalStorage):
    pass


class GatedS3Storage(Gate, S3Storage):
    pass


class GatedMemoryStorage(Gate, LocalStorage):
    """The fast tier's root (the Checkpointer makes it with ``LocalStorage(root)``), gated by --gate-memory-from."""

    tier = "memory-"

    def gate_from(self) -> int | None:
        return args.gate_memory_from


if args.gate_memory_from is not None:
    fast_tier.LocalStorage = GatedMemoryStorage


storage = (
    GatedS3Storage.from_uri(args.ckpt_dir)
    if args.ckpt_dir.startswith("s3://")
    else GatedStorage(args.ckpt_dir, fsync=False)
)
ckpt = spotrun.Checkpointer(
    {"model": model, "optimizer": opt},
    storage=storage,
    interval_steps=args.interval,
    max_file_size_bytes=args.max_file_bytes,
)
step = resumed = ckpt.restore()
stopped = False
while step < args.steps:
    data = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 32, generator=data)
    loss = (model(x) - x).pow(2).mean() + 1e-3 * torch.randn(()).abs()  # draws from the global RNG too
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    with open(os.path.join(out, f"progress-rank-{rank}"), "a") as f:
        f.write(f"{step}\n")
    if step in args.dump_at:
        tensors = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
        for index, state in opt.state_dict()["state"].items():
            tensors.update({f"optimizer/{index}/{k}": v.clone() for k, v in state.items()})
        tensors["rng"] = torch.get_rng_state()
        save_file(tensors, os.path.join(out, f"state-{step}-rank-{rank}.safetensors"))
    if step == args.hold_at:
        control_dir = os.environ["SPOTRUN_CONTROL_DIR"]
        while not control.save_requested(control_dir):  # the test's cue; no timing is assumed
            time.sleep(0.01)
    if ckpt.end_of_step(step):
        stopped = True
        break
if not stopped:
    ckpt.save(step, reason="final")
ckpt.close()
write_atomically(
    os.path.join(out, f"result-rank-{rank}.json"),
    json.dumps(
        {"resumed": resumed, "stopped_at": step, "last_saved_step": ckpt.last_saved_step, "preempted": ckpt.preempted}
    ),
)
if distributed:
    dist.barrier()
    dist.destroy_process_group()
from exit_without_teardown import exit_without_teardown

exit_without_teardown(0)
