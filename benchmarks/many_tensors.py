"""Save and restore a state of very many small tensors; prints the figures (not a test).

    python benchmarks/many_tensors.py                       # 1.3 million tensors (issue 8, item 5)
    python benchmarks/many_tensors.py --count 120000 --name-length 800
    python benchmarks/many_tensors.py --profile             # cProfile's top entries of each phase

One process, no process group, a local checkpoint root in a temporary directory, default
ShardLimits (4 GiB files, 16 MiB headers) unless given. Each tensor is 4 float32 values
under a name like ``model/layers.000123.scale`` (padded to ``--name-length``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.shard import DEFAULT_MAX_FILE_SIZE_BYTES, DEFAULT_MAX_HEADER_BYTES
from spotrun.storage import LocalStorage


def build(count: int, name_length: int, fill: bool) -> dict[str, torch.Tensor]:
    state = {}
    for i in range(count):
        name = f"layers.{i:09d}.scale"
        name = name + "x" * max(0, name_length - len(name))
        state[name] = torch.full((4,), float(i)) if fill else torch.zeros(4)
    return state


def timed(label: str, profile: bool, fn):
    profiler = cProfile.Profile() if profile else None
    started, started_cpu = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    result = fn()
    if profiler:
        profiler.disable()
    print(
        f"{label}: {time.perf_counter() - started:.1f} s wall, {time.process_time() - started_cpu:.1f} s CPU",
        flush=True,
    )
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=1_300_000)
    parser.add_argument("--name-length", type=int, default=0, help="pad tensor names to this many characters")
    parser.add_argument("--max-file-size-bytes", type=int, default=DEFAULT_MAX_FILE_SIZE_BYTES)
    parser.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    limits = {"max_file_size_bytes": args.max_file_size_bytes, "max_header_bytes": args.max_header_bytes}

    with tempfile.TemporaryDirectory(prefix="spotrun-many-") as root:
        state = timed("build state", False, lambda: build(args.count, args.name_length, fill=True))
        ckpt = spotrun.Checkpointer(
            {"model": state}, storage=LocalStorage(root, fsync=False), handle_signals=False, **limits
        )
        timed("save", args.profile, lambda: ckpt.save(1))  # noqa: F821 (called at once, before the del)
        manifest = catalog.committed(LocalStorage(root), 1).manifest
        print(
            f"{len(manifest.tensors)} tensors in {len(manifest.files)} file(s), "
            f"{manifest.size_bytes / 2**20:.1f} MiB of shards"
        )
        del ckpt
        restored = build(args.count, args.name_length, fill=False)
        ckpt2 = spotrun.Checkpointer(
            {"model": restored}, storage=LocalStorage(root, fsync=False), handle_signals=False, **limits
        )
        step = timed("restore", args.profile, ckpt2.restore)
        same = (
            step == 1 and restored.keys() == state.keys() and all(torch.equal(restored[k], v) for k, v in state.items())
        )
        print(f"restored step {step}, exact: {same}")


if __name__ == "__main__":
    main()
