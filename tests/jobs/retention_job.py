"""torchrun worker for test_retention: a tiny replicated state saved at every step under
``spotrun run`` (the checkpoint root and the retention come from the supervisor's
environment only: the Checkpointer is given neither).

Usage: torchrun --nproc-per-node 2 retention_job.py STEPS
"""

import logging
import sys

import torch
import torch.distributed as dist

import spotrun

steps = int(sys.argv[1])
logging.basicConfig(level=logging.INFO, format="worker: %(name)s: %(message)s")
dist.init_process_group("gloo")
state = {"model": {"w": torch.zeros(8)}}
ckpt = spotrun.Checkpointer(state, interval_steps=1)
step = ckpt.restore()
while step < steps:
    step += 1
    state["model"]["w"] += 1.0
    if ckpt.end_of_step(step):
        break
ckpt.close()
dist.barrier()
dist.destroy_process_group()
from exit_without_teardown import exit_without_teardown

exit_without_teardown(0)
