"""torchrun worker for test_clean_exit: a script as the README shows it (a Checkpointer, end_of_step,
close, destroy_process_group, then a normal return), which records how many of gloo's threads are
left when Python starts to finalize: any left then may take the GIL to free a finished collective
and abort the process ("terminate called without an active exception").

Usage: torchrun --standalone --nproc-per-node 2 exit_threads.py WORK_DIR AGREEMENT SAVE_MODE
SAVE_MODE: ``background`` or ``synchronous``. Writes WORK_DIR/rank-R.json: the names of gloo's
threads after init_process_group and at the exit (one ``gloo_tcp_loop`` per live process group).
"""

import atexit
import json
import os
import sys

work, agreement, save_mode = sys.argv[1], sys.argv[2], sys.argv[3]
rank = int(os.environ["RANK"])
seen: dict[str, list[str]] = {}


def gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as file:
                name = file.read().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def at_exit() -> None:
    # registered before spotrun is imported: atexit runs its handlers last in, first out, so this
    # one runs after spotrun's, just before Python finalizes
    seen["at_exit"] = gloo_threads()
    with open(os.path.join(work, f"rank-{rank}.json"), "w") as file:
        json.dump(seen, file)


atexit.register(at_exit)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import spotrun  # noqa: E402

dist.init_process_group("gloo")
seen["after_init"] = gloo_threads()
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = spotrun.Checkpointer(
    {"model": model, "optimizer": opt},
    uri=os.path.join(work, "ck"),
    interval_steps=2,
    background_saves=save_mode == "background",
    agreement=agreement,
    handle_signals=False,
)
start = ckpt.restore()
for step in range(start + 1, start + 6):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    ckpt.end_of_step(step)
ckpt.close()
dist.destroy_process_group()
