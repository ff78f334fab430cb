"""gs:// and az:// save and restore throughput: spotrun against the cloud SDKs and fsspec, on the emulators.

Not a test: it prints figures. For each backend it starts the emulator the tests use
(tests/support/gcs_server.py: gcp-storage-emulator, in memory; tests/support/azurite_server.py:
Azurite, blobs on disk in a temporary directory) and, interleaved round by round (the order
alternates), on the same bytes, times

* saves: spotrun's ``put_stream`` (``open_storage(uri)``, a MemorySource over the bytes); the
  SDK's own upload (google-cloud-storage ``Blob.upload_from_file``, resumable in chunks of the
  part size; azure-storage-blob ``upload_blob(max_concurrency=...)``, blocks of the part size);
  fsspec's ``pipe_file`` (gcsfs: resumable in chunks of the part size; adlfs: its defaults);
* restores: spotrun's ``read_into`` (a preallocated buffer: the restore path) and ``get``;
  the SDK's download into a preallocated buffer (``Blob.download_to_file``, one stream;
  ``transfer_manager.download_chunks_concurrently`` with threads, to a file, GCS only;
  ``download_blob(max_concurrency=...).readinto``, Azure); fsspec's ``cat_file`` (with the
  concurrency where it takes one).

Each side reads back the object it wrote itself. Part size and concurrency are the same on
every side that takes them; checksums are off everywhere (spotrun computes none on the wire:
its own block digests check a restore), so no side hashes what the other does not.

It prints each median (wall seconds, MiB/s), the CPU seconds the client (this process, every
thread) and the emulator process spent per transfer, and the ratios spotrun / peer (throughput:
>= 1 means spotrun is faster). The emulators bound absolute speed: gcp-storage-emulator is one
Python process (one GIL) and Azurite one Node.js process (one JavaScript thread), so when the
emulator's CPU is about its wall time, the transfer measures the emulator more than the client
(the "bound by" column: whichever side's CPU is at least 70 % of the wall time; "neither" when
both wait). "listen drops" counts the connections the kernel dropped at the emulator's full
listen queue during the transfer (machine-wide, /proc/net/netstat): gcp-storage-emulator is
``http.server.HTTPServer``, one request at a time, HTTP/1.0 (a connection per request), a listen
queue of 5, so a transfer that opens more than that at once (every parallel one: spotrun's
composite upload and ranged reads, transfer_manager, gcsfs's ``cat_file``) loses SYNs, resent
after TCP's 1 s initial timeout: about a second of nobody's CPU, the emulator's limit, not the
clients'. ``--max-concurrency 1`` shows them without it.

GCS is measured on the emulator itself, not through the tests' precondition proxy (which looks
up each object's generation and serialises writes: that would be measured too); spotrun's
``put_stream`` overwrites and needs no precondition.

What cannot be measured, and why (the run says so too):

* ``transfer_manager.upload_chunks_concurrently``: the emulator answers its XML multipart
  upload (``POST ...?uploads``) with 501: it implements the JSON API only. Tried once each run.
* gcsfs: its default class (``gcsfs.GCSFileSystem``, the "extended" one in 2026.10.1) first asks
  the Storage Control gRPC API for each bucket's layout, which the emulator does not serve: every
  new bucket costs a 60 s timeout. The plain ``gcsfs.core.GCSFileSystem`` is measured; its HTTP
  transfers are the same.

    .venv/bin/python benchmarks/cloud_storage.py [--backend gcs|azure|both] [--size-mib 128]
        [--rounds 3] [--part-size-mib 16] [--max-concurrency 8] [--chunk-mib 4]

Needs the test extra (the emulators, Azurite through npm) and the bench extra (gcsfs, adlfs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path[:0] = [BENCH_DIR, REPO_ROOT]

from s3_throughput import Contest, child_pid  # noqa: E402

from spotrun.storage import open_storage  # noqa: E402
from spotrun.storage.transfer import MemorySource  # noqa: E402
from tests.support.azurite_server import admin_service, azurite_server  # noqa: E402
from tests.support.gcs_server import PROJECT, GcsServer, create_bucket, empty_and_delete_bucket, gcs_emulator  # noqa: E402

MIB = 1024 * 1024
#: A side whose CPU seconds are at least this share of the wall time bounds the transfer.
BOUND_SHARE = 0.7


class BufferWriter(io.RawIOBase):
    """A writable, seekable stream over a preallocated buffer (the SDKs' downloads land there
    as spotrun's ``read_into`` does: no growing copy)."""

    def __init__(self, buffer: bytearray) -> None:
        self._view = memoryview(buffer)
        self._pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        size = len(data)
        self._view[self._pos : self._pos + size] = data
        self._pos += size
        return size


@dataclass(frozen=True)
class Settings:
    """What every side shares: the bytes, part size, concurrency, put_stream's chunk."""

    data: bytes
    part_size_bytes: int
    max_concurrency: int
    chunk_bytes: int
    tmp_dir: str

    @property
    def size_bytes(self) -> int:
        return len(self.data)


@dataclass
class Transfer:
    """One timed transfer: ``run`` does it, ``result`` returns the bytes it restored (None for a
    save), ``if_fails`` explains a failure the emulator is known to cause."""

    name: str
    run: Callable[[], object]
    result: Callable[[], bytes] | None = None
    if_fails: str = ""


@dataclass
class Backend:
    """A started emulator and the transfers to time on it."""

    title: str
    server_pid: int | None
    saves: list[Transfer]
    loads: list[Transfer]
    notes: list[str] = field(default_factory=list)


def spotrun_transfers(uri: str, s: Settings) -> tuple[list[Transfer], list[Transfer]]:
    """spotrun's put_stream, read_into and get on ``uri``, with the shared part size and concurrency."""
    storage = open_storage(
        uri,
        part_size_bytes=s.part_size_bytes,
        multipart_threshold_bytes=s.part_size_bytes,
        max_concurrency=s.max_concurrency,
    )
    into = bytearray(s.size_bytes)
    got: list[bytes] = [b""]

    def get() -> None:
        got[0] = storage.get("blob")

    saves = [
        Transfer(
            "save: spotrun put_stream",
            lambda: storage.put_stream("blob", MemorySource(memoryview(s.data)), chunk_bytes=s.chunk_bytes),
        )
    ]
    loads = [
        Transfer(
            "restore: spotrun read_into", lambda: storage.read_into("blob", 0, [memoryview(into)]), lambda: bytes(into)
        ),
        Transfer("restore: spotrun get", get, lambda: got[0]),
    ]
    return saves, loads


@contextlib.contextmanager
def gcs_backend(s: Settings) -> Iterator[Backend]:
    """gcp-storage-emulator (in memory), a bucket on it, and the GCS transfers."""
    # The plain class: the default one first asks a gRPC API the emulator lacks (module docstring).
    from gcsfs.core import GCSFileSystem
    from google.cloud import storage as gcs
    from google.cloud.storage import transfer_manager

    with gcs_emulator() as url:
        pid = child_pid(f"--port {url.rsplit(':', 1)[1]}")
        os.environ["STORAGE_EMULATOR_HOST"] = url  # the emulator itself, not the precondition proxy
        os.environ["GOOGLE_CLOUD_PROJECT"] = PROJECT
        server = GcsServer(url=url, emulator_url=url, proxy=None)  # type: ignore[arg-type]
        bucket_name = f"spotrun-bench-{uuid.uuid4().hex[:8]}"
        create_bucket(server, bucket_name)
        saves, loads = spotrun_transfers(f"gs://{bucket_name}/spotrun", s)
        bucket = gcs.Client(project=PROJECT).bucket(bucket_name)
        fs = GCSFileSystem(endpoint_url=url, token="anon", project=PROJECT)
        sdk_into = bytearray(s.size_bytes)
        tm_path = os.path.join(s.tmp_dir, "gcs-transfer-manager")
        tm_source = os.path.join(s.tmp_dir, "gcs-source")
        with open(tm_source, "wb") as out:
            out.write(s.data)
        fs_got: list[bytes] = [b""]

        def sdk_upload() -> None:
            blob = bucket.blob("sdk/blob", chunk_size=s.part_size_bytes)
            blob.upload_from_file(io.BytesIO(s.data), size=s.size_bytes, checksum=None)

        def tm_upload() -> None:
            transfer_manager.upload_chunks_concurrently(
                tm_source,
                bucket.blob("tm/blob"),
                chunk_size=s.part_size_bytes,
                max_workers=s.max_concurrency,
                worker_type=transfer_manager.THREAD,
            )

        def sdk_download() -> None:
            bucket.blob("sdk/blob").download_to_file(BufferWriter(sdk_into), raw_download=True, checksum=None)

        def tm_download() -> None:
            transfer_manager.download_chunks_concurrently(
                bucket.blob("sdk/blob"),
                tm_path,
                chunk_size=s.part_size_bytes,
                max_workers=s.max_concurrency,
                worker_type=transfer_manager.THREAD,
                crc32c_checksum=False,
            )

        def fs_cat() -> None:
            fs_got[0] = fs.cat_file(f"{bucket_name}/fs/blob", concurrency=s.max_concurrency)

        def read_file(path: str) -> bytes:
            with open(path, "rb") as got:
                return got.read()

        saves += [
            Transfer("save: SDK upload_from_file", sdk_upload),
            Transfer(
                "save: SDK tm.upload_chunks_concurrently",
                tm_upload,
                if_fails="the emulator implements the JSON API only, not the XML multipart upload this uses",
            ),
            Transfer(
                "save: gcsfs pipe_file",
                lambda: fs.pipe_file(f"{bucket_name}/fs/blob", s.data, chunksize=s.part_size_bytes),
            ),
        ]
        loads += [
            Transfer("restore: SDK download_to_file", sdk_download, lambda: bytes(sdk_into)),
            Transfer("restore: SDK tm.download_chunks_conc.", tm_download, lambda: read_file(tm_path)),
            Transfer("restore: gcsfs cat_file", fs_cat, lambda: fs_got[0]),
        ]
        backend = Backend(
            f"gs:// on gcp-storage-emulator (in memory) at {url}, pid {pid}",
            pid,
            saves,
            loads,
            notes=[
                "measured on the emulator itself, not through the tests' precondition proxy (its generation "
                "lookups and write lock would be measured too)",
                "the emulator serves one request at a time (http.server.HTTPServer) over HTTP/1.0 (a new connection "
                "per request) with a listen queue of 5: parallel transfers open more connections than that at once, "
                "the kernel drops the others' SYNs ('listen drops') and they are resent after TCP's 1 s initial "
                "timeout; that second is neither side's CPU ('bound by: neither')",
                "SDK upload_from_file: one resumable upload, chunks of the part size one after another; "
                "download_to_file: one GET; tm.download_chunks_concurrently: threads, ranged GETs of the part size "
                "(to a file; it takes a file name only)",
                "gcsfs: gcsfs.core.GCSFileSystem (the default, extended class asks the Storage Control gRPC API for "
                "the bucket's layout, which the emulator lacks: a 60 s timeout per bucket); pipe_file: one resumable "
                "upload in chunks of the part size; cat_file: ranged GETs, concurrency as the others",
            ],
        )
        try:
            yield backend
        finally:
            with contextlib.suppress(Exception):
                empty_and_delete_bucket(server, bucket_name)


@contextlib.contextmanager
def azure_backend(s: Settings) -> Iterator[Backend]:
    """Azurite (blobs on disk in a temporary directory), a container on it, and the Azure transfers."""
    from adlfs import AzureBlobFileSystem
    from azure.storage.blob import BlobServiceClient

    workdir = tempfile.mkdtemp(prefix="spotrun-bench-azurite-", dir=s.tmp_dir)
    with azurite_server(workdir) as server:
        pid = child_pid(f"--blobPort {server.endpoint_url.rsplit(':', 1)[1]}")
        for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_BLOB_ENDPOINT"):
            os.environ.pop(name, None)
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string
        container_name = f"spotrun-bench-{uuid.uuid4().hex[:8]}"
        admin_service(server.connection_string).create_container(container_name)
        saves, loads = spotrun_transfers(f"az://{container_name}/spotrun", s)
        service = BlobServiceClient.from_connection_string(
            server.connection_string,
            max_block_size=s.part_size_bytes,
            max_single_put_size=s.part_size_bytes,
            max_single_get_size=s.part_size_bytes,
            max_chunk_get_size=s.part_size_bytes,
        )
        blob = service.get_blob_client(container_name, "sdk/blob")
        fs = AzureBlobFileSystem(connection_string=server.connection_string)
        sdk_into = bytearray(s.size_bytes)
        fs_got: list[bytes] = [b""]

        def sdk_download() -> None:
            blob.download_blob(max_concurrency=s.max_concurrency).readinto(BufferWriter(sdk_into))

        def fs_cat() -> None:
            fs_got[0] = fs.cat_file(f"{container_name}/fs/blob", max_concurrency=s.max_concurrency)

        saves += [
            Transfer(
                "save: SDK upload_blob",
                lambda: blob.upload_blob(s.data, overwrite=True, max_concurrency=s.max_concurrency),
            ),
            Transfer(
                "save: adlfs pipe_file",
                lambda: fs.pipe_file(f"{container_name}/fs/blob", s.data, max_concurrency=s.max_concurrency),
            ),
        ]
        loads += [
            Transfer("restore: SDK download_blob.readinto", sdk_download, lambda: bytes(sdk_into)),
            Transfer("restore: adlfs cat_file", fs_cat, lambda: fs_got[0]),
        ]
        backend = Backend(
            f"az:// on Azurite (blobs on disk under {workdir}) at {server.endpoint_url}, pid {pid}",
            pid,
            saves,
            loads,
            notes=[
                "SDK: blocks and ranged GETs of the part size, max_concurrency as the others",
                "adlfs: max_concurrency as the others; its SDK client's own sizes (aio: blocks of 4 MiB, one Put Blob "
                "up to 64 MiB, ranged GETs of 4 MiB after a first 32 MiB one): it takes no part size",
            ],
        )
        try:
            yield backend
        finally:
            with contextlib.suppress(Exception):
                admin_service(server.connection_string).delete_container(container_name)
            shutil.rmtree(workdir, ignore_errors=True)


def warm_up(backend: Backend) -> list[str]:
    """Run every transfer once, untimed (connections, imports, the objects the restores read);
    drop the ones that fail, returning why."""
    dropped = []
    for group in (backend.saves, backend.loads):
        for transfer in list(group):
            try:
                transfer.run()
            except Exception as exc:  # noqa: BLE001 - reported and left out, not hidden
                group.remove(transfer)
                reason = f"{type(exc).__name__}: {str(exc)[:200]}"
                dropped.append(f"{transfer.name}: {reason}" + (f" ({transfer.if_fails})" if transfer.if_fails else ""))
    return dropped


def listen_drops() -> int:
    """The kernel's count of connections dropped at a full listen queue (TcpExt ListenDrops;
    machine-wide): a client's SYN dropped there is resent after TCP's 1 s initial timeout."""
    with open("/proc/net/netstat") as netstat:
        lines = [line.split() for line in netstat if line.startswith("TcpExt:")]
    names, values = lines[0], lines[1]
    return int(values[names.index("ListenDrops")])


def bound_by(wall_s: float, client_s: float, server_s: float) -> str:
    if server_s >= BOUND_SHARE * wall_s and server_s >= client_s:
        return "emulator"
    if client_s >= BOUND_SHARE * wall_s:
        return "client"
    return "neither"


def measure(backend: Backend, s: Settings, rounds: int) -> None:
    """Warm up, time ``rounds`` interleaved rounds, check the bytes, print the figures."""
    print(f"\n== {backend.title}")
    for note in backend.notes:
        print(f"   note: {note}")
    for reason in warm_up(backend):
        print(f"   left out: {reason}")
    contest = Contest(backend.server_pid, profile=False)
    drops: dict[str, list[int]] = {}
    for round_number in range(rounds):
        saves, loads = list(backend.saves), list(backend.loads)
        if round_number % 2:
            saves.reverse()
            loads.reverse()
        for transfer in saves + loads:
            before = listen_drops()
            contest.time(transfer.name, transfer.run)
            drops.setdefault(transfer.name, []).append(listen_drops() - before)
    for transfer in backend.loads:
        if transfer.result is not None and transfer.result() != s.data:
            raise SystemExit(f"{transfer.name} returned different bytes")

    mib = s.size_bytes / MIB
    print(
        f"\n  {'transfer (medians)':<40} {'wall s':>7} {'MiB/s':>7} {'client CPU s':>13} "
        f"{'emulator CPU s':>15} {'bound by':>9} {'listen drops':>13}"
    )
    for name in contest.runs:
        wall, client, server = (contest.median(name, i) for i in range(3))
        bound = bound_by(wall, client, server)
        dropped = statistics.median(drops[name])
        print(f"  {name:<40} {wall:7.2f} {mib / wall:7.1f} {client:13.2f} {server:15.2f} {bound:>9} {dropped:13.0f}")
    print("\n  ratios spotrun / peer (throughput, medians; >= 1: spotrun is faster)")
    for group in (backend.saves, backend.loads):
        ours = [t.name for t in group if "spotrun" in t.name]
        peers = [t.name for t in group if "spotrun" not in t.name]
        for name in ours:
            ratios = ", ".join(
                f"{peer.split(': ', 1)[1]} {contest.median(peer) / contest.median(name):.2f}x" for peer in peers
            )
            print(f"  {name:<40} vs {ratios}")
    print("\n  every round (wall s):")
    for name, runs in contest.runs.items():
        print(f"  {name:<40} " + " ".join(f"{run[0]:6.2f}" for run in runs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("gcs", "azure", "both"), default="both")
    parser.add_argument("--size-mib", type=int, default=128, help="object size in MiB")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--part-size-mib", type=int, default=16, help="parts, blocks, chunks and ranges")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--chunk-mib", type=int, default=4, help="put_stream's chunk_bytes")
    args = parser.parse_args(argv)

    print(
        f"object: {args.size_mib} MiB, parts of {args.part_size_mib} MiB, concurrency {args.max_concurrency}, "
        f"{args.rounds} interleaved rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory(prefix="spotrun-bench-") as tmp_dir:
        settings = Settings(
            data=os.urandom(args.size_mib * MIB),
            part_size_bytes=args.part_size_mib * MIB,
            max_concurrency=args.max_concurrency,
            chunk_bytes=args.chunk_mib * MIB,
            tmp_dir=tmp_dir,
        )
        makers = {"gcs": [gcs_backend], "azure": [azure_backend], "both": [gcs_backend, azure_backend]}[args.backend]
        for make in makers:
            with make(settings) as backend:
                measure(backend, settings, args.rounds)


if __name__ == "__main__":
    main()
