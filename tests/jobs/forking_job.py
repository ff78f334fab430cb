"""Worker for tests/unit/train/test_fork_safety.py: a training loop that forks in every way a user's
script does while spotrun's background saves (thread, process group, staging threads) and
event log exist, then ends without calling ``Checkpointer.close()``.

Usage (under torchrun): python forking_job.py CKPT_DIR OUT_DIR --epochs E
Each epoch iterates one loader of every kind (fork, forkserver and spawn workers, persistent
or not, a plain torch DataLoader and spotrun's ResumableDataLoader), then maps a
``multiprocessing.Pool`` (fork) and runs a ``subprocess``. A background
save is started at every step, so one is in flight or just done at every fork. Each rank
writes OUT_DIR/result-rank-R.json at the end: the steps trained.
"""

import argparse
import json
import logging
import multiprocessing
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import spotrun


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([float(i * i)])


def square(x):
    return x * x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(process)d %(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = Squares()
    # Every start method, persistent or not, spotrun's loader and torch's; a loader's workers
    # are forked anew at each epoch unless persistent. spawn and forkserver workers import
    # torch (seconds each): one worker each.
    resumable = lambda **kw: spotrun.ResumableDataLoader(dataset, batch_size=4, shuffle=True, seed=0, **kw)  # noqa: E731
    plain = lambda **kw: torch.utils.data.DataLoader(dataset, batch_size=4, **kw)  # noqa: E731
    loaders = {
        "resumable-fork": resumable(num_workers=2, multiprocessing_context="fork"),
        "resumable-fork-persistent": resumable(num_workers=2, multiprocessing_context="fork", persistent_workers=True),
        "torch-fork": plain(num_workers=2, multiprocessing_context="fork"),
        "torch-fork-persistent": plain(num_workers=2, multiprocessing_context="fork", persistent_workers=True),
        "resumable-forkserver": resumable(num_workers=1, multiprocessing_context="forkserver"),
        "resumable-spawn-persistent": resumable(
            num_workers=1, multiprocessing_context="spawn", persistent_workers=True
        ),
        "torch-spawn": plain(num_workers=1, multiprocessing_context="spawn"),
    }
    ckpt = spotrun.Checkpointer({"model": model, "optimizer": opt}, uri=args.ckpt_dir, interval_steps=1)
    step = ckpt.restore()
    for _ in range(args.epochs):
        for name, loader in loaders.items():
            print(f"rank {rank} epoch loader {name} from step {step}", file=sys.stderr, flush=True)
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                ckpt.end_of_step(step)
        with multiprocessing.get_context("fork").Pool(2) as pool:
            assert pool.map(square, range(4)) == [0, 1, 4, 9]
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with open(os.path.join(args.out_dir, f"result-rank-{rank}.json"), "w") as f:
        json.dump({"steps": step}, f)
    # No ckpt.close(): the exit hooks finish the save in flight in this process only.


if __name__ == "__main__":
    main()
