"""The storage contract, run against every backend, plus S3-specific behaviour.

``TestStorageContract`` runs once per backend: LocalStorage in a temporary directory,
S3Storage against a real moto server process (with a key prefix and an explicit
endpoint, and at the bucket root with the endpoint taken from ``AWS_ENDPOINT_URL``), and
S3Storage against a real Ceph RADOS Gateway (``tests/support/rgw_server.py``: installed and
started by the test session; it checks credentials and pages listings by 1,000).
The S3 tests after it cover multipart abort (field case C07), ranged reads, error
translation against the real server, and the retry policy with an injected clock.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import urllib3.exceptions
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
    SSLError,
)

from spotrun.errors import (
    ConfigError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooShortError,
    SaveAbortedError,
    StorageError,
    StoragePermissionError,
)
from spotrun.storage import LocalStorage, open_storage
from spotrun.storage.s3 import S3Options, S3Storage, make_client, parse_s3_uri
from spotrun.storage.s3_errors import is_retryable, translate
from spotrun.storage.s3_retry import RetryPolicy
from tests.support.byte_sources import BytesSource, ChunkRecorder
from tests.support.fake_time import FakeTime
from tests.support.s3_server import failing_http_server, free_loopback_port

MIB = 1024 * 1024
#: Small enough to keep tests fast, large enough to need three 5 MiB parts.
LARGE_BYTES = 12 * MIB + 123
SMALL_TRANSFER = {"multipart_threshold_bytes": 6 * MIB, "part_size_bytes": 5 * MIB, "max_part_size_bytes": 5 * MIB}


def payload(size_bytes: int, seed: int = 0) -> bytes:
    """Reproducible pseudo-random bytes."""
    return random.Random(seed).randbytes(size_bytes)


class WrappedClient:
    """Delegates to a real boto3 client, except for the methods given as overrides."""

    def __init__(self, real: Any, **overrides: Any) -> None:
        self._real = real
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides.get(name) or getattr(self._real, name)


def client_error(code: str, status: int, operation: str = "PutObject") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "injected"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        operation,
    )


# --- the contract, once per backend -----------------------------------------------


#: Installing Ceph (first use on a fresh machine) and starting it count against the first test.
RGW_SETUP_TIMEOUT_S = 1200
#: Installing Azurite from npm (first use on a fresh machine) and starting it, likewise.
AZURITE_SETUP_TIMEOUT_S = 600


@pytest.fixture(
    params=[
        "local",
        "s3-prefix",
        "s3-root",
        pytest.param("rgw", marks=pytest.mark.timeout(RGW_SETUP_TIMEOUT_S)),
        "gcs",
        pytest.param("azure", marks=pytest.mark.timeout(AZURITE_SETUP_TIMEOUT_S)),
    ]
)
def storage(request: pytest.FixtureRequest, tmp_path) -> Any:
    if request.param == "local":
        return LocalStorage(str(tmp_path / "store"), fsync=False)
    if request.param == "gcs":  # gcp-storage-emulator behind the precondition proxy (tests/support/gcs_server.py)
        bucket = request.getfixturevalue("gcs_bucket")
        return open_storage(f"{bucket.uri}/runs/exp1", **SMALL_TRANSFER)
    if request.param == "azure":  # Azurite (tests/support/azurite_server.py)
        container = request.getfixturevalue("azure_container")
        return open_storage(f"{container.uri}/runs/exp1", **SMALL_TRANSFER)
    if request.param == "rgw":
        bucket = request.getfixturevalue("rgw_bucket")
        return open_storage(f"{bucket.uri}/runs/exp1", **SMALL_TRANSFER)
    bucket = request.getfixturevalue("s3_bucket")
    if request.param == "s3-prefix":
        return open_storage(f"{bucket.uri}/runs/exp1/", endpoint_url=bucket.endpoint_url, **SMALL_TRANSFER)
    return open_storage(bucket.uri, **SMALL_TRANSFER)  # endpoint from AWS_ENDPOINT_URL


class TestStorageContract:
    @pytest.mark.parametrize("data", [b"", b"hello", bytes(range(256)) * 64], ids=["empty", "text", "binary"])
    def test_put_get_roundtrip(self, storage, data):
        storage.put("step-1/rank-0.bin", data)
        assert storage.get("step-1/rank-0.bin") == data
        assert storage.stat("step-1/rank-0.bin").size_bytes == len(data)

    def test_put_accepts_bytearray_and_memoryview(self, storage):
        storage.put("a", bytearray(b"abc"))
        storage.put("b", memoryview(b"xyz"))
        assert (storage.get("a"), storage.get("b")) == (b"abc", b"xyz")

    def test_overwrite_replaces_content(self, storage):
        storage.put("k", b"old content")
        storage.put("k", b"new")
        assert storage.get("k") == b"new"

    def test_put_if_absent_wins_once(self, storage):
        storage.put_if_absent("manifest.json", b"first")
        with pytest.raises(ObjectExistsError) as info:
            storage.put_if_absent("manifest.json", b"second")
        assert isinstance(info.value, FileExistsError)
        assert storage.get("manifest.json") == b"first"

    def test_concurrent_put_if_absent_has_one_winner(self, storage):
        writers = 8
        barrier = threading.Barrier(writers)
        winners: list[int] = []
        losers: list[int] = []
        unexpected: list[BaseException] = []

        def write(i: int) -> None:
            barrier.wait()
            try:
                storage.put_if_absent("commit", f"writer-{i}".encode())
                winners.append(i)
            except ObjectExistsError:
                losers.append(i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                unexpected.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert unexpected == []
        assert len(winners) == 1 and len(losers) == writers - 1
        assert storage.get("commit") == f"writer-{winners[0]}".encode()

    @pytest.mark.parametrize("operation", ["get", "stat"])
    def test_missing_key_is_not_found(self, storage, operation):
        with pytest.raises(ObjectNotFoundError) as info:
            getattr(storage, operation)("no/such/key")
        assert isinstance(info.value, FileNotFoundError)
        assert storage.exists("no/such/key") is False

    def test_exists_after_put(self, storage):
        storage.put("x/y", b"1")
        assert storage.exists("x/y") is True

    def test_list_is_sorted_recursive_and_filtered_by_prefix(self, storage):
        keys = ["b", "a/2", "a/1", "a/sub/x", "ab", "c/d/e"]
        for i, key in enumerate(keys):
            storage.put(key, b"z" * i)
        infos = storage.list()
        assert [info.key for info in infos] == sorted(keys)
        assert {info.key: info.size_bytes for info in infos} == {k: i for i, k in enumerate(keys)}
        assert [info.key for info in storage.list("a/")] == ["a/1", "a/2", "a/sub/x"]
        assert [info.key for info in storage.list("a")] == ["a/1", "a/2", "a/sub/x", "ab"]
        assert storage.list("zzz/") == []

    def test_list_of_more_than_one_page(self, storage):
        """RGW and AWS return at most 1,000 keys per ListObjectsV2 page; every key is listed."""
        keys = [f"many/{i:05d}" for i in range(1100)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda key: storage.put(key, b"."), keys))
        assert [info.key for info in storage.list("many/")] == keys

    def test_delete(self, storage):
        storage.put("gone", b"1")
        storage.put("kept", b"2")
        storage.delete("gone")
        storage.delete("never-existed")  # not an error
        assert [info.key for info in storage.list()] == ["kept"]

    def test_delete_prefix(self, storage):
        for key in ["step-1/a", "step-1/b/c", "step-10/a", "step-2/a"]:
            storage.put(key, b".")
        assert storage.delete_prefix("step-1/") == 2
        assert [info.key for info in storage.list()] == ["step-10/a", "step-2/a"]
        with pytest.raises(ConfigError):
            storage.delete_prefix("step-2")

    def test_large_object_roundtrip(self, storage):
        data = payload(LARGE_BYTES)
        storage.put("big.safetensors", data)
        assert storage.stat("big.safetensors").size_bytes == LARGE_BYTES
        assert storage.get("big.safetensors") == data

    # --- put_stream and read_into ----------------------------------------------------

    @pytest.mark.parametrize(
        ("size_bytes", "chunk_bytes"),
        [(0, 64), (1000, 64), (LARGE_BYTES, MIB), (LARGE_BYTES, 3 * MIB + 1)],
        ids=["empty", "small", "large", "large-odd-chunks"],
    )
    def test_put_stream_stores_the_source_and_shows_every_chunk_once(self, storage, size_bytes, chunk_bytes):
        data = payload(size_bytes, seed=3)
        chunks = ChunkRecorder()
        storage.put_stream("step-1/shard", BytesSource(data), chunk_bytes=chunk_bytes, on_chunk=chunks)
        assert storage.get("step-1/shard") == data
        assert storage.stat("step-1/shard").size_bytes == size_bytes
        chunks.assert_covers_once(data, chunk_bytes)

    def test_put_stream_replaces_an_existing_object(self, storage):
        storage.put("k", b"old content")
        storage.put_stream("k", BytesSource(b"new"), chunk_bytes=2)
        assert storage.get("k") == b"new"

    @pytest.mark.parametrize("size_bytes", [1000, LARGE_BYTES], ids=["small", "large"])
    @pytest.mark.parametrize("failure", ["source-save-aborted", "source-keyboard-interrupt", "on-chunk-error"])
    def test_put_stream_failure_leaves_nothing(self, storage, failure, size_bytes):
        """A source or on_chunk that raises in the middle: the old object stays, a new key
        stays absent, no multipart upload is left open, and the error is the caller's own."""
        data = payload(size_bytes, seed=4)
        errors = {
            "source-save-aborted": SaveAbortedError("an emergency save replaced this one"),
            "source-keyboard-interrupt": KeyboardInterrupt(),
            "on-chunk-error": RuntimeError("checksum worker died"),
        }
        error = errors[failure]
        storage.put("k", b"old content")
        for key in ("k", "fresh"):
            if failure == "on-chunk-error":
                source, on_chunk = BytesSource(data), ChunkRecorder(fail_at=size_bytes // 2, error=error)
            else:
                source, on_chunk = BytesSource(data, fail_at=size_bytes // 2, error=error), None
            with pytest.raises(type(error)) as info:
                storage.put_stream(key, source, chunk_bytes=256 * 1024, on_chunk=on_chunk)
            assert info.value is error
        assert storage.get("k") == b"old content"
        assert storage.exists("fresh") is False
        assert [info.key for info in storage.list()] == ["k"]
        assert open_uploads_of(storage) == []

    def test_read_into_scatters_a_range_into_several_views(self, storage):
        data = payload(LARGE_BYTES, seed=5)
        storage.put("big", data)
        sizes = [MIB + 7, 0, 5 * MIB, 3, 2 * MIB]  # crosses 5 MiB boundaries (S3 parts here)
        views = [memoryview(bytearray(n)) for n in sizes]
        offset = 4 * MIB + 1
        storage.read_into("big", offset, views)
        assert b"".join(bytes(v) for v in views) == data[offset : offset + sum(sizes)]

    def test_read_into_ranges_at_the_end(self, storage):
        data = payload(LARGE_BYTES, seed=6)
        storage.put("big", data)
        whole = bytearray(LARGE_BYTES)
        storage.read_into("big", 0, [memoryview(whole)])
        assert whole == data
        tail = [bytearray(60), bytearray(40)]
        storage.read_into("big", LARGE_BYTES - 100, tail)
        assert b"".join(tail) == data[-100:]
        storage.read_into("big", LARGE_BYTES, [])  # an empty range at the very end
        storage.put("small", b"0123456789")
        last = bytearray(3)
        storage.read_into("small", 7, [last])
        assert last == b"789"

    @pytest.mark.parametrize(
        ("offset", "length"),
        [(990, 11), (1001, 1), (0, 1001), (2000, 0)],
        ids=["crossing-the-end", "after-the-end", "whole-plus-one", "empty-after-the-end"],
    )
    def test_read_into_past_the_end_is_an_error(self, storage, offset, length):
        storage.put("obj", payload(1000))
        with pytest.raises(ObjectTooShortError):  # the reader reports a short shard as corrupt
            storage.read_into("obj", offset, [bytearray(length)])

    def test_read_into_missing_key_is_not_found(self, storage):
        with pytest.raises(ObjectNotFoundError):
            storage.read_into("no/such/key", 0, [bytearray(10)])

    def test_bad_keys_are_rejected(self, storage):
        for key in ["", "/abs", "dir/", "a//b", "a/../b", "./a", ".."]:
            for operation in (
                lambda: storage.put(key, b"x"),
                lambda: storage.put_if_absent(key, b"x"),
                lambda: storage.get(key),
                lambda: storage.stat(key),
                lambda: storage.delete(key),
            ):
                with pytest.raises(ConfigError):
                    operation()
        for prefix in ["/abs", "../up"]:
            with pytest.raises(ConfigError):
                storage.list(prefix)
        assert storage.list() == []


def open_uploads_of(storage: Any) -> list[Any]:
    """Writes left unfinished under a storage's root: S3 multipart uploads (asked of the
    store itself), and every backend's own account of them (``unfinished_uploads``)."""
    found: list[Any] = list(storage.unfinished_uploads(""))
    if isinstance(storage, S3Storage):
        _, root = parse_s3_uri(storage.uri)
        found += storage.client.list_multipart_uploads(Bucket=storage.bucket, Prefix=root).get("Uploads", [])
    return found


# --- S3: multipart, ranged reads, layout -------------------------------------------


def s3_storage(bucket, *, wrap: dict[str, Any] | None = None, **options: Any) -> S3Storage:
    """S3Storage under prefix ``p`` on the test bucket; ``wrap`` overrides client methods."""
    opts = S3Options(**{"endpoint_url": bucket.endpoint_url, **SMALL_TRANSFER, **options})
    client = make_client(opts)
    if wrap is not None:
        client = WrappedClient(client, **{name: make(client) for name, make in wrap.items()})
    return S3Storage(bucket.name, "p", opts, client=client)


def open_uploads(bucket) -> list[dict]:
    raw = make_client(S3Options(endpoint_url=bucket.endpoint_url))
    return raw.list_multipart_uploads(Bucket=bucket.name).get("Uploads", [])


def recording(method_name: str, calls: list[dict]):
    """A wrap factory that records the keyword arguments of every call, then delegates."""

    def make(real):
        method = getattr(real, method_name)

        def record(**kwargs):
            calls.append({k: v for k, v in kwargs.items() if k != "Body"})
            return method(**kwargs)

        return record

    return make


def failing_part(number: int, error: BaseException, uploaded: list[int]):
    """A wrap factory for ``upload_part`` that raises ``error`` for part ``number``."""

    def make(real):
        def upload_part(**kwargs):
            if kwargs["PartNumber"] == number:
                raise error
            response = real.upload_part(**kwargs)
            uploaded.append(kwargs["PartNumber"])
            return response

        return upload_part

    return make


@pytest.mark.parametrize("max_concurrency", [1, 4])
def test_a_put_whose_source_raises_mid_way_leaves_no_object_and_no_open_upload(s3_bucket, max_concurrency):
    """C07: 3 of 5 chunks written, then the 4th raises -> no object, no open upload."""
    uploaded: list[int] = []
    storage = s3_storage(
        s3_bucket,
        max_concurrency=max_concurrency,
        wrap={"upload_part": failing_part(4, RuntimeError("writer died"), uploaded)},
    )
    data = payload(4 * 5 * MIB + 1000)  # five parts: 4 x 5 MiB + 1000 bytes
    with pytest.raises(RuntimeError, match="writer died"):
        storage.put("step-1/rank-0.safetensors", data)
    if max_concurrency == 1:
        assert uploaded == [1, 2, 3]
    assert storage.exists("step-1/rank-0.safetensors") is False
    assert storage.list() == []
    assert open_uploads(s3_bucket) == []


def test_multipart_aborted_when_part_retries_run_out(s3_bucket):
    fake = FakeTime()
    storage = s3_storage(
        s3_bucket,
        retry_deadline_s=3,
        sleep=fake.sleep,
        clock=fake.clock,
        wrap={"upload_part": failing_part(2, client_error("InternalError", 500, "UploadPart"), [])},
    )
    with pytest.raises(StorageError) as info:
        storage.put("big", payload(LARGE_BYTES))
    assert isinstance(info.value.__cause__, ClientError)
    assert len(fake.sleeps_s) >= 1 and sum(fake.sleeps_s) < 3
    assert storage.exists("big") is False
    assert open_uploads(s3_bucket) == []


def test_multipart_aborted_when_completion_fails(s3_bucket):
    def make(real):
        def complete_multipart_upload(**kwargs):
            raise client_error("AccessDenied", 403, "CompleteMultipartUpload")

        return complete_multipart_upload

    storage = s3_storage(s3_bucket, wrap={"complete_multipart_upload": make})
    with pytest.raises(StoragePermissionError):
        storage.put("big", payload(LARGE_BYTES))
    assert storage.exists("big") is False
    assert open_uploads(s3_bucket) == []


def test_large_objects_use_parallel_parts_and_ranges(s3_bucket):
    parts: list[dict] = []
    gets: list[dict] = []
    storage = s3_storage(
        s3_bucket,
        wrap={"upload_part": recording("upload_part", parts), "get_object": recording("get_object", gets)},
    )
    data = payload(LARGE_BYTES, seed=1)
    storage.put("big", data)
    assert sorted(call["PartNumber"] for call in parts) == [1, 2, 3]
    assert storage.get("big") == data
    assert {call["Range"] for call in gets} == {
        f"bytes=0-{5 * MIB - 1}",
        f"bytes={5 * MIB}-{10 * MIB - 1}",
        f"bytes={10 * MIB}-{LARGE_BYTES - 1}",
    }
    assert len(gets) == 3


def test_small_objects_take_one_request_each_way(s3_bucket):
    parts: list[dict] = []
    gets: list[dict] = []
    storage = s3_storage(
        s3_bucket,
        wrap={"upload_part": recording("upload_part", parts), "get_object": recording("get_object", gets)},
    )
    storage.put("small", b"abc")
    assert storage.get("small") == b"abc"
    assert parts == [] and len(gets) == 1


def test_large_put_if_absent_is_one_conditional_put(s3_bucket):
    """Above the multipart threshold too, put_if_absent is one PutObject with If-None-Match:
    a conditional multipart completion is not enforced everywhere (RGW overwrites)."""
    puts: list[dict] = []
    multipart: list[dict] = []
    storage = s3_storage(
        s3_bucket,
        wrap={
            "put_object": recording("put_object", puts),
            "create_multipart_upload": recording("create_multipart_upload", multipart),
        },
    )
    first = payload(LARGE_BYTES, seed=1)
    storage.put_if_absent("big", first)
    with pytest.raises(ObjectExistsError):
        storage.put_if_absent("big", payload(LARGE_BYTES, seed=2))
    assert storage.get("big") == first
    assert [call["IfNoneMatch"] for call in puts] == ["*", "*"] and multipart == []
    assert open_uploads(s3_bucket) == []


def test_object_replaced_during_ranged_read_is_reported(s3_bucket):
    calls = []

    def make(real):
        def get_object(**kwargs):
            calls.append(kwargs.get("Range"))
            if len(calls) == 2:  # after the first range was read, another writer replaces it
                real.put_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=payload(LARGE_BYTES, 9))
            return real.get_object(**kwargs)

        return get_object

    storage = s3_storage(s3_bucket, max_concurrency=1, wrap={"get_object": make})
    storage.put("big", payload(LARGE_BYTES, seed=1))
    with pytest.raises(StorageError) as info:
        storage.get("big")
    assert not isinstance(info.value, ObjectNotFoundError)


@pytest.mark.parametrize(("uri", "raw_key"), [("s3://{b}/pre/fix/", "pre/fix/x/y"), ("s3://{b}", "x/y")])
def test_keys_are_prefix_slash_key(s3_bucket, uri, raw_key):
    storage = open_storage(uri.format(b=s3_bucket.name))
    assert storage.uri == uri.format(b=s3_bucket.name).rstrip("/")
    storage.put("x/y", b"1")
    raw = make_client(S3Options(endpoint_url=s3_bucket.endpoint_url))
    assert [obj["Key"] for obj in raw.list_objects_v2(Bucket=s3_bucket.name)["Contents"]] == [raw_key]


def test_lost_response_of_own_conditional_put_is_success(s3_bucket):
    """The first attempt lands but its response is lost; the retry's 412 is our own object."""
    attempts = []

    def make(real):
        def put_object(**kwargs):
            attempts.append(1)
            response = real.put_object(**kwargs)
            if len(attempts) == 1:
                raise ConnectionClosedError(endpoint_url=s3_bucket.endpoint_url)
            return response

        return put_object

    fake = FakeTime()
    storage = s3_storage(s3_bucket, sleep=fake.sleep, clock=fake.clock, wrap={"put_object": make})
    storage.put_if_absent("manifest.json", b"mine")
    assert len(attempts) == 2
    assert storage.get("manifest.json") == b"mine"


# --- S3: errors against the real server ----------------------------------------------


def test_missing_bucket_names_the_bucket(s3_bucket):
    storage = open_storage("s3://spotrun-no-such-bucket/p")
    for operation in (lambda: storage.get("k"), lambda: storage.put("k", b"1"), storage.list):
        with pytest.raises(ObjectNotFoundError, match="spotrun-no-such-bucket") as info:
            operation()
        assert isinstance(info.value.__cause__, ClientError)


def test_unknown_credentials_are_permission_errors(s3_bucket, moto_endpoint_enforcing_auth):
    storage = open_storage("s3://some-bucket", endpoint_url=moto_endpoint_enforcing_auth)
    for operation in (lambda: storage.get("k"), lambda: storage.stat("k"), lambda: storage.put("k", b"1")):
        with pytest.raises(StoragePermissionError) as info:
            operation()
        assert isinstance(info.value, PermissionError)
        assert isinstance(info.value.__cause__, ClientError)


def test_no_credentials_is_a_permission_error(s3_bucket, monkeypatch):
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ):
        monkeypatch.delenv(name, raising=False)
    storage = open_storage(s3_bucket.uri)
    with pytest.raises(StoragePermissionError, match="no AWS credentials"):
        storage.get("k")


def test_endpoint_not_listening_fails_within_deadline(s3_bucket):
    endpoint = f"http://127.0.0.1:{free_loopback_port()}"
    fake = FakeTime()
    storage = open_storage("s3://b-1/p", endpoint_url=endpoint, retry_deadline_s=5, sleep=fake.sleep, clock=fake.clock)
    with pytest.raises(StorageError, match=endpoint) as info:
        storage.put("k", b"1")
    assert not isinstance(info.value, (ObjectNotFoundError, StoragePermissionError))
    assert isinstance(info.value.__cause__, EndpointConnectionError)
    assert len(fake.sleeps_s) >= 2 and sum(fake.sleeps_s) < 5


def test_botocore_does_not_retry_on_its_own(s3_bucket):
    fake = FakeTime()
    with failing_http_server(503, "SlowDown") as (endpoint, requests):
        storage = open_storage(
            "s3://b-1/p", endpoint_url=endpoint, retry_deadline_s=2, sleep=fake.sleep, clock=fake.clock
        )
        with pytest.raises(StorageError):
            storage.put("k", b"1")
    assert len(fake.sleeps_s) >= 1
    assert len(requests) == len(fake.sleeps_s) + 1  # one request per tenacity attempt


# --- S3: error translation and retry policy (no server) -----------------------------


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        ("NoSuchKey", 404, ObjectNotFoundError),
        ("404", 404, ObjectNotFoundError),
        ("AccessDenied", 403, StoragePermissionError),
        ("403", 403, StoragePermissionError),
        ("InvalidAccessKeyId", 403, StoragePermissionError),
        ("SignatureDoesNotMatch", 403, StoragePermissionError),
        ("InternalError", 500, StorageError),
    ],
)
def test_translation_by_error_code(code, status, expected):
    error = translate(client_error(code, status), what="get s3://b/k", bucket="b")
    assert type(error) is expected
    assert "get s3://b/k" in str(error)


def test_translation_ignores_message_text():
    exc = ClientError(
        {
            "Error": {"Code": "AccessDenied", "Message": "NoSuchKey NoSuchBucket"},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        },
        "GetObject",
    )
    assert type(translate(exc, what="get", bucket="b")) is StoragePermissionError


def test_missing_bucket_translation_names_bucket():
    error = translate(client_error("NoSuchBucket", 404), what="get", bucket="my-bucket")
    assert isinstance(error, ObjectNotFoundError) and "my-bucket" in str(error)


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (client_error("SlowDown", 503), True),
        (client_error("InternalError", 500), True),
        (client_error("502", 502), True),
        (client_error("504", 504), True),
        (client_error("Throttling", 400), True),
        (client_error("RequestTimeout", 400), True),
        (EndpointConnectionError(endpoint_url="http://x"), True),
        (ConnectionClosedError(endpoint_url="http://x"), True),
        (ReadTimeoutError(endpoint_url="http://x"), True),
        (urllib3.exceptions.ProtocolError("reset"), True),
        (client_error("NoSuchKey", 404), False),
        (client_error("AccessDenied", 403), False),
        (client_error("PreconditionFailed", 412), False),
        (SSLError(endpoint_url="http://x", error="bad cert"), False),
        (ValueError("bug"), False),
    ],
)
def test_retryable_classification(exc, retry):
    assert is_retryable(exc) is retry


def flaky(failures: int, error: BaseException):
    """A function that raises ``error`` ``failures`` times, then returns "ok"; counts calls."""
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= failures:
            raise error
        return "ok"

    return fn, calls


def test_retry_until_success():
    fake = FakeTime()
    policy = RetryPolicy(deadline_s=60, max_backoff_s=4, sleep=fake.sleep, clock=fake.clock)
    fn, calls = flaky(3, client_error("SlowDown", 503))
    assert policy.call(fn, what="put") == "ok"
    assert len(calls) == 4
    assert len(fake.sleeps_s) == 3 and all(0 <= s <= 4 for s in fake.sleeps_s)


def test_retry_stops_before_deadline():
    fake = FakeTime()
    policy = RetryPolicy(deadline_s=2, sleep=fake.sleep, clock=fake.clock)
    error = client_error("SlowDown", 503)
    fn, calls = flaky(10**6, error)
    with pytest.raises(ClientError) as info:
        policy.call(fn, what="put")
    assert info.value is error
    assert len(calls) > 1 and fake.now_s < 2


def test_caller_deadline_is_earlier_than_policy_deadline():
    fake = FakeTime()
    policy = RetryPolicy(deadline_s=100, sleep=fake.sleep, clock=fake.clock)
    fn, _ = flaky(10**6, client_error("SlowDown", 503))
    with pytest.raises(ClientError):
        policy.call(fn, what="put", deadline_at=policy.deadline_from_now(0.5))
    assert fake.now_s < 0.5


def test_no_retry_for_permanent_errors():
    fake = FakeTime()
    policy = RetryPolicy(sleep=fake.sleep, clock=fake.clock)
    fn, calls = flaky(1, client_error("NoSuchKey", 404))
    with pytest.raises(ClientError):
        policy.call(fn, what="get")
    assert len(calls) == 1 and fake.sleeps_s == []


def test_storage_retries_throttled_put(s3_bucket):
    def make(real):
        fn, _ = flaky(2, client_error("SlowDown", 503))

        def put_object(**kwargs):
            fn()
            return real.put_object(**kwargs)

        return put_object

    fake = FakeTime()
    storage = s3_storage(s3_bucket, sleep=fake.sleep, clock=fake.clock, wrap={"put_object": make})
    storage.put("k", b"data")
    assert storage.get("k") == b"data"
    assert len(fake.sleeps_s) == 2


def test_deadline_block_bounds_retries(s3_bucket):
    calls: list[dict] = []

    def make(real):
        def put_object(**kwargs):
            calls.append(kwargs)
            raise client_error("SlowDown", 503)

        return put_object

    fake = FakeTime()
    storage = s3_storage(s3_bucket, retry_deadline_s=100, sleep=fake.sleep, clock=fake.clock, wrap={"put_object": make})
    with storage.deadline(1.0), pytest.raises(StorageError):
        storage.put("k", b"1")
    assert fake.now_s < 1.0
    calls.clear()
    with storage.deadline(0), pytest.raises(StorageError):
        storage.put("k", b"1")
    assert calls == []  # the deadline had passed: no request at all


# --- S3: configuration ---------------------------------------------------------------


@pytest.mark.parametrize("uri", ["s3://", "s3:///prefix", "s3://b/a//c", "s3://b/../c"])
def test_bad_uris(uri):
    with pytest.raises(ConfigError):
        S3Storage.from_uri(uri)


@pytest.mark.parametrize(
    "options",
    [{"part_size_bytes": MIB}, {"max_concurrency": 0}, {"retry_deadline_s": 0}, {"no_such_option": 1}],
)
def test_bad_options(options):
    with pytest.raises(ConfigError):
        S3Storage.from_uri("s3://bucket", **options)


def test_region_resolution(s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    assert S3Storage.from_uri("s3://b").client.meta.region_name == "eu-west-3"
    assert S3Storage.from_uri("s3://b", region_name="ap-south-1").client.meta.region_name == "ap-south-1"
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    assert S3Storage.from_uri("s3://b").client.meta.region_name == "eu-central-1"
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    assert S3Storage.from_uri("s3://b").client.meta.region_name == "us-east-1"
