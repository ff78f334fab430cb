"""Benchmark: what the per-step save/stop agreement costs (prints figures; not a test).

At every look (``check_interval_steps``), ``Checkpointer.end_of_step`` reads the node's request
file and runs one all-reduce of a few flags on spotrun's gloo group, so that every rank decides
the same at the same step. ``immediate`` waits for it at the look; ``pipelined`` starts it at one
look and reads it at the next, so it runs while the next step computes. This prints, per step,
the time ``end_of_step`` adds to a step of ``--compute-ms`` (a sleep: the CPU is free, as while a
GPU computes), for both agreements and ``check_interval_steps`` 1 and 10, and the bare all-reduce
(its latency is what grows with the rank count).

Run:  torchrun --standalone --nproc-per-node 2 benchmarks/coordination_cost.py [--steps 500] [--compute-ms 5]
(more ranks than cores measures the machine's contention, not the agreement: say so with the figures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import spotrun
from spotrun.storage import LocalStorage
from spotrun.tools import dist as spotrun_dist


def per_step_s(ckpt: spotrun.Checkpointer | None, steps: int, compute_s: float) -> float:
    """Mean wall time per step of ``steps`` steps of ``compute_s`` each (with ``end_of_step`` when ``ckpt``)."""
    dist.barrier()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        time.sleep(compute_s)
        if ckpt is not None:
            ckpt.end_of_step(step)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--compute-ms", type=float, default=5.0, help="the simulated compute of one step")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is printed")
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    compute_s = args.compute_ms / 1000
    cases = [(agreement, interval) for agreement in ("immediate", "pipelined") for interval in (1, 10)]
    figures: dict[object, list[float]] = {case: [] for case in [*cases, "bare", "all-reduce"]}
    with tempfile.TemporaryDirectory() as root:
        checkpointers = {
            (agreement, interval): spotrun.Checkpointer(
                {"x": {"v": 0}},
                storage=LocalStorage(root),
                handle_signals=False,
                check_interval_steps=interval,
                agreement=agreement,
            )
            for agreement, interval in cases
        }
        for _round in range(args.rounds):  # interleaved, so a busy moment spreads over every case
            figures["bare"].append(per_step_s(None, args.steps, compute_s))
            for case in cases:
                figures[case].append(per_step_s(checkpointers[case], args.steps, compute_s) - figures["bare"][-1])
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.steps):
                spotrun_dist.any_rank_each([False] * 6, timeout_s=60, what="the benchmark's all-reduce")
            figures["all-reduce"].append((time.perf_counter() - started) / args.steps)
        for ckpt in checkpointers.values():
            ckpt.close()
    if dist.get_rank() == 0:
        median = {case: statistics.median(values) for case, values in figures.items()}
        print(
            f"world size {dist.get_world_size()} on {os.cpu_count()} CPU(s), backend {backend} (agreement on gloo), "
            f"{args.steps} steps of {args.compute_ms:g} ms x {args.rounds} rounds (median)"
        )
        print(f"the all-reduce alone (6 flags):            {median['all-reduce'] * 1e6:8.1f} us")
        for agreement, interval in cases:
            added = median[(agreement, interval)]
            print(
                f"end_of_step {agreement:<9}, check_interval_steps={interval:<3}: {added * 1e6:8.1f} us/step added "
                f"({added / median['bare'] * 100:5.2f} % of a step)"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
