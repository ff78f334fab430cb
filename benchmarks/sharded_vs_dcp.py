"""spotrun against DCP on a sharded (FSDP2) state: save, and restore on the same layout and
resharded, with the bytes each rank reads.

    python benchmarks/sharded_vs_dcp.py [--size-mib 288] [--rounds 3] [--dir DIR]

One training state: a float32 model of square ``Linear(2048, 2048)`` layers with biases and its
AdamW state after one step (``--size-mib`` MiB in all, at least 256 for issue 10), under FSDP2
(``fully_shard`` per layer, ``Shard(0)``) on 2 ranks (torchrun, gloo, CPU), on local disk:

1. saves on 2 ranks: spotrun ``Checkpointer.save`` vs DCP ``save`` of ``get_state_dict``
   (both durable: files fsynced), interleaved, the order rotating each round;
2. cold restores of the last round's checkpoints, interleaved the same way, spotrun
   ``restore`` vs DCP ``load`` + ``set_state_dict``, into: the same layout (2 ranks,
   ``Shard(0)``); 1 rank without DTensors; 2 ranks with rowwise ``Shard(1)`` weights; 3 ranks
   with ``Shard(0)`` (a new torchrun per layout, each building the model with another seed).

Prints median seconds (of ``--rounds``, after one warm-up round), the ratio spotrun / DCP,
bytes read per rank (``rchar`` of ``/proc/self/io``: what each process passed through read
system calls - files, and a few KiB of the collectives' sockets; ``read_bytes``: what the kernel
read from the device, read-ahead included; spotrun's own ``restore_bytes_read``), each rank's
share (the bytes of its own part of every tensor), and whether every tensor, gathered to full,
is bit-identical to the saved one after each tool's restore. No timing asserts.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path[:0] = [BENCH_DIR, REPO_ROOT]

MIB = 2**20
#: (phase, layout, ranks, label)
RUNS = [
    ("save", "fsdp0", 2, "2 ranks, Shard(0) (as saved)"),
    ("restore", "plain", 1, "1 rank, no DTensors"),
    ("restore", "fsdp1", 2, "2 ranks, rowwise Shard(1)"),
    ("restore", "fsdp0", 3, "3 ranks, Shard(0)"),
]


def torchrun(root: str, phase: str, layout: str, ranks: int, args: argparse.Namespace) -> list[dict]:
    """One phase on ``ranks`` ranks; each rank's result."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        os.path.abspath(__file__),
        "--worker",
        phase,
        "--layout",
        layout,
        "--dir",
        root,
        "--size-mib",
        str(args.size_mib),
        "--rounds",
        str(args.rounds),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{phase} {layout} on {ranks} ranks failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.load(open(f"{root}/result-{phase}-{layout}-r{r}.json")) for r in range(ranks)]


def _mib(values: list[float]) -> str:
    return " / ".join(f"{v / MIB:.0f}" for v in values)


def print_restores(label: str, results: list[dict]) -> None:
    figures = [r["figures"] for r in results]
    spot, dcp = (statistics.median(figures[0][f]["seconds"]) for f in ("spotrun restore", "DCP load"))
    shares = [r["local_bytes"] for r in results]
    print(f"\nrestore into {label}: share per rank {_mib(shares)} MiB")
    for figure, seconds in (("spotrun restore", spot), ("DCP load", dcp)):
        rchar = [statistics.median(f[figure]["rchar"]) for f in figures]
        device = sum(statistics.median(f[figure]["read_bytes"]) for f in figures)
        identical = all(r["identical"][figure] for r in results)
        line = (
            f"  {figure:<16} {seconds:7.2f} s   read per rank (rchar) {_mib(rchar):>17} MiB"
            f"   from the device, all ranks {device / MIB:4.0f} MiB   bit-identical: {'yes' if identical else 'NO'}"
        )
        if figure == "spotrun restore":
            line += f"   restore_bytes_read {_mib([statistics.median(f[figure]['counter']) for f in figures])} MiB"
        print(line)
    ratio_bytes = sum(statistics.median(f["spotrun restore"]["rchar"]) for f in figures) / max(
        1, sum(statistics.median(f["DCP load"]["rchar"]) for f in figures)
    )
    print(f"  spotrun / DCP: {spot / dcp:.2f}x the time, {ratio_bytes:.2f}x the bytes read")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=288, help="state size in MiB (default 288)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per figure; figures are medians")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new one under $TMPDIR)")
    parser.add_argument("--worker", choices=("save", "restore"), help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="fsdp0", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import sharded_tools

        sharded_tools.main(args.dir, args.worker, args.layout, args.size_mib, args.rounds)
        return 0
    root = tempfile.mkdtemp(prefix="spotrun-sharded-bench-", dir=args.dir)
    started = time.perf_counter()
    try:
        print(f"load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs; files under {root}", flush=True)
        results = {}
        for phase, layout, ranks, label in RUNS:
            results[label] = torchrun(root, phase, layout, ranks, args)
            print(f"  {label}: done", flush=True)
        saved = results[RUNS[0][3]]
        figures = saved[0]["figures"]
        state = sum(r["local_bytes"] for r in saved)
        spot_files = sum(os.path.getsize(p) for p in glob.glob(f"{root}/spotrun/step-*/*"))
        dcp_files = sum(os.path.getsize(p) for p in glob.glob(f"{root}/dcp-*/*"))
        print(
            f"\nstate: {state / MIB:.0f} MiB (FSDP2 on 2 ranks, AdamW after one step); files of one step: "
            f"spotrun {spot_files / MIB:.0f} MiB, DCP {dcp_files / MIB:.0f} MiB; median of {args.rounds} rounds"
        )
        spot, dcp = (statistics.median(figures[f]["seconds"]) for f in ("spotrun save", "DCP save"))
        for figure, seconds in (("spotrun save", spot), ("DCP save", dcp)):
            written = [statistics.median(r["figures"][figure]["wchar"]) for r in saved]
            print(f"  {figure:<16} {seconds:7.2f} s   written per rank (wchar) {_mib(written)} MiB")
        print(f"  spotrun / DCP: {spot / dcp:.2f}x the time")
        for _, _, _, label in RUNS:
            print_restores(label, results[label])
        print(f"\n(whole run: {time.perf_counter() - started:.0f} s; load average now {os.getloadavg()[0]:.1f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
