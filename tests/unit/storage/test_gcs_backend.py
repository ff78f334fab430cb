"""The GCS backend against a real emulator (tests/support/gcs_server.py): composite uploads,
ranged reads pinned to a generation, a killed writer's parts and ``spotrun gc``, throttling,
credentials, missing buckets and extras. The storage contract itself runs in
test_storage_contract.py (the ``gcs`` parameter).

The emulator ignores ``ifGenerationMatch``; the proxy in front of it enforces it, and one test
here shows that the preflight refuses a store that ignores it (the emulator on its own).
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import requests.exceptions
from google.api_core import exceptions as api_exceptions

from spotrun.errors import (
    CommitUnsupportedError,
    ConfigError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
)
from spotrun.storage import open_storage, parse_location
from spotrun.storage.gcs_errors import is_retryable, translate
from spotrun.storage.gcs_transfer import UPLOAD_MARK
from spotrun.supervisor.preflight import check
from tests.support.byte_sources import BytesSource
from tests.support.fake_time import FakeTime
from tests.support.gcs_server import Seen

REPO = Path(__file__).resolve().parents[3]
MIB = 1024 * 1024
SMALL_TRANSFER = {"multipart_threshold_bytes": 6 * MIB, "part_size_bytes": 5 * MIB, "max_part_size_bytes": 5 * MIB}


def payload(size_bytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size_bytes)


def is_part_upload(seen: Seen) -> bool:
    return seen.method == "POST" and seen.path.startswith("/upload/") and UPLOAD_MARK in seen.object_name


def is_compose(seen: Seen) -> bool:
    return seen.path.endswith("/compose")


def test_a_large_object_goes_up_as_parallel_parts_composed_into_it_and_the_parts_are_deleted(gcs_bucket):
    storage = open_storage(f"{gcs_bucket.uri}/job", **SMALL_TRANSFER)
    data = payload(12 * MIB + 5)
    storage.put("step/shard", data)
    assert storage.get("step/shard") == data
    assert len(gcs_bucket.proxy.seen(is_part_upload)) == 3  # 5 + 5 + 2 MiB
    assert len(gcs_bucket.proxy.seen(is_compose)) == 1
    assert [info.key for info in storage.list()] == ["step/shard"]
    assert storage.unfinished_uploads() == []
    raw = storage.client.list_blobs(gcs_bucket.name)
    assert [blob.name for blob in raw] == ["job/step/shard"]  # no part left behind


def test_more_than_32_parts_are_composed_in_two_levels(gcs_bucket):
    storage = open_storage(
        gcs_bucket.uri, multipart_threshold_bytes=1, part_size_bytes=64 * 1024, max_part_size_bytes=64 * 1024
    )
    data = payload(40 * 64 * 1024 + 1, seed=1)
    storage.put_stream("big", BytesSource(data), chunk_bytes=64 * 1024)
    assert storage.get("big") == data
    assert len(gcs_bucket.proxy.seen(is_part_upload)) == 41
    assert len(gcs_bucket.proxy.seen(is_compose)) == 3  # 32 + 9 parts into two intermediates, then the object
    assert [blob.name for blob in storage.client.list_blobs(gcs_bucket.name)] == ["big"]


def test_a_read_of_one_part_is_one_ranged_get_of_exactly_its_bytes(gcs_bucket):
    storage = open_storage(gcs_bucket.uri, **SMALL_TRANSFER)
    data = payload(12 * MIB, seed=2)
    storage.put("shard", data)
    gcs_bucket.proxy.reset()
    out = bytearray(1000)
    storage.read_into("shard", 7 * MIB + 3, [memoryview(out)])
    assert out == data[7 * MIB + 3 : 7 * MIB + 1003]
    gets = gcs_bucket.proxy.seen(lambda s: s.method == "GET")
    assert [(g.range, g.body_bytes) for g in gets] == [(f"bytes={7 * MIB + 3}-{7 * MIB + 1002}", 1000)]


def test_an_object_replaced_during_a_ranged_read_is_reported(gcs_bucket):
    """The parts of one read are pinned to the generation the read started on: a part fetched
    after the object was replaced fails its precondition, and the read says so."""
    storage = open_storage(gcs_bucket.uri, **SMALL_TRANSFER, max_concurrency=1)
    storage.put("shard", payload(12 * MIB, seed=3))
    replaced = []

    def replace_after_first_part(seen: Seen) -> None:
        if seen.method == "GET" and seen.range and not replaced:
            replaced.append(True)
            open_storage(gcs_bucket.uri).put("shard", payload(12 * MIB, seed=4))

    gcs_bucket.proxy.on_request = replace_after_first_part
    with pytest.raises(StorageError, match="replaced while it was being read"):
        storage.read_into("shard", 0, [memoryview(bytearray(12 * MIB))])


def test_the_preflight_refuses_a_store_that_ignores_create_only_uploads(gcs_bucket):
    """The emulator on its own lets a second create-only upload overwrite the first; the preflight
    finds that out before a job could commit over another writer's step."""
    gcs_bucket.proxy.enforce_preconditions = False
    with pytest.raises(CommitUnsupportedError) as info:
        check(open_storage(f"{gcs_bucket.uri}/job"), timeout_s=30)
    assert "ifGenerationMatch" in str(info.value)
    gcs_bucket.proxy.enforce_preconditions = True
    check(open_storage(f"{gcs_bucket.uri}/job"), timeout_s=30)  # the same store, enforcing: passes


@pytest.mark.parametrize("status", [429, 503])
def test_throttling_is_retried_with_backoff(gcs_bucket, status):
    fake = FakeTime()
    storage = open_storage(gcs_bucket.uri, sleep=fake.sleep, clock=fake.clock)
    gcs_bucket.proxy.fail(3, status, match=lambda s: s.method == "POST" and s.object_name == "k")
    storage.put("k", b"value")
    assert storage.get("k") == b"value"
    assert len(fake.sleeps_s) == 3
    assert len(gcs_bucket.proxy.seen(lambda s: s.injected)) == 3


def test_retries_stop_before_the_deadline(gcs_bucket):
    fake = FakeTime()
    storage = open_storage(gcs_bucket.uri, sleep=fake.sleep, clock=fake.clock, retry_deadline_s=5)
    gcs_bucket.proxy.fail(10_000, 503)
    with pytest.raises(StorageError, match=r"HTTP 503"):
        storage.put("k", b"value")
    assert fake.now_s < 5
    with storage.deadline(0.5), pytest.raises(StorageError):
        storage.get("k")
    assert fake.now_s < 5.5


def test_a_missing_bucket_names_the_bucket(gcs_bucket):
    storage = open_storage("gs://no-such-bucket-spotrun/job")
    with pytest.raises(ObjectNotFoundError, match="bucket 'no-such-bucket-spotrun' does not exist"):
        storage.put_if_absent("probe", b"x")
    with pytest.raises(ObjectNotFoundError, match="bucket 'no-such-bucket-spotrun' does not exist"):
        storage.list()


def test_denied_access_is_a_permission_error(gcs_bucket):
    storage = open_storage(gcs_bucket.uri)
    gcs_bucket.proxy.fail(1, 403, match=lambda s: s.object_name == "k")
    with pytest.raises(StoragePermissionError, match="access denied"):
        storage.put("k", b"v")


def test_no_credentials_is_one_clear_error_at_open(monkeypatch, tmp_path):
    """Outside an emulator, without Application Default Credentials (no key file, no gcloud login,
    no metadata server: pointed at a closed loopback port), opening the root says what to set."""
    for variable in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    with pytest.raises(StoragePermissionError) as info:
        open_storage("gs://bucket/job")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(info.value) and "\n" not in str(info.value)


def test_a_store_that_does_not_listen_fails_within_the_deadline(monkeypatch):
    with socket_closed_port() as url:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        storage = open_storage("gs://bucket/job", retry_deadline_s=1.0, connect_timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(StorageError, match="cannot connect"):
            storage.get("k")
        assert time.monotonic() - started < 30  # bounded by the deadline, not hanging


class socket_closed_port:
    """An http:// URL on loopback where nothing listens."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def __exit__(self, *exc_info: object) -> None:
        pass


@pytest.mark.parametrize(
    "uri", ["gs://", "gs:///prefix", "gs://b/a//c", "gs://Bucket/x", "gs://b/../c", "gs://a..b/x", "gs://ab"]
)
def test_bad_uris_are_refused(uri):
    with pytest.raises(ConfigError):
        parse_location(uri)


def test_unknown_options_are_refused(gcs_bucket):
    with pytest.raises(ConfigError, match="unknown GCS storage option"):
        open_storage(gcs_bucket.uri, part_size=5)
    with pytest.raises(ConfigError, match="max_concurrency"):
        open_storage(gcs_bucket.uri, max_concurrency=0)


@pytest.mark.parametrize("missing", ["the-module", "its-parent-package"])
def test_a_missing_extra_is_one_line_naming_it(monkeypatch, missing):
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if not name.startswith("google.cloud"):
            return real(name, *args)
        if missing == "the-module":
            return None
        raise ModuleNotFoundError("No module named 'google'", name="google")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError) as info:
        parse_location("gs://bucket/job")
    assert str(info.value) == "gs:// checkpoint roots need Google's client library: pip install 'spotrun[gcs]'"


@pytest.mark.parametrize(
    ("error", "retry"),
    [
        (api_exceptions.TooManyRequests("slow down"), True),
        (api_exceptions.ServiceUnavailable("x"), True),
        (api_exceptions.InternalServerError("x"), True),
        (api_exceptions.GatewayTimeout("x"), True),
        (requests.exceptions.ConnectionError("reset"), True),
        (requests.exceptions.ReadTimeout("slow"), True),
        (api_exceptions.NotFound("x"), False),
        (api_exceptions.Forbidden("x"), False),
        (api_exceptions.PreconditionFailed("x"), False),
        (requests.exceptions.SSLError("bad certificate"), False),
    ],
)
def test_what_is_retried(error, retry):
    assert is_retryable(error) is retry


def test_translation_goes_by_status_not_message():
    assert isinstance(
        translate(api_exceptions.NotFound("bucket does not exist"), what="get", bucket="b"), ObjectNotFoundError
    )
    denied = translate(api_exceptions.Forbidden("no such object"), what="get", bucket="b")
    assert isinstance(denied, StoragePermissionError) and not isinstance(denied, ObjectNotFoundError)


# --- a writer killed in the middle of a composite upload, and spotrun gc --------------------------

KILLED_WRITER = textwrap.dedent(
    """
    import sys, threading
    from spotrun.storage import open_storage
    from tests.support.byte_sources import BytesSource

    class Stalls(BytesSource):
        def readinto(self, offset, out):
            if offset >= 2 * 1024 * 1024:  # after two parts: hang until killed
                threading.Event().wait()
            super().readinto(offset, out)

    MIB = 1024 * 1024
    storage = open_storage(
        sys.argv[1], multipart_threshold_bytes=1, part_size_bytes=MIB, max_part_size_bytes=MIB, max_concurrency=1
    )
    storage.put_stream("step-000000030/rank-00000.safetensors", Stalls(b"x" * 4 * 1024 * 1024), chunk_bytes=1024 * 1024)
    """
)


def test_a_killed_writers_parts_are_found_and_removed_by_spotrun_gc(gcs_bucket, tmp_path):
    uri = f"{gcs_bucket.uri}/job"
    storage = open_storage(uri)
    storage.put("step-000000010/manifest.json", b"{}")  # not a step gc may touch: it is not old
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, uri],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 120
        while len(gcs_bucket.proxy.seen(lambda s: is_part_upload(s) and s.status == 200)) < 2:
            assert writer.poll() is None, "the writer exited before it was killed"
            assert time.monotonic() < deadline, "the writer never uploaded two parts"
            time.sleep(0.05)  # polling a condition
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    uploads = storage.unfinished_uploads()
    assert [u.key for u in uploads] == ["step-000000030/rank-00000.safetensors"]
    assert [info.key for info in storage.list()] == ["step-000000010/manifest.json"]  # parts are not objects

    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "gc", uri, "--incomplete-older-than-s", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPOTRUN_PROGRESS": "0"},
    )
    assert done.returncode == 0, done.stderr
    assert any(
        re.fullmatch(
            r"composite upload step-000000030/rank-00000\.safetensors: aborted, \d+ s old \(threshold 0 s\)", line
        )
        for line in done.stdout.splitlines()
    ), done.stdout
    assert storage.unfinished_uploads() == []
    names = [blob.name for blob in storage.client.list_blobs(gcs_bucket.name)]
    assert not any(UPLOAD_MARK in name for name in names), names
