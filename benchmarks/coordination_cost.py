"""Benchmark: what the per-step save-request check costs (prints figures; not a test).

Every step, ``Checkpointer.end_of_step`` stats the node's request file and runs one
small all-reduce (on spotrun's own gloo group, bounded: docs/reference/timeouts.md) so that all
ranks agree whether to save. This prints the mean time of
that call per step, next to an empty loop, for ``check_interval_steps`` 1 and 10.

Run:  torchrun --standalone --nproc-per-node 2 benchmarks/coordination_cost.py [--steps 2000]
(the agreement runs on gloo on CPU whatever the job's backend: no device sync on GPUs).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist

import spotrun
from spotrun.storage import LocalStorage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as root:
        figures = {}
        for interval in (1, 10):
            ckpt = spotrun.Checkpointer(
                {"x": {"v": 0}}, storage=LocalStorage(root), handle_signals=False, check_interval_steps=interval
            )
            dist.barrier()
            started = time.perf_counter()
            for step in range(1, args.steps + 1):
                ckpt.end_of_step(step)
            figures[interval] = (time.perf_counter() - started) / args.steps
        dist.barrier()
        started = time.perf_counter()
        for _step in range(1, args.steps + 1):
            pass
        empty_s = (time.perf_counter() - started) / args.steps
    if dist.get_rank() == 0:
        print(f"world size {dist.get_world_size()}, backend {backend}, {args.steps} steps")
        print(f"empty loop:                                {empty_s * 1e6:8.2f} us/step")
        for interval, per_step_s in figures.items():
            print(f"end_of_step, check_interval_steps={interval:<3}: {per_step_s * 1e6:8.2f} us/step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
