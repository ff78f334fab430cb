"""spotrun's checkpoints against the peers a user would otherwise pick, and the machine's limits.

    python benchmarks/checkpoint_vs_peers.py [--size-mib 768] [--rounds 3] [--s3] [--quick] [--profile] [--device cuda]

One training state (a float32 model of 16 square Linear layers and its AdamW state after one
step, ``--size-mib`` MiB of tensors in all), one process, and round by round, interleaved on
that same state (the order rotates every round):

* durable saves: spotrun ``Checkpointer.save`` (local storage fsyncs), DCP ``save``,
  safetensors ``save_file`` + fsync, ``torch.save`` + fsync; background saves: spotrun
  ``Checkpointer(interval_steps=1, background_saves=True)`` (stall: ``end_of_step``; total:
  until ``wait_for_save`` returns) and DCP ``async_save`` (stall: the call; total: its future),
  with async_save's own stager and with one reused ``DefaultStager``;
* cold restores into the live model and optimizer (the files evicted from the page cache
  with ``posix_fadvise(DONTNEED)`` first): spotrun ``restore``, DCP ``load`` +
  ``set_state_dict``, safetensors ``load_file`` + ``copy_``, ``torch.load`` + ``load_state_dict``;
* the limits: ``dd`` direct write (``oflag=direct conv=fsync``) and direct read of as many
  bytes, and a copy of the state into buffers allocated once (the floor of a stall);
* peak extra memory of each, measured in a child process per measurement (``VmHWM`` after
  resetting it, minus ``VmRSS`` before: :mod:`tests.support.peak_memory`);
* 10,000 tiny tensors (per tensor: spotrun, DCP, safetensors); world size 2 with replicated
  state (torchrun, gloo: spotrun and DCP saves); with ``--s3``, a 384 MiB state on a moto server
  started on 127.0.0.1 against boto3's ``upload_file``/``download_file``.

Prints median seconds, ratios to DCP and to the limit, CPU time and page faults (where the
time goes), and the issue's targets with PASS/MISS. Figures are medians of ``--rounds``.

``--device cuda``: the state lives on the GPU (background saves stage it into pinned memory,
restores copy it back); every figure then waits for the device's queued work before it stops
(no tool hides copies still running), and the limit of a stall is a device-to-host copy of the
state into pinned buffers allocated once. ``benchmarks/gpu_check.sh`` runs this on a GPU machine.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path[:0] = [BENCH_DIR, REPO_ROOT]

import peers  # noqa: E402
import report  # noqa: E402
import scenarios  # noqa: E402

from tests.support import memory_probe  # noqa: E402

MIB = 2**20
#: Memory measurements: child action -> {measurement: label in the table}; one child per action.
MEMORY_ACTIONS = {
    "spotrun-save-and-restore": {
        "spotrun-sync-save": "spotrun save (sync, emergency)",
        "spotrun-restore": "spotrun restore",
    },
    "spotrun-background-save": {"spotrun-background-save": "spotrun background save (2 saves)"},
    "dcp": {"dcp-save": "DCP save", "dcp-load": "DCP load"},
    "dcp-async-save": {"dcp-async-save": "DCP async_save (2 saves)"},
    "dcp-async-save-reused-stager": {"dcp-async-save-reused-stager": "DCP async_save, reused stager (2 saves)"},
    "safetensors": {"safetensors-save": "safetensors save_file", "safetensors-load": "safetensors load_file+copy_"},
    "torch": {"torch-save": "torch.save", "torch-load": "torch.load"},
}


class Samples:
    """Per figure: seconds, minor page faults, user and system CPU seconds of each round.
    ``device_sync``: called before a timing starts and before it stops (a GPU's queued work)."""

    def __init__(self, device_sync=lambda: None) -> None:
        self.rows: dict[str, list[tuple[float, int, float, float]]] = defaultdict(list)
        self._sync = device_sync

    def __call__(self, figure: str, fn, since=None):
        """Time ``fn`` as ``figure`` (from ``since``, a token an earlier call returned, if given)."""
        if since is None:
            self._sync()
        token = since or (time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF))
        fn()
        self._sync()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.rows[figure].append(
            (
                time.perf_counter() - token[0],
                usage.ru_minflt - token[1].ru_minflt,
                usage.ru_utime - token[1].ru_utime,
                usage.ru_stime - token[1].ru_stime,
            )
        )
        return token

    def low(self, figure: str) -> float:
        return min(row[0] for row in self.rows[figure])

    def high(self, figure: str) -> float:
        return max(row[0] for row in self.rows[figure])

    def median(self, figure: str, column: int = 0) -> float | None:
        values = [row[column] for row in self.rows.get(figure, [])]
        return statistics.median(values) if values else None


def run_local(model, optimizer, root: str, rounds: int, device: str = "cpu") -> tuple[Samples, dict[str, str]]:
    tools, missing = peers.local_tools(model, optimizer, root)
    samples = Samples(peers.device_sync(device))
    for index in range(rounds):
        order = tools[index % len(tools) :] + tools[: index % len(tools)]
        for tool in order:
            tool.run(samples)
        samples.rows["memcpy into preallocated buffers"].append(
            min(samples.rows["memcpy, torch's threads"][-1], samples.rows["memcpy, one thread"][-1])
        )
        print(f"  round {index + 1}/{rounds} done", flush=True)
    for tool in tools:
        tool.clear()
    return samples, missing


def run_memory(size_mib: float, root: str) -> dict[str, dict]:
    """Label -> the child's JSON result (or ``{"error": ...}``), one child process per action."""
    results = {}
    for action, labels in MEMORY_ACTIONS.items():
        scratch = tempfile.mkdtemp(prefix="memory-", dir=root)
        proc = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--memory-child",
                action,
                "--state-mib",
                str(size_mib),
                "--root",
                scratch,
            ],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
        )
        measured = {
            r["action"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
        }
        for name, label in labels.items():
            results[label] = measured.get(name) or measured.get(action) or {"error": proc.stderr.strip()[-300:]}
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"  memory: {action} done", flush=True)
    return results


def profile_spotrun(model, optimizer, root: str) -> None:
    """cProfile of one spotrun save and one cold restore (top entries by own time)."""
    tool = peers.Spotrun(model, optimizer, f"{root}/profile")
    for label, fn in (("save", tool.save), ("restore", tool.restore)):
        if label == "restore":
            memory_probe.evict_from_page_cache(tool.root)
        profiler = cProfile.Profile()
        profiler.enable()
        fn()
        profiler.disable()
        print(f"\n--- cProfile: spotrun {label}, top 12 by own time ---")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    tool.identity.reinstall()
    tool.clear()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=768, help="state size in MiB (default 768)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians")
    parser.add_argument("--quick", action="store_true", help="a small run: 48 MiB, 1,000 tiny tensors")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new one under $TMPDIR)")
    parser.add_argument("--tiny-count", type=int, default=10_000, help="tensors of the tiny-tensor case")
    parser.add_argument(
        "--world2-size-mib", type=float, default=None, help="state at world size 2 (default --size-mib)"
    )
    parser.add_argument("--s3", action="store_true", help="also S3 against a moto server on 127.0.0.1")
    parser.add_argument("--s3-size-mib", type=float, default=384)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-tiny", action="store_true")
    parser.add_argument("--no-world2", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile one spotrun save and restore")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives (cuda: the GPU's paths)"
    )
    parser.add_argument("--world2-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mib, args.tiny_count, args.s3_size_mib = 48, 1_000, 48
    args.world2_size_mib = args.world2_size_mib or args.size_mib
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--memory-child"]:
        return memory_probe.run_child({**memory_probe.ACTIONS, **peers.MEMORY_ACTIONS}, argv[1:])
    args = parse_args(argv)
    if args.world2_worker:
        scenarios.world2_worker(args.dir, args.world2_size_mib, args.rounds)
        return 0
    root = tempfile.mkdtemp(prefix="spotrun-bench-", dir=args.dir)
    try:
        started = time.perf_counter()
        model, optimizer = memory_probe.build_training_state(int(args.size_mib * MIB), device=args.device)
        state_bytes = memory_probe.state_tensor_bytes(model, optimizer)
        width = model[0].weight.shape[0]
        print(
            f"load average {os.getloadavg()[0]:.1f}; state: {state_bytes / MIB:.1f} MiB "
            f"({len(model)} Linear layers {width}x{width}, float32, "
            f"AdamW after one step) on {peers.describe_device(args.device)}; {os.cpu_count()} CPUs; files under {root}",
            flush=True,
        )
        phases: dict[str, float] = {}

        def phase(name: str, fn):
            phase_started = time.perf_counter()
            result = fn()
            phases[name] = time.perf_counter() - phase_started
            return result

        samples, missing = phase("local rounds", lambda: run_local(model, optimizer, root, args.rounds, args.device))  # noqa: F821 (called at once, before the del)
        if args.profile:
            phase("profile", lambda: profile_spotrun(model, optimizer, root))  # noqa: F821 (called at once)
        del model, optimizer
        memory = {} if args.no_memory else phase("memory", lambda: run_memory(args.size_mib, root))
        tiny = (
            None
            if args.no_tiny
            else phase("tiny tensors", lambda: scenarios.tiny_tensors(f"{root}/tiny", args.tiny_count, args.rounds))
        )
        world2 = (
            None
            if args.no_world2
            else phase("world size 2", lambda: scenarios.world2(root, args.world2_size_mib, args.rounds))
        )
        s3 = phase("S3", lambda: scenarios.s3(args.s3_size_mib, args.rounds)) if args.s3 else None
        report.print_all(
            report.Results(
                state_bytes=state_bytes,
                rounds=args.rounds,
                samples=samples,
                missing=missing,
                memory=memory,
                tiny=tiny,
                tiny_count=args.tiny_count,
                world2=world2,
                world2_mib=args.world2_size_mib,
                s3=s3,
            )
        )
        print(
            f"\n(whole run: {time.perf_counter() - started:.0f} s: "
            + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in phases.items())
            + f"; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
