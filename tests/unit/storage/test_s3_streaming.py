"""S3Storage.put_stream and read_into beyond the storage contract: part sizes, the memory
held, the requests made, and transfers cut mid-stream by the fault proxy in front of a
real moto server (tests/support/fault_proxy.py). The contract itself (atomicity, every chunk once,
scatter reads, past-the-end errors) is in tests/unit/storage/test_storage_contract.py.
"""

from __future__ import annotations

import signal
import threading
import tracemalloc
import urllib.parse
from typing import Any

import pytest

from spotrun.errors import StorageError
from spotrun.storage.options import ObjectStoreOptions
from spotrun.storage.part_sizes import S3_LIMITS, upload_part_size
from spotrun.storage.s3 import S3Options, S3Storage, make_client
from tests.support.byte_sources import BytesSource, ChunkRecorder
from tests.support.fault_proxy import CUT_REQUEST, DROP, LOST_RESPONSE, SLOW_DOWN, TRUNCATED_BODY, FaultRule
from tests.unit.storage.test_storage_contract import (
    MIB,
    FakeTime,
    WrappedClient,
    open_uploads,
    payload,
    recording,
)

PART_BYTES = 5 * MIB


MAX_PARTS = S3_LIMITS.max_parts


def storage_at(endpoint_url: str, bucket: str, *, wrap: dict[str, Any] | None = None, **options: Any) -> S3Storage:
    """S3Storage under prefix ``p``, 5 MiB parts (and ranged reads) from 6 MiB on, retries that
    never wait."""
    fake = FakeTime()
    opts = S3Options(
        **{
            "endpoint_url": endpoint_url,
            "multipart_threshold_bytes": 6 * MIB,
            "part_size_bytes": PART_BYTES,
            "max_part_size_bytes": PART_BYTES,
            "sleep": fake.sleep,
            "clock": fake.clock,
            **options,
        }
    )
    client = make_client(opts)
    if wrap is not None:
        client = WrappedClient(client, **{name: make(client) for name, make in wrap.items()})
    return S3Storage(bucket, "p", opts, client=client)


# --- part sizes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size_bytes", "part_bytes", "chunk_bytes", "expected"),
    [
        (100 * MIB, 16 * MIB, 4 * MIB, 16 * MIB),  # already a multiple
        (100 * MIB, 16 * MIB, 3 * MIB, 18 * MIB),  # rounded up to a multiple of the chunk
        (100 * MIB, 5 * MIB, 64 * 1024, 5 * MIB),
        (100 * MIB, 5 * MIB, 7 * MIB, 7 * MIB),  # a chunk larger than the part
        (MAX_PARTS * 16 * MIB + 1, 16 * MIB, MIB, 17 * MIB),  # grown to stay within 10,000 parts
    ],
    ids=["multiple", "rounded-up", "small-chunks", "large-chunk", "10000-parts"],
)
def test_stream_part_size(size_bytes, part_bytes, chunk_bytes, expected):
    """Parts of fixed size (``max_part_size_bytes`` = ``part_size_bytes``): whole chunks, at least
    S3's 5 MiB, within its 10,000 parts (the growing parts: tests/unit/storage/test_part_sizes.py)."""
    options = ObjectStoreOptions(part_size_bytes=part_bytes, max_part_size_bytes=part_bytes)
    part = upload_part_size(size_bytes, options, S3_LIMITS, chunk_bytes=chunk_bytes)
    assert part == expected
    assert part % chunk_bytes == 0 and part >= PART_BYTES and -(-size_bytes // part) <= MAX_PARTS


def test_put_stream_parts_are_whole_chunks(s3_bucket):
    bodies: list[int] = []

    def make(real):
        def upload_part(**kwargs):
            bodies.append(len(kwargs["Body"]))
            return real.upload_part(**kwargs)

        return upload_part

    storage = storage_at(s3_bucket.endpoint_url, s3_bucket.name, wrap={"upload_part": make})
    data = payload(20 * MIB + 5, seed=1)
    chunk_bytes = 3 * MIB
    storage.put_stream("obj", BytesSource(data), chunk_bytes=chunk_bytes)
    assert storage.get("obj") == data
    assert sorted(bodies) == [2 * MIB + 5, 6 * MIB, 6 * MIB, 6 * MIB]


def test_small_put_stream_is_one_put_object(s3_bucket):
    puts: list[dict] = []
    parts: list[dict] = []
    storage = storage_at(
        s3_bucket.endpoint_url,
        s3_bucket.name,
        wrap={"put_object": recording("put_object", puts), "upload_part": recording("upload_part", parts)},
    )
    data = payload(6 * MIB - 1, seed=2)
    storage.put_stream("obj", BytesSource(data), chunk_bytes=MIB)
    assert storage.get("obj") == data
    assert len(puts) == 1 and parts == []


# --- memory held ---------------------------------------------------------------------


class PartsHeld:
    """Counts the parts whose bytes are held: from the source's first read of a part until
    that part's upload_part call returns (or raises). Records the most held at once."""

    def __init__(self, part_bytes: int) -> None:
        self._part_bytes = part_bytes
        self._lock = threading.Lock()
        self._begun: set[int] = set()
        self.held = 0
        self.most = 0

    def read(self, offset: int) -> None:
        with self._lock:
            part = offset // self._part_bytes
            if part not in self._begun:
                self._begun.add(part)
                self.held += 1
                self.most = max(self.most, self.held)

    def wrap(self, real: Any):
        def upload_part(**kwargs):
            try:
                return real.upload_part(**kwargs)
            finally:
                with self._lock:
                    self.held -= 1

        return upload_part


class CountingSource(BytesSource):
    def __init__(self, data: bytes, parts: PartsHeld) -> None:
        super().__init__(data)
        self._parts = parts

    def readinto(self, offset: int, out: memoryview) -> None:
        self._parts.read(offset)
        super().readinto(offset, out)


@pytest.mark.parametrize("max_concurrency", [1, 3])
def test_put_stream_holds_at_most_max_concurrency_parts(s3_bucket, max_concurrency):
    parts = PartsHeld(PART_BYTES)
    storage = storage_at(
        s3_bucket.endpoint_url, s3_bucket.name, max_concurrency=max_concurrency, wrap={"upload_part": parts.wrap}
    )
    size_bytes = 8 * PART_BYTES + 3
    data = payload(size_bytes, seed=3)
    source = CountingSource(data, parts)
    tracemalloc.start()
    try:
        storage.put_stream("obj", source, chunk_bytes=MIB)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(
        f"most parts held {parts.most}, peak traced {peak_bytes / MIB:.1f} MiB for a {size_bytes / MIB:.0f} MiB object"
    )
    assert sum(length for _, length in source.reads) == size_bytes
    assert parts.most <= max_concurrency
    assert peak_bytes < (max_concurrency + 1) * PART_BYTES
    assert storage.get("obj") == data


def test_grown_parts_are_held_at_most_max_concurrency_at_once(s3_bucket):
    """Issue 26 point 2 (memory): parts grow with the object up to ``max_part_size_bytes``, and an
    upload still holds at most ``max_concurrency`` of them: a 40 MiB object with 2 streams and
    parts of up to 15 MiB goes up as 15 + 15 + 10 MiB, with under 3 parts' bytes held."""
    cap_bytes = 3 * PART_BYTES
    bodies: list[int] = []
    parts = PartsHeld(cap_bytes)

    def make(real):
        held = parts.wrap(real)

        def upload_part(**kwargs):
            bodies.append(len(kwargs["Body"]))
            return held(**kwargs)

        return upload_part

    storage = storage_at(
        s3_bucket.endpoint_url,
        s3_bucket.name,
        max_concurrency=2,
        max_part_size_bytes=cap_bytes,
        wrap={"upload_part": make},
    )
    size_bytes = 8 * PART_BYTES
    data = payload(size_bytes, seed=8)
    tracemalloc.start()
    try:
        storage.put_stream("obj", CountingSource(data, parts), chunk_bytes=MIB)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sorted(bodies) == [2 * PART_BYTES, cap_bytes, cap_bytes]
    assert parts.most <= 2
    assert peak_bytes < 3 * cap_bytes
    assert storage.get("obj") == data


class InterruptingSource(BytesSource):
    """Sends SIGINT to the main thread when part 2 is read, and returns only once the main
    thread has taken it (as Ctrl-C arriving while the parts are uploading)."""

    def __init__(self, data: bytes, interrupted: threading.Event) -> None:
        super().__init__(data)
        self._interrupted = interrupted

    def readinto(self, offset: int, out: memoryview) -> None:
        if offset == PART_BYTES:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            assert self._interrupted.wait(timeout=60), "the main thread never took the SIGINT"
        super().readinto(offset, out)


def test_ctrl_c_during_put_stream_aborts_the_upload(s3_bucket):
    interrupted = threading.Event()

    def on_sigint(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    storage = storage_at(s3_bucket.endpoint_url, s3_bucket.name, max_concurrency=2)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            storage.put_stream("obj", InterruptingSource(payload(4 * PART_BYTES), interrupted), chunk_bytes=MIB)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted.is_set()
    assert storage.exists("obj") is False
    assert open_uploads(s3_bucket) == []


# --- requests made -------------------------------------------------------------------


def test_read_into_of_one_part_is_one_get_and_more_are_pinned_ranges(s3_bucket):
    gets: list[dict] = []
    storage = storage_at(s3_bucket.endpoint_url, s3_bucket.name, wrap={"get_object": recording("get_object", gets)})
    data = payload(3 * PART_BYTES, seed=4)
    storage.put("obj", data)
    small = bytearray(PART_BYTES)
    storage.read_into("obj", 7, [small])
    assert small == data[7 : 7 + PART_BYTES]
    assert [call["Range"] for call in gets] == [f"bytes=7-{PART_BYTES + 6}"]
    gets.clear()
    rest = bytearray(2 * PART_BYTES + 1)
    storage.read_into("obj", PART_BYTES - 1, [rest])
    assert rest == data[PART_BYTES - 1 :]
    assert len(gets) == 3 and {call["Range"] for call in gets} == {
        f"bytes={PART_BYTES - 1}-{2 * PART_BYTES - 2}",
        f"bytes={2 * PART_BYTES - 1}-{3 * PART_BYTES - 2}",
        f"bytes={3 * PART_BYTES - 1}-{3 * PART_BYTES - 1}",
    }
    assert ["IfMatch" in call for call in gets].count(False) == 1  # the first fixes the ETag


def test_object_replaced_during_read_into_is_reported(s3_bucket):
    calls: list[dict] = []

    def make(real):
        def get_object(**kwargs):
            calls.append(kwargs)
            if len(calls) == 2:  # after the first range, another writer replaces the object
                real.put_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=payload(3 * PART_BYTES, 9))
            return real.get_object(**kwargs)

        return get_object

    storage = storage_at(s3_bucket.endpoint_url, s3_bucket.name, max_concurrency=1, wrap={"get_object": make})
    storage.put("obj", payload(3 * PART_BYTES, seed=5))
    with pytest.raises(StorageError, match="replaced"):
        storage.read_into("obj", 0, [bytearray(3 * PART_BYTES)])


# --- transfers cut mid-stream (fault proxy) ------------------------------------------


PROXY_SEED = 11  # the proxy fixture's (conftest.py)


def part_upload(number: int):
    """Predicate: the upload of multipart part ``number``."""

    def match(request) -> bool:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.path).query)
        return request.method == "PUT" and query.get("partNumber") == [str(number)]

    return match


def ranged_get(first_byte: int):
    """Predicate: a GET of a range that starts at ``first_byte``."""
    return lambda request: (
        request.method == "GET" and request.headers.get("range", "").startswith(f"bytes={first_byte}-")
    )


def test_part_cut_mid_upload_is_retried_and_the_object_is_exact(s3_bucket, proxy):
    kinds = (CUT_REQUEST, DROP, LOST_RESPONSE, SLOW_DOWN)
    proxy.set_rule(FaultRule(count=len(kinds), kinds=kinds, match=part_upload(2)))
    storage = storage_at(proxy.url, s3_bucket.name, max_concurrency=2)
    data = payload(3 * PART_BYTES + 17, seed=6)
    chunks = ChunkRecorder()
    storage.put_stream("obj", BytesSource(data), chunk_bytes=MIB, on_chunk=chunks)
    assert [i.kind for i in proxy.injected] == list(kinds)
    direct = storage_at(s3_bucket.endpoint_url, s3_bucket.name)
    assert direct.get("obj") == data
    chunks.assert_covers_once(data, MIB)  # a retried part is sent again, not read again
    assert open_uploads(s3_bucket) == []


def test_range_cut_mid_body_is_retried_and_the_bytes_are_exact(s3_bucket, proxy):
    data = payload(3 * PART_BYTES, seed=7)
    storage = storage_at(proxy.url, s3_bucket.name)
    storage.put("obj", data)
    kinds = (TRUNCATED_BODY, DROP, TRUNCATED_BODY)
    for first_byte in (3, PART_BYTES + 3):  # the range that fixes the ETag, and a later one
        proxy.set_rule(FaultRule(count=len(kinds), kinds=kinds, match=ranged_get(first_byte)))
        views = [memoryview(bytearray(2 * PART_BYTES)), memoryview(bytearray(PART_BYTES - 3))]
        storage.read_into("obj", 3, views)
        assert b"".join(bytes(v) for v in views) == data[3:]
    assert len(proxy.injected) == 2 * len(kinds)
