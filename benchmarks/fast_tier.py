"""The fast tier (issue 23): what a save into host memory costs training, how fast a restart
comes back from it, and how many steps a crash loses with it. Not a test: it prints figures.

On one training state of ``--state-gib`` (a float32 model and its AdamW state,
``tests/support/memory_probe.build_training_state``), round by round and interleaved (the order
rotates each round), it measures:

* **stall**: how long ``end_of_step`` blocks at a step where a fast-tier save is due
  (``memory_interval_steps=2``, nothing in flight: the copy into the tier's staging buffers; the
  write into the tmpfs tier runs in the background, timed apart), against a plain copy of the same
  tensors into buffers allocated once (torch ``copy_``, torch's threads and one thread). Target:
  at most 1.5x the memcpy (torch's threads). The first fast-tier save, which allocates the staging
  buffers and checks the budget, is printed apart.
* **crash to the first trained step**: a fresh ``Checkpointer`` (as a restarted worker makes
  one) whose ``restore()`` loads the newest step from the fast tier, from a local directory
  (evicted from the page cache first: a cold read) and from S3 (a moto server on 127.0.0.1,
  started here), then one training step. Process start and ``import torch`` are left out: they
  are the same for every source.
* **from a peer** (issue 24): the same restart when the step is held only by another node's tier,
  read over loopback from that node's tier server (a separate process) by ranged reads with the
  job's secret; and **the replica copy's effect on step time**: training steps timed while this
  node's newest step is copied to a peer at the default rate cap
  (``--memory-replica-rate-bytes-s``), against steps without a copy.
* **steps lost per crash**: the expected number of completed steps a crash at a uniformly random
  moment loses, with the fast tier every 2 steps against storage alone every 20, computed and
  simulated, for a save committed at once and one committed a step later.

    .venv/bin/python benchmarks/fast_tier.py [--state-gib 1] [--rounds 3] [--no-s3]
        [--memory-dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path[:0] = [BENCH_DIR, REPO_ROOT]

import torch  # noqa: E402

import spotrun  # noqa: E402
from spotrun.storage import LocalStorage  # noqa: E402
from spotrun.storage.tier_peers import JobTier, Peer, PeerClient, RateLimit  # noqa: E402
from spotrun.storage.tier_protocol import new_secret  # noqa: E402
from tests.support.memory_probe import build_training_state, evict_from_page_cache, state_tensor_bytes  # noqa: E402

GIB = 2**30
MIB = 2**20
#: The fast tier's interval in the stall measurement and in the steps-lost figure.
MEMORY_INTERVAL_STEPS = 2
#: Storage's interval in the steps-lost figure (the acceptance test's).
STORAGE_INTERVAL_STEPS = 20
#: The stall target of issue 23, as a multiple of the memcpy.
STALL_TARGET_X = 1.5
#: ``spotrun run --memory-replica-rate-bytes-s``'s default.
DEFAULT_REPLICA_RATE_BYTES_S = 256 * MIB


def flat_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    for per_param in optimizer.state.values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return tensors


class Memcpy:
    """A copy of every tensor of the state into buffers allocated (and touched) once."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.buffers = [torch.zeros_like(t) for t in tensors]

    def torch_threads(self) -> None:
        for buffer, tensor in zip(self.buffers, self.tensors):
            buffer.copy_(tensor)

    def one_thread(self) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.torch_threads()
        finally:
            torch.set_num_threads(threads)


def timed(samples: dict[str, list[float]], figure: str, fn: Callable[[], object]) -> object:
    started = time.perf_counter()
    result = fn()
    samples[figure].append(time.perf_counter() - started)
    return result


def train_one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The first trained step after a restore: a forward, a backward and an optimizer step."""
    width = model[0].in_features
    loss = model(torch.randn(8, width)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Bench:
    """The state, the directories and the checkpointers of one run."""

    def __init__(self, state_bytes: int, memory_parent: str, scratch: str, s3_uri: str | None) -> None:
        self.model, self.optimizer = build_training_state(state_bytes)
        self.state = {"model": self.model, "optimizer": self.optimizer}
        self.state_bytes = state_tensor_bytes(self.model, self.optimizer)
        self.memcpy = Memcpy(flat_tensors(self.model, self.optimizer))
        self.tier_dir = tempfile.mkdtemp(prefix="spotrun-bench-fast-tier-", dir=memory_parent)
        self.tier_root = os.path.join(self.tier_dir, "steps")  # a tier directory's layout: served as one
        os.mkdir(self.tier_root)
        self.peer_parent = memory_parent
        self.peers = Peers(self.tier_dir, memory_parent)
        self.scratch = scratch
        self.local_root = os.path.join(scratch, "local")
        self.s3_uri = s3_uri
        # The training job: fast tier every 2 steps, no periodic saves to storage (its durable
        # root is its own, so that the restores below never fence it).
        self.trainer = self._checkpointer(
            storage=LocalStorage(os.path.join(scratch, "trainer")),
            memory_interval_steps=MEMORY_INTERVAL_STEPS,
            memory_dir=self.tier_root,
        )
        self.trainer.restore()
        self.step = 0
        # The durable copies of each round's step. Each restore claims a newer incarnation on its
        # store, so the Checkpointer that restored becomes the store's next saver (an older one
        # would be fenced, as it should).
        self.savers = {"local": self._checkpointer(storage=LocalStorage(self.local_root), keep_last=1)}
        if s3_uri is not None:
            self.savers["S3"] = self._checkpointer(uri=s3_uri, keep_last=1)

    def _checkpointer(self, **options) -> spotrun.Checkpointer:
        return spotrun.Checkpointer(self.state, handle_signals=False, **options)

    def _tier_save_ended(self) -> None:
        self.trainer._tier.report_ended()  # waits for the fast-tier save in flight

    def first_save(self, samples: dict[str, list[float]]) -> None:
        """The first fast-tier save: the budget check and the staging buffers' allocation."""
        self.step += 1
        self.trainer.end_of_step(self.step)
        self.step += 1
        timed(samples, "first fast-tier save, stall", lambda: self.trainer.end_of_step(self.step))
        timed(samples, "first fast-tier save, written after", self._tier_save_ended)

    def stall_round(self, samples: dict[str, list[float]], memcpy_first: bool) -> None:
        def tier() -> None:
            self.step += 1
            timed(samples, "end_of_step, no save due", lambda: self.trainer.end_of_step(self.step))
            self.step += 1
            timed(samples, "fast-tier save, stall", lambda: self.trainer.end_of_step(self.step))
            timed(samples, "fast-tier save, written after", self._tier_save_ended)

        def memcpy() -> None:
            timed(samples, "memcpy, torch's threads", self.memcpy.torch_threads)
            timed(samples, "memcpy, one thread", self.memcpy.one_thread)

        for part in (memcpy, tier) if memcpy_first else (tier, memcpy):
            part()

    def restore_round(self, samples: dict[str, list[float]], order: list[str]) -> None:
        """The tier holds ``self.step``: save it to each store, then restart from each source."""
        for name, saver in self.savers.items():
            timed(samples, f"save to {name}", lambda saver=saver: saver.save(self.step))
        evict_from_page_cache(self.local_root)
        for source in order:
            self._restart_from(source, samples)

    def _restart_from(self, source: str, samples: dict[str, list[float]]) -> None:
        own_tier = None
        if source in ("memory", "peer"):  # a copy of the trainer's durable root: no step, only its incarnations
            empty = tempfile.mkdtemp(prefix="durable-", dir=self.scratch)
            # the tier's steps count only for incarnations the root recorded; a copy, so that this
            # restore's claim never fences the trainer
            shutil.copytree(
                os.path.join(self.scratch, "trainer"),
                empty,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("events"),
            )
            memory_dir = self.tier_root
            if source == "peer":  # this node's tier is empty: the step is on the other node
                own_tier = tempfile.mkdtemp(prefix="spotrun-bench-own-tier-", dir=self.peer_parent)
                memory_dir = os.path.join(own_tier, "steps")
                os.mkdir(memory_dir)
            make = lambda: self._checkpointer(  # noqa: E731
                storage=LocalStorage(empty), memory_interval_steps=MEMORY_INTERVAL_STEPS, memory_dir=memory_dir
            )
        elif source == "local":
            make = lambda: self._checkpointer(storage=LocalStorage(self.local_root), keep_last=1)  # noqa: E731
        else:
            make = lambda: self._checkpointer(uri=self.s3_uri, keep_last=1)  # noqa: E731
        started = time.perf_counter()
        ckpt = make()
        if own_tier is not None:  # what the Checkpointer makes on several nodes (one node here)
            ckpt._tier.storage = self.peers.job_tier(own_tier)
        step = ckpt.restore()
        samples[f"restore from {source}"].append(time.perf_counter() - started)
        train_one_step(self.model, self.optimizer)
        samples[f"first trained step from {source}"].append(time.perf_counter() - started)
        tier = ckpt._restored.tier if ckpt._restored is not None else None
        expected = {"memory": "memory", "peer": "peer"}.get(source, "storage")
        if step != self.step or tier != expected:
            raise RuntimeError(f"restore from {source}: step {step} from {tier}, expected step {self.step}")
        if source in ("memory", "peer"):
            ckpt.close()
            shutil.rmtree(empty, ignore_errors=True)
            if own_tier is not None:
                shutil.rmtree(own_tier, ignore_errors=True)
        else:
            self.savers[source].close()
            self.savers[source] = ckpt

    def replica_round(self, samples: dict[str, list[float]], steps: int, copy_first: bool) -> None:
        """Training steps with the tier's newest step being copied to a peer at the rate cap, and without."""

        def with_copy() -> None:
            copier = threading.Thread(
                target=lambda: samples["replica copy"].append(self.peers.replicate(self.tier_root))
            )
            copier.start()
            for _ in range(steps):
                if not copier.is_alive():
                    break
                timed(samples, "training step, replica copying", lambda: train_one_step(self.model, self.optimizer))
            copier.join()

        def without() -> None:
            for _ in range(steps):
                timed(samples, "training step, no copy", lambda: train_one_step(self.model, self.optimizer))

        for part in (with_copy, without) if copy_first else (without, with_copy):
            part()

    def close(self) -> None:
        self.trainer.close()
        for saver in self.savers.values():
            saver.close()
        self.peers.close()
        shutil.rmtree(self.tier_dir, ignore_errors=True)


PEER_SERVER = """
import sys, time
from spotrun.storage.tier_server import TierServer
server = TierServer(sys.argv[1], bytes.fromhex(sys.argv[2]), "127.0.0.1", 0).start()
print(server.address[1], flush=True)
time.sleep(10**6)
"""


class Peers:
    """Another node serving the trainer's tier (as a peer holding the step), and a third receiving replicas."""

    def __init__(self, tier_dir: str, memory_parent: str) -> None:
        self.secret = new_secret()
        self.receiver_dir = tempfile.mkdtemp(prefix="spotrun-bench-receiver-", dir=memory_parent)
        os.mkdir(os.path.join(self.receiver_dir, "steps"))
        self.servers = [self._serve(tier_dir), self._serve(self.receiver_dir)]

    def _serve(self, tier_dir: str) -> tuple[subprocess.Popen, Peer]:
        proc = subprocess.Popen(
            [sys.executable, "-c", PEER_SERVER, tier_dir, self.secret.hex()], stdout=subprocess.PIPE, text=True
        )
        return proc, Peer(os.path.basename(tier_dir), "127.0.0.1", int(proc.stdout.readline()), self.secret)

    def job_tier(self, own_tier: str) -> JobTier:
        return JobTier(own_tier, [self.servers[0][1]], "bench-own", 60.0)

    def replicate(self, steps_root: str) -> float:
        """Copy the newest step under ``steps_root`` to the receiver at the default rate cap; its seconds."""
        client = PeerClient(self.servers[1][1], "bench-own", 60.0)
        rate = RateLimit(DEFAULT_REPLICA_RATE_BYTES_S)
        step_dir = max(d for d in os.listdir(steps_root) if d.startswith("step-"))
        started = time.perf_counter()
        for name in sorted(os.listdir(os.path.join(steps_root, step_dir)), key=lambda n: n.startswith("manifest")):
            client.put_file("bench-own", f"{step_dir}/{name}", os.path.join(steps_root, step_dir, name), rate)
        client.replica_done("bench-own")
        client.close()
        return time.perf_counter() - started

    def close(self) -> None:
        for proc, _peer in self.servers:
            proc.kill()
            proc.wait()
        shutil.rmtree(self.receiver_dir, ignore_errors=True)


def expected_steps_lost(interval_steps: int, lag_steps: int) -> float:
    """Completed steps a crash at a uniformly random moment loses, on average, when every
    ``interval_steps``-th step is saved and a save commits ``lag_steps`` steps after its step
    (``lag_steps < interval_steps``): (interval - 1) / 2 + lag."""
    return (interval_steps - 1) / 2 + lag_steps


def simulated_steps_lost(interval_steps: int, lag_steps: int, crashes: int, rng: random.Random) -> float:
    """The same by simulation: a crash at a uniformly random time of a long run (one step per
    unit of time) resumes from the newest save committed by then."""
    total = 0
    for _ in range(crashes):
        t = rng.uniform(10 * interval_steps, 1000 * interval_steps)
        done = int(t)  # completed steps at the crash
        committed = (done - lag_steps) // interval_steps * interval_steps  # saves commit lag steps later
        total += done - committed
    return total / crashes


def median(samples: dict[str, list[float]], figure: str) -> float:
    return statistics.median(samples[figure])


def print_stall(samples: dict[str, list[float]], state_bytes: int) -> None:
    # The floor is the faster of torch's threads and one thread: on a loaded machine the threads
    # of torch's parallel copy wait for each other at a barrier (benchmarks/peers.py does the same).
    floor = min(median(samples, "memcpy, torch's threads"), median(samples, "memcpy, one thread"))
    rounds = len(samples["memcpy, torch's threads"])
    print(f"\n(a) stall of a fast-tier save, {state_bytes / GIB:.2f} GiB, median of {rounds} rounds")
    for figure in (
        "memcpy, torch's threads",
        "memcpy, one thread",
        "end_of_step, no save due",
        "fast-tier save, stall",
        "fast-tier save, written after",
        "first fast-tier save, stall",
        "first fast-tier save, written after",
    ):
        value = median(samples, figure)
        rate = f"{state_bytes / value / GIB:6.2f} GiB/s" if value > 1e-3 else ""
        print(f"  {figure:<38} {value:8.3f} s  {value / floor:6.2f}x memcpy  {rate}")
    ratio = median(samples, "fast-tier save, stall") / floor
    verdict = "PASS" if ratio <= STALL_TARGET_X else "MISS"
    print(f"  stall / memcpy (the faster copy) = {ratio:.2f}x (target <= {STALL_TARGET_X}x): {verdict}")


def print_restarts(samples: dict[str, list[float]], sources: list[str]) -> None:
    print("\n(b) crash to the first trained step: a fresh Checkpointer, restore(), one training step")
    fast_restore = median(samples, "restore from memory")
    fast_first = median(samples, "first trained step from memory")
    for source in sources:
        restore = median(samples, f"restore from {source}")
        first = median(samples, f"first trained step from {source}")
        print(
            f"  from {source:<7} restore {restore:7.3f} s ({restore / fast_restore:5.2f}x the fast tier), "
            f"first trained step after {first:7.3f} s ({first / fast_first:5.2f}x)"
        )
    for name in ("save to local", "save to S3"):
        if samples.get(name):
            print(f"  ({name}, synchronous: {median(samples, name):.3f} s)")


def print_replica_effect(samples: dict[str, list[float]], state_bytes: int) -> None:
    if not samples.get("replica copy"):
        return
    print(f"\n(d) training steps while a step is copied to a peer at {DEFAULT_REPLICA_RATE_BYTES_S / MIB:.0f} MiB/s")
    copy_s = median(samples, "replica copy")
    with_copy = median(samples, "training step, replica copying")
    without = median(samples, "training step, no copy")
    print(f"  copy of one step: {copy_s:.2f} s ({state_bytes / MIB / copy_s:.0f} MiB/s)")
    print(f"  training step: {with_copy:.3f} s while copying, {without:.3f} s without ({with_copy / without:.2f}x)")


def print_steps_lost(crashes: int) -> None:
    rng = random.Random(0)
    print(
        "\n(c) completed steps lost per crash at a uniformly random moment "
        f"(computed; simulated over {crashes:,} crashes)"
    )
    rows = [
        (f"fast tier every {MEMORY_INTERVAL_STEPS} steps", MEMORY_INTERVAL_STEPS),
        (f"storage only, every {STORAGE_INTERVAL_STEPS} steps", STORAGE_INTERVAL_STEPS),
    ]
    for lag in (0, 1):
        when = "commits at its step" if lag == 0 else "commits one step later (background write)"
        print(f"  a save {when}:")
        for label, interval in rows:
            computed = expected_steps_lost(interval, lag)
            simulated = simulated_steps_lost(interval, lag, crashes, rng)
            print(f"    {label:<30} {computed:6.2f} steps (simulated {simulated:6.2f})")
        ratio = expected_steps_lost(STORAGE_INTERVAL_STEPS, lag) / expected_steps_lost(MEMORY_INTERVAL_STEPS, lag)
        print(f"    storage only loses {ratio:.1f}x as many")
    print("  plus the step in progress at the crash, lost either way")


def s3_bucket(stack: list) -> str:
    """A bucket on a moto server started here; its URI. ``stack`` collects the cleanups."""
    import contextlib

    from tests.support.s3_server import FAKE_CREDENTIALS, empty_and_delete_bucket, make_client, moto_server

    exits = contextlib.ExitStack()
    url = exits.enter_context(moto_server())
    os.environ.update(FAKE_CREDENTIALS, AWS_ENDPOINT_URL=url)
    client = make_client(url)
    bucket = f"spotrun-bench-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    exits.callback(empty_and_delete_bucket, client, bucket)
    stack.append(exits)
    print(f"S3: moto server at {url} (started here), bucket {bucket}")
    return f"s3://{bucket}/fast-tier"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-gib", type=float, default=1.0, help="model + optimizer bytes (default 1 GiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true", help="leave out the restore from S3 (moto)")
    parser.add_argument("--memory-dir", default="/dev/shm", help="where the tier lives (default /dev/shm)")
    parser.add_argument("--replica-steps", type=int, default=3, help="training steps timed per arm in (d)")
    parser.add_argument("--crashes", type=int, default=200_000, help="simulated crashes for (c)")
    args = parser.parse_args()
    saved_env = dict(os.environ)
    cleanups: list = []
    samples: dict[str, list[float]] = defaultdict(list)
    try:
        s3_uri = None if args.no_s3 else s3_bucket(cleanups)
        with tempfile.TemporaryDirectory(prefix="spotrun-bench-fast-tier-") as scratch:
            bench = Bench(int(args.state_gib * GIB), args.memory_dir, scratch, s3_uri)
            try:
                print(
                    f"state {bench.state_bytes / GIB:.2f} GiB ({bench.state_bytes / MIB:.0f} MiB), tier in "
                    f"{bench.tier_root}, local storage in {scratch}, torch {torch.__version__}, "
                    f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                bench.first_save(samples)
                sources = ["memory", "peer", "local"] + ([] if s3_uri is None else ["S3"])
                for round_index in range(args.rounds):
                    bench.stall_round(samples, memcpy_first=round_index % 2 == 0)
                    shift = round_index % len(sources)
                    bench.restore_round(samples, sources[shift:] + sources[:shift])
                    bench.replica_round(samples, args.replica_steps, copy_first=round_index % 2 == 0)
                    print(f"  round {round_index + 1}/{args.rounds} done", flush=True)
            finally:
                bench.close()
        print_stall(samples, bench.state_bytes)
        print_restarts(samples, sources)
        print_steps_lost(args.crashes)
        print_replica_effect(samples, bench.state_bytes)
    finally:
        for exits in reversed(cleanups):
            exits.close()
        os.environ.clear()
        os.environ.update(saved_env)


if __name__ == "__main__":
    main()
