"""Upload/download throughput of S3Storage against s3fs's plain ``pipe``/``cat``.

Not a test: it prints figures. By default it starts its own moto server on 127.0.0.1
(the same helper the tests use); ``--endpoint-url`` points it at another S3-compatible
server (MinIO...), using the credentials of the environment. Against moto the figures
mostly measure moto itself (a Python server), so compare the two clients with each
other, not with real S3.

    .venv/bin/python benchmarks/s3_throughput.py [--size-mib 256] [--endpoint-url URL]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from spotrun.storage.s3 import S3Options, S3Storage, make_client  # noqa: E402
from tests.s3_server import FAKE_CREDENTIALS, moto_server  # noqa: E402

MIB = 1024 * 1024


@contextlib.contextmanager
def endpoint(url: str | None) -> Iterator[str]:
    """The given endpoint, or a fresh moto server (with fake credentials) for the run."""
    if url:
        yield url
        return
    for name, value in FAKE_CREDENTIALS.items():
        os.environ.setdefault(name, value)
    with moto_server() as started:
        yield started


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Seconds ``fn`` took (wall clock) and its result."""
    start_s = time.perf_counter()
    result = fn()
    return time.perf_counter() - start_s, result


def report(label: str, size_bytes: int, seconds: float) -> None:
    print(f"  {label:<34} {seconds:7.2f} s  {size_bytes / MIB / seconds:8.1f} MiB/s", flush=True)


def bench_spotrun(url: str, bucket: str, data: bytes, options: S3Options) -> None:
    storage = S3Storage(bucket, "spotrun", options)
    print(
        f"spotrun S3Storage (part {options.part_size_bytes // MIB} MiB, "
        f"concurrency {options.max_concurrency}):"
    )
    seconds, _ = timed(lambda: storage.put("blob", data))
    report("put (multipart upload)", len(data), seconds)
    seconds, got = timed(lambda: storage.get("blob"))
    report("get (ranged GETs)", len(data), seconds)
    if got != data:
        raise SystemExit("S3Storage returned different bytes")
    storage.delete("blob")


def bench_s3fs(url: str, bucket: str, data: bytes) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(
        key=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        client_kwargs={"endpoint_url": url, "region_name": os.environ.get("AWS_REGION", "us-east-1")},
    )
    path = f"{bucket}/s3fs/blob"
    print("s3fs (defaults):")
    seconds, _ = timed(lambda: fs.pipe(path, data))
    report("pipe", len(data), seconds)
    seconds, got = timed(lambda: fs.cat(path))
    report("cat", len(data), seconds)
    if got != data:
        raise SystemExit("s3fs returned different bytes")
    fs.rm(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="object size in MiB")
    parser.add_argument("--endpoint-url", default=None, help="use this server, not a new moto")
    parser.add_argument("--part-size-mib", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=8)
    args = parser.parse_args(argv)

    data = os.urandom(args.size_mib * MIB)
    print(f"object: {args.size_mib} MiB, one run each, {os.cpu_count()} CPUs")
    with endpoint(args.endpoint_url) as url:
        print(f"endpoint: {url}" + ("" if args.endpoint_url else " (moto server started here)"))
        options = S3Options(
            endpoint_url=url,
            part_size_bytes=args.part_size_mib * MIB,
            max_concurrency=args.max_concurrency,
        )
        client = make_client(options)
        bucket = f"spotrun-bench-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        try:
            bench_spotrun(url, bucket, data, options)
            bench_s3fs(url, bucket, data)
        finally:
            with contextlib.suppress(Exception):
                client.delete_bucket(Bucket=bucket)


if __name__ == "__main__":
    main()
