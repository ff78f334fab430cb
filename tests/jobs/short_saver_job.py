"""A one-process training job for tests of read-only tools and the report: a small state
saved every ``--interval`` steps (the root and the retention from ``spotrun run``'s environment,
or ``--root``/``--keep-last``), until ``STEPS`` or until the file ``--stop-file`` exists.

Usage: python short_saver_job.py STEPS [--interval N] [--root DIR --keep-last N] [--stop-file PATH]
"""

import argparse
import os

import torch

import spotrun

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("--interval", type=int, default=1)
parser.add_argument("--root", default=None)
parser.add_argument("--keep-last", type=int, default=None)
parser.add_argument("--stop-file", default=None)
parser.add_argument("--tensors", type=int, default=4, help="tensors of 256 KiB each in the model")
args = parser.parse_args()
state = {"model": {f"w{i}": torch.full((256, 256), float(i)) for i in range(args.tensors)}}
ckpt = spotrun.Checkpointer(state, uri=args.root, interval_steps=args.interval, keep_last=args.keep_last)
step = ckpt.restore()
while step < args.steps and not (args.stop_file and os.path.exists(args.stop_file)):
    step += 1
    for tensor in state["model"].values():
        tensor += 1.0
    if ckpt.end_of_step(step):
        break
ckpt.close()
print(f"trained to step {step}", flush=True)
