"""torchrun worker for tests/e2e/test_stopped_rank.py: a small deterministic job whose gradients
go through its own all-reduce on the default group (as DDP's: spotrun cannot bound it), with
spotrun's checkpoints, and one rank that stops itself (SIGSTOP) once, at a chosen point.

Usage (under `spotrun run -- torchrun --standalone --nproc-per-node 3`):
    hang_job.py OUT_DIR --steps N --interval K [--sync-saves] [--save-timeout-s S] [--step-s S]
                [--stop RANK:save:STEP | RANK:restore | RANK:notice:STEP]

* ``--stop R:save:S``: rank R stops while writing its shard of step S's save (synchronous, or on
  the background saver's thread);
* ``--stop R:restore``: rank R stops while reading a step at a restore;
* ``--stop R:notice:H``: every rank waits before ``end_of_step(H)`` until the supervisor's save
  request is there (so that all of them see it at step H), then rank R stops (before the
  agreement on it).

The rank that stops writes OUT_DIR/stopped (the time, ``time.time()``) first; it stops once per
OUT_DIR. Every worker writes OUT_DIR/pid-rank-R-PID (the test's teardown ends a stopped one),
appends ``{"step", "loss"}`` lines to OUT_DIR/losses-rank-R.jsonl, and rank 0 writes
OUT_DIR/final.json (the weights, exactly) when the last step is done.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import spotrun
from spotrun.control import files as control

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--interval", type=int, required=True)
parser.add_argument("--sync-saves", action="store_true")
parser.add_argument("--save-timeout-s", type=float, default=300.0)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--stop", default="")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
out = args.out_dir
with open(os.path.join(out, f"pid-rank-{rank}-{os.getpid()}"), "w") as f:
    f.write(str(os.getpid()))
victim, _, where = args.stop.partition(":")
victim = int(victim) if victim else -1


def stop_here() -> None:
    """SIGSTOP this process, once per OUT_DIR (the marker says when)."""
    try:
        fd = os.open(os.path.join(out, "stopped"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, repr(time.time()).encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGSTOP)


torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
ckpt = spotrun.Checkpointer(
    {"model": model, "optimizer": optimizer},
    interval_steps=args.interval,
    background_saves=not args.sync_saves,
    save_timeout_s=args.save_timeout_s,
)
storage = ckpt.storage
if rank == victim and where.startswith("save:"):
    saving_step = int(where.split(":")[1])
    put_stream = storage.put_stream

    def stopping_put_stream(key, source, **kwargs):
        if f"step-{saving_step:09d}/" in key:
            stop_here()
        return put_stream(key, source, **kwargs)

    storage.put_stream = stopping_put_stream
if rank == victim and where == "restore":

    def stopping(read):
        def stopping_read(key, *a, **kwargs):
            if "step-" in key:
                stop_here()
            return read(key, *a, **kwargs)

        return stopping_read

    storage.get, storage.read_into = stopping(storage.get), stopping(storage.read_into)

start = ckpt.restore()
control_dir = os.environ.get("SPOTRUN_CONTROL_DIR")
with open(os.path.join(out, f"losses-rank-{rank}.jsonl"), "a") as losses:
    for step in range(start + 1, args.steps + 1):
        data = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=data)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # the job's own collective, on its default group
            dist.all_reduce(p.grad)
            p.grad /= world_size
        optimizer.step()
        losses.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        losses.flush()
        time.sleep(args.step_s)
        held = where.startswith("notice:") and step == int(where.split(":")[1]) and control_dir
        if held and not os.path.exists(os.path.join(out, "stopped")):  # a notice once, for this OUT_DIR
            while not control.save_requested(control_dir):
                time.sleep(0.05)
            if rank == victim:
                stop_here()
        if ckpt.end_of_step(step):
            sys.exit(0)
if rank == 0:
    weights = {n: p.detach().flatten().tolist() for n, p in model.state_dict().items()}
    with open(os.path.join(out, "final.json"), "w") as f:
        json.dump({"step": args.steps, "weights": weights}, f)
ckpt.close()
dist.barrier()
dist.destroy_process_group()
