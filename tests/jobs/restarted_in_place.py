"""Worker for tests/e2e/test_supervisor_elastic.py: a job whose workers torchrun starts again within one
launch after they took an emergency checkpoint, as it does when a node joins or leaves an elastic
job (it stops the workers with SIGTERM, on which they save, then starts them on the new count).

Usage: torchrun --max-restarts 1 --nproc-per-node 1 restarted_in_place.py STEPS INTERVAL
(the checkpoint root comes from the supervisor). On torchrun's first attempt
(``TORCHELASTIC_RESTART_COUNT=0``) the worker sends itself SIGTERM after step 3, takes the
emergency checkpoint of that step, and exits 1 so that torchrun's ``--max-restarts`` starts it
again (the stand-in for torchrun's restart on a node change, which needs a second node and a
different world size). The second attempt resumes and trains to STEPS with periodic saves and a
final one, and exits 0.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown

import spotrun

steps, interval = int(sys.argv[1]), int(sys.argv[2])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = spotrun.Checkpointer({"model": model, "optimizer": opt}, interval_steps=interval)
step = ckpt.restore()
print(f"attempt {attempt} resumed at step {step}", file=sys.stderr, flush=True)
stopped = False
while step < steps:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if attempt == 0 and step == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # what torchrun sends its workers on a node change
    if ckpt.end_of_step(step):
        stopped = True
        break
if not stopped:
    ckpt.save(step, reason="final")
ckpt.close()
dist.destroy_process_group()
exit_without_teardown(1 if stopped and attempt == 0 else 0)
