"""S3 save and restore throughput: spotrun's S3Storage against boto3's transfer managers.

Not a test: it prints figures. On the same object, interleaved round by round (the order
alternates), it times

* ``put_stream`` (the streaming save: parts read from a ByteSource into reused buffers)
  against boto3's ``upload_file`` of the same bytes from a file in the page cache;
* ``read_into`` of the whole object into a preallocated buffer (the restore path) and
  ``get`` against boto3's ``download_file`` to a file;

with the same part size, concurrency and client settings (one client per side made by
``make_client``: botocore retries off, checksums only where required). It prints each
median with the ratio spotrun / boto3 (throughput; >= 1 means spotrun is faster), and the
CPU seconds the client process and the server process spent per transfer, which show
where the time goes: against moto (a single Python process) the server's CPU is most of
the wall time, so both clients measure moto more than themselves.

By default it starts its own moto server on 127.0.0.1 (the helper the tests use);
``--endpoint-url`` points it at another S3-compatible server (MinIO...), using the
credentials of the environment (then the server's CPU is not shown).

    .venv/bin/python benchmarks/s3_throughput.py [--size-mib 384] [--rounds 5]
        [--part-size-mib 16] [--max-concurrency 8] [--endpoint-url URL]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from boto3.s3.transfer import TransferConfig  # noqa: E402

from spotrun.storage.s3 import S3Options, S3Storage, make_client  # noqa: E402
from spotrun.storage.s3_transfer import MemorySource  # noqa: E402
from tests.support.s3_server import FAKE_CREDENTIALS, moto_server  # noqa: E402

MIB = 1024 * 1024
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def endpoint(url: str | None) -> Iterator[tuple[str, int | None]]:
    """The given endpoint, or a fresh moto server (with fake credentials) for the run;
    yields ``(url, server pid or None)``."""
    if url:
        yield url, None
        return
    for name, value in FAKE_CREDENTIALS.items():
        os.environ.setdefault(name, value)
    with moto_server() as started:
        yield started, child_pid(f"-p {started.rsplit(':', 1)[1]}")


def child_pid(fragment: str) -> int | None:
    """Pid of this process's child whose command line contains ``fragment``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmd:
                cmdline = cmd.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if ppid == os.getpid() and fragment in cmdline:
            return int(entry)
    return None


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (this process when None)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class Sampler:
    """Where the client's threads spend their time: every ``interval_s`` it looks at each
    other thread's innermost Python frame and counts it (a C call such as ``sendall`` or
    ``recv_into`` shows as the Python line that made it)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.counts: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        me = threading.get_ident()
        main = threading.main_thread().ident
        while not self._stop.wait(self.interval_s):
            for ident, frame in sys._current_frames().items():
                if ident in (me, main) or frame.f_code.co_name in ("wait", "_worker"):
                    continue  # idle pool threads and the waiting caller
                code = frame.f_code
                where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"
                self.counts[where] += 1

    def __enter__(self) -> Sampler:
        """Start sampling (again: the counts add up over every use)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def report(self, top: int = 8) -> str:
        total = sum(self.counts.values()) or 1
        return "\n".join(f"      {100 * n / total:5.1f} %  {where}" for where, n in self.counts.most_common(top))


class Contest:
    """Times of named transfers: wall seconds, client CPU seconds, server CPU seconds."""

    def __init__(self, server_pid: int | None, profile: bool) -> None:
        self.server_pid = server_pid
        self.runs: dict[str, list[tuple[float, float, float]]] = {}
        self.samplers: dict[str, Sampler] | None = {} if profile else None

    def time(self, name: str, fn: Callable[[], object]) -> None:
        server0 = cpu_s(self.server_pid) if self.server_pid else 0.0
        client0 = cpu_s(None)
        sampler: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.samplers is not None:
            sampler = self.samplers.setdefault(name, Sampler())
        start = time.perf_counter()
        with sampler:
            fn()
        wall = time.perf_counter() - start
        client = cpu_s(None) - client0
        server = cpu_s(self.server_pid) - server0 if self.server_pid else float("nan")
        self.runs.setdefault(name, []).append((wall, client, server))

    def median(self, name: str, index: int = 0) -> float:
        return statistics.median(run[index] for run in self.runs[name])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=384, help="object size in MiB")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--endpoint-url", default=None, help="use this server, not a new moto")
    parser.add_argument("--part-size-mib", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--chunk-mib", type=int, default=4, help="put_stream's chunk_bytes")
    parser.add_argument(
        "--profile", action="store_true", help="sample the client's threads: where each transfer spends its time"
    )
    args = parser.parse_args(argv)

    size = args.size_mib * MIB
    data = os.urandom(size)
    print(
        f"object: {args.size_mib} MiB, parts of {args.part_size_mib} MiB, concurrency "
        f"{args.max_concurrency}, {args.rounds} interleaved rounds, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    with endpoint(args.endpoint_url) as (url, server_pid), tempfile.TemporaryDirectory() as tmp:
        print(f"endpoint: {url}" + ("" if args.endpoint_url else f" (moto server started here, pid {server_pid})"))
        options = S3Options(
            endpoint_url=url,
            part_size_bytes=args.part_size_mib * MIB,
            multipart_threshold_bytes=args.part_size_mib * MIB,
            max_concurrency=args.max_concurrency,
        )
        config = TransferConfig(
            multipart_threshold=options.multipart_threshold_bytes,
            multipart_chunksize=options.part_size_bytes,
            max_concurrency=options.max_concurrency,
            use_threads=True,
        )
        boto = make_client(options)
        bucket = f"spotrun-bench-{uuid.uuid4().hex[:8]}"
        boto.create_bucket(Bucket=bucket)
        storage = S3Storage(bucket, "spotrun", options)
        source_path = os.path.join(tmp, "source")
        target_path = os.path.join(tmp, "target")
        with open(source_path, "wb") as out:
            out.write(data)
        into = bytearray(size)
        chunk_bytes = args.chunk_mib * MIB
        contest = Contest(server_pid, args.profile)

        def save_spotrun() -> None:
            storage.put_stream("blob", MemorySource(memoryview(data)), chunk_bytes=chunk_bytes)

        def save_boto() -> None:
            boto.upload_file(source_path, bucket, "boto/blob", Config=config)

        def restore_spotrun() -> None:
            storage.read_into("blob", 0, [memoryview(into)])

        def get_spotrun() -> None:
            storage.get("blob")

        def restore_boto() -> None:
            boto.download_file(bucket, "boto/blob", target_path, Config=config)

        try:
            for round_number in range(args.rounds):
                saves = [("save: spotrun put_stream", save_spotrun), ("save: boto3 upload_file", save_boto)]
                loads = [
                    ("restore: spotrun read_into", restore_spotrun),
                    ("restore: spotrun get", get_spotrun),
                    ("restore: boto3 download_file", restore_boto),
                ]
                if round_number % 2:
                    saves.reverse()
                    loads.reverse()
                for name, fn in saves + loads:
                    contest.time(name, fn)
            if bytes(into) != data or storage.get("blob") != data:
                raise SystemExit("S3Storage stored or returned different bytes")
            with open(target_path, "rb") as got:
                if got.read() != data:
                    raise SystemExit("boto3 returned different bytes")
        finally:
            with contextlib.suppress(Exception):
                for key in ("spotrun/blob", "boto/blob"):
                    boto.delete_object(Bucket=bucket, Key=key)
                boto.delete_bucket(Bucket=bucket)

    print(
        f"\n  {'transfer (medians)':<30} {'wall s':>7} {'MiB/s':>7} {'client CPU s':>13} "
        f"{'server CPU s':>13} {'vs boto3':>9}"
    )
    for name in contest.runs:
        wall = contest.median(name)
        peer = "save: boto3 upload_file" if name.startswith("save") else "restore: boto3 download_file"
        ratio = contest.median(peer) / wall
        print(
            f"  {name:<30} {wall:7.2f} {size / MIB / wall:7.1f} {contest.median(name, 1):13.2f} "
            f"{contest.median(name, 2):13.2f} {ratio:8.2f}x"
        )
    print("\n  every round (wall s):")
    for name, runs in contest.runs.items():
        print(f"  {name:<30} " + " ".join(f"{run[0]:6.2f}" for run in runs))
    for name, sampler in (contest.samplers or {}).items():
        print(f"\n  {name}: the client threads' time, by innermost Python line")
        print(sampler.report())


if __name__ == "__main__":
    main()
