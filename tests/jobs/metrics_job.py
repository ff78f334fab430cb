"""Worker for tests/unit/supervisor/test_metrics.py and tests/unit/tools/test_log_format.py: one process (no torchrun)
training a tiny model with spotrun's Checkpointer and synchronous periodic saves, logging
through spotrun.tools.logs (the format the supervisor passes in $SPOTRUN_LOG_FORMAT).

Usage: python metrics_job.py OUT_DIR [--interval K] [--crash-after-save]
Runs until the supervisor asks for a save (then saves, exits 0). Writes OUT_DIR/step (the
newest step trained) at each step. ``--crash-after-save``: on a fresh start, exit 3 right
after the first periodic save committed (so that ``--max-restarts`` restarts it and the
restart restores that step).
"""

import argparse
import logging
import os
import pathlib
import sys
import time

import torch

import spotrun
from spotrun.tools.logs import configure_logging

parser = argparse.ArgumentParser()
parser.add_argument("out_dir", type=pathlib.Path)
parser.add_argument("--interval", type=int, default=10)
parser.add_argument("--crash-after-save", action="store_true")
args = parser.parse_args()

configure_logging(logging.INFO, prefix="[rank 0]", fields={"rank": 0})
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = spotrun.Checkpointer({"model": model, "optimizer": opt}, interval_steps=args.interval, background_saves=False)
step = ckpt.restore()
fresh = step == 0
while True:
    time.sleep(0.05)  # a "training step" that leaves the machine to the others
    loss = model(torch.randn(4, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    tmp = args.out_dir / "step.tmp"
    tmp.write_text(str(step))
    os.replace(tmp, args.out_dir / "step")
    if ckpt.end_of_step(step):
        break
    if args.crash_after_save and fresh and ckpt.last_saved_step:
        logging.getLogger("metrics_job").error("crashing after the save of step %d, as asked", step)
        sys.exit(3)
ckpt.close()
