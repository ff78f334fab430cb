"""torchrun worker for test_slow_save_and_torchrun_kill_clock.py (field case C08): trains a
tiny model and takes SLOW_SAVE_S seconds to write its shard of every checkpoint (a slow disk
or a big model), then reports how it ended.

Usage: torchrun --nproc-per-node 2 slow_save.py OUT_DIR   (checkpoint URI from the supervisor)
Each rank writes OUT_DIR/rank-R.json = {"step", "save_s", "exit": 0} just before exiting 0,
so a rank killed by SIGKILL leaves no file.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from exit_without_teardown import exit_without_teardown

import spotrun
from spotrun.control.env import WorkerEnv
from spotrun.storage import LocalStorage

SLOW_SAVE_S = float(os.environ.get("SLOW_SAVE_S", "45"))


class SlowStorage(LocalStorage):
    def put_stream(self, key, source, **kwargs):  # a shard file: slow
        time.sleep(SLOW_SAVE_S)
        super().put_stream(key, source, **kwargs)


out_dir = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = spotrun.Checkpointer(
    {"model": model, "optimizer": opt}, storage=SlowStorage(WorkerEnv.from_environ().checkpoint_uri)
)
step = ckpt.restore()
while True:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if rank == 0:
        with open(os.path.join(out_dir, "progress"), "w") as f:
            f.write(str(step))
    started = time.monotonic()
    if ckpt.end_of_step(step):
        break
    time.sleep(0.05)
report = {"step": step, "save_s": time.monotonic() - started, "exit": 0}
with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
dist.barrier()  # no rank tears gloo down while a peer still receives
dist.destroy_process_group()
exit_without_teardown(0)
