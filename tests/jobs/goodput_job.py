"""torchrun worker for tests/e2e/test_goodput_report.py: a tiny DDP model trained with spotrun
checkpoints, each step taking about ``--step-s`` seconds (a sleep stands in for the compute),
logging its own timeline.

Usage: torchrun --nproc-per-node 2 goodput_job.py CKPT_URI LOG_FILE OUT_DIR --steps N --interval K
           --step-s S [--hold-after H] [--hold-for-notice-at H]

Rank 0 appends to LOG_FILE one JSON line ``{"event": "restored", "step": R, "time_unix_s": T}``
when ``restore()`` returned, then ``{"step": s, "time_unix_s": T}`` as each step ends, just
before ``end_of_step(s)``.

* ``--hold-after H``: after ``end_of_step(H)``, every rank stops making progress and rank 0
  writes OUT_DIR/held-H: the job waits there to be killed.
* ``--hold-for-notice-at H``: after step H's compute, rank 0 writes OUT_DIR/held-H and waits
  until the supervisor's save request exists in ``$SPOTRUN_CONTROL_DIR``, then logs step H and
  calls ``end_of_step(H)``, so the emergency checkpoint is of step H.
"""

import argparse
import json
import os
import threading
import time

import torch
import torch.distributed as dist

import spotrun
from spotrun.control import files as control

parser = argparse.ArgumentParser()
parser.add_argument("ckpt_uri")
parser.add_argument("log_file")
parser.add_argument("out_dir")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--interval", type=int, required=True)
parser.add_argument("--step-s", type=float, required=True)
parser.add_argument("--hold-after", type=int, default=None)
parser.add_argument("--hold-for-notice-at", type=int, default=None)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
log_file = open(args.log_file, "a", encoding="utf-8") if rank == 0 else None


def log(**record) -> None:
    if log_file is not None:
        log_file.write(json.dumps({**record, "time_unix_s": time.time()}) + "\n")
        log_file.flush()


def mark_held(step: int) -> None:
    if rank == 0:
        with open(os.path.join(args.out_dir, f"held-{step}"), "w") as f:
            f.write(str(step))


ckpt = spotrun.Checkpointer(state={"model": model, "optimizer": opt}, uri=args.ckpt_uri, interval_steps=args.interval)
step = ckpt.restore()
log(event="restored", step=step)
stopped = False
while step < args.steps:
    x = torch.randn(4, 8)
    loss = ddp(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(args.step_s)  # the rest of a realistic step's compute
    step += 1
    if step == args.hold_for_notice_at and rank == 0:
        mark_held(step)
        while not control.save_requested(os.environ["SPOTRUN_CONTROL_DIR"]):  # the test's cue
            time.sleep(0.01)
    log(step=step)
    if ckpt.end_of_step(step):
        stopped = True
        break
    if step == args.hold_after:
        mark_held(step)
        threading.Event().wait()  # until killed
if not stopped:
    ckpt.save(step, reason="final")
ckpt.close()
dist.barrier()
dist.destroy_process_group()
from exit_without_teardown import exit_without_teardown

exit_without_teardown(0)
