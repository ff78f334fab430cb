"""A one-process training job for ``spotrun drill``'s exact check.

Usage: python noisy_job.py --steps N [--step-sleep-s S] [--noise pid|torch]

Its "model" is one float32 tensor of shape (4,), checkpointed every step through
:class:`spotrun.Checkpointer` (root from ``$SPOTRUN_CHECKPOINT_URI``). Every update adds noise:

* ``--noise pid`` (default): from a torch generator seeded with the process id, state that
  spotrun cannot know about, so a resumed run diverges from an uninterrupted one although
  every checkpoint restores fine (the job does NOT resume exactly);
* ``--noise torch``: from torch's global generator, which spotrun saves and restores with
  every checkpoint (the job resumes exactly).

The global generators (Python, NumPy, torch) are seeded at start, so nothing else differs.
Exits 0 after the last step or after an emergency checkpoint.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import numpy as np
import torch

import spotrun


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--noise", choices=("pid", "torch"), default="pid")
    args = p.parse_args()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = {"w": torch.zeros(4)}  # (4,) float32
    ckpt = spotrun.Checkpointer({"model": model}, interval_steps=1)
    noise = torch.Generator().manual_seed(os.getpid()) if args.noise == "pid" else None
    step = ckpt.restore()
    try:
        while step < args.steps:
            step += 1
            model["w"] += torch.randn(4, generator=noise)
            time.sleep(args.step_sleep_s)
            if ckpt.end_of_step(step):
                return 0
        ckpt.save(step, reason="final")
    finally:
        ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
