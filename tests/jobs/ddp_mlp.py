"""A user's script of the README's shape on DDP (torchrun, several ranks): a multi-layer MLP whose
DDP rebuilds its gradient buckets after its first step, trained with momentum so that any drift
in a gradient's last bits stays in the weights. Used by spotrun drill in test_ddp_exact_resume.

Usage: [spotrun drill ... --] torchrun --standalone --nproc-per-node N ddp_mlp.py [STEPS [STEP_SLEEP_S]]
The checkpoints go where $SPOTRUN_CHECKPOINT_URI says (spotrun run and drill set it).
(a drill's notice needs the steps to take a while: it arrives after a step it sees logged)
"""

import random
import sys
import time

import numpy
import torch
import torch.distributed as dist

import spotrun

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
step_sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
dist.init_process_group("gloo")
torch.manual_seed(0)  # every generator, as the README says: the drill compares them all
random.seed(0)
numpy.random.seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)
)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
dataset = torch.utils.data.TensorDataset(torch.randn(4096, 32), torch.randint(0, 8, (4096,)))
loader = spotrun.ResumableDataLoader(dataset, batch_size=16, shuffle=True, seed=0)
ckpt = spotrun.Checkpointer(state={"model": model, "optimizer": opt, "data": loader}, interval_steps=4)
step = ckpt.restore()
while step < steps:
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        time.sleep(step_sleep_s)
        if ckpt.end_of_step(step):
            raise SystemExit(0)
        if step >= steps:
            break
ckpt.close()
dist.destroy_process_group()
