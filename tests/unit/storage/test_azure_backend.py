"""Azure-specific behaviour of the ``az://`` backend, against a real Azurite (tests/support/azurite_server.py).

The storage contract itself runs on Azure in test_storage_contract.py; here: how large objects
travel (staged blocks, one block list, ranges pinned to an ETag), what killed writers leave
(uncommitted blocks) and how it is found and discarded (also by ``spotrun gc``), the commit race,
throttling and its deadline, and errors: a missing container, bad or no credentials, bad URIs,
a missing extra, translation by error code.
"""

from __future__ import annotations

import base64
import errno
import importlib.util
import os
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from typing import Any

import pytest
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.identity import CredentialUnavailableError

from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import step_dir
from spotrun.control import env as spotrun_env
from spotrun.errors import (
    ConfigError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
)
from spotrun.storage import open_storage, parse_location
from spotrun.storage.azure import AzureOptions, AzureStorage
from spotrun.storage.azure_blocks import FOREIGN_BLOCKS, block_id
from spotrun.storage.azure_config import make_service
from spotrun.storage.azure_errors import is_retryable, translate
from spotrun.storage.azure_location import MISSING_EXTRA
from spotrun.storage.options import ObjectStoreOptions
from spotrun.storage.part_sizes import AZURE_LIMITS, upload_part_size
from tests.support.azurite_server import admin_service, connection_string, throttling_proxy
from tests.support.byte_sources import BytesSource
from tests.support.fake_time import FakeTime
from tests.support.s3_server import free_loopback_port

MIB = 1024 * 1024
SMALL_TRANSFER = {"multipart_threshold_bytes": 6 * MIB, "part_size_bytes": 5 * MIB, "max_part_size_bytes": 5 * MIB}
LARGE_BYTES = 12 * MIB + 123
CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
HOUR_S = 3600

#: Installing Azurite from npm (first use on a fresh machine) and starting it count against the first test.
pytestmark = pytest.mark.timeout(600)


def payload(size_bytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size_bytes)


class Recorder:
    """A ``raw_request_hook``: records each request as it leaves; ``on_request(request)`` runs first."""

    def __init__(self, on_request: Any = None) -> None:
        self.on_request = on_request
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, pipeline_request: Any) -> None:
        request = pipeline_request.http_request
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.url).query)
        entry = {
            "method": request.method,
            "comp": query.get("comp", [None])[0],
            "blockid": query.get("blockid", [None])[0],
            "range": request.headers.get("x-ms-range"),
            "if_match": request.headers.get("If-Match"),
        }
        with self._lock:
            self.requests.append(entry)
        if self.on_request is not None:
            self.on_request(entry)

    def of(self, method: str, comp: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == method and r["comp"] == comp]


def azure_storage(container: Any, *, prefix: str = "p", hooks: dict[str, Any] | None = None, **options: Any):
    """AzureStorage under ``prefix`` on the test container (small blocks); ``hooks`` go to the SDK client."""
    opts = AzureOptions(**{**SMALL_TRANSFER, **options})
    service = make_service(opts, what="test", **(hooks or {}))
    return AzureStorage(container.name, prefix, opts, service=service)


def raw_container(container: Any) -> Any:
    """The container through an SDK client of its own (no hooks, no spotrun)."""
    return admin_service(container.connection_string).get_container_client(container.name)


def uncommitted_names(container: Any) -> list[str]:
    """Names that have uncommitted blocks and no committed blob."""
    raw = raw_container(container)
    committed = {b.name for b in raw.list_blobs()}
    return sorted(b.name for b in raw.list_blobs(include=["uncommittedblobs"]) if b.name not in committed)


def stray_block_ids(container: Any, name: str) -> list[str]:
    return [b.id for b in raw_container(container).get_blob_client(name).get_block_list("uncommitted")[1]]


# --- how objects travel ---------------------------------------------------------------


def test_large_objects_use_parallel_staged_blocks_and_one_block_list(azure_container):
    """Three 5 MiB blocks, two of them provably in flight at once, then one Put Block List; the
    read is three ranged GETs, the later two in flight at once and pinned to the first's ETag."""
    in_flight = {"PUT": threading.Barrier(2, timeout=30), "GET": threading.Barrier(2, timeout=30)}
    counts = {"PUT": 0, "GET": 0}
    lock = threading.Lock()

    def on_request(request: dict[str, Any]) -> None:
        kind = request["method"]
        if (kind, request["comp"]) not in (("PUT", "block"), ("GET", None)):
            return
        with lock:
            counts[kind] += 1
            number = counts[kind]
        if (kind == "PUT" and number <= 2) or (kind == "GET" and number in (2, 3)):
            in_flight[kind].wait()  # breaks (and fails the test) unless a second request comes meanwhile

    recorder = Recorder(on_request)
    storage = azure_storage(azure_container, hooks={"raw_request_hook": recorder})
    data = payload(LARGE_BYTES, seed=1)
    storage.put("big", data)
    puts = recorder.of("PUT", "block") + recorder.of("PUT", "blocklist") + recorder.of("PUT")
    assert [r["comp"] for r in puts] == ["block", "block", "block", "blocklist"]
    assert recorder.requests[-1]["comp"] == "blocklist"
    ids = [base64.b64decode(r["blockid"]).decode() for r in recorder.of("PUT", "block")]
    assert len({len(i) for i in ids}) == 1 and len({i.rsplit("-", 1)[0] for i in ids}) == 1  # one upload

    recorder.requests.clear()
    assert storage.get("big") == data
    gets = recorder.of("GET")
    assert [r["range"] for r in gets][0] == f"bytes=0-{5 * MIB - 1}" and gets[0]["if_match"] is None
    assert {r["range"] for r in gets[1:]} == {f"bytes={5 * MIB}-{10 * MIB - 1}", f"bytes={10 * MIB}-{LARGE_BYTES - 1}"}
    assert len({r["if_match"] for r in gets[1:]}) == 1 and gets[1]["if_match"]


@pytest.mark.parametrize(
    ("size_bytes", "part_size_bytes", "chunk_bytes", "block_bytes"),
    [
        (100 * MIB, 5 * MIB, MIB, 5 * MIB),
        (100 * MIB, 5 * MIB, 3 * MIB + 1, 6 * MIB + 2),  # rounded up to whole chunks
        (50_000 * 5 * MIB + 1, 5 * MIB, MIB, 6 * MIB),  # grown to stay within 50,000 blocks
    ],
)
def test_block_size_is_whole_chunks_within_azures_block_count(size_bytes, part_size_bytes, chunk_bytes, block_bytes):
    fixed = ObjectStoreOptions(part_size_bytes=part_size_bytes, max_part_size_bytes=part_size_bytes)
    assert upload_part_size(size_bytes, fixed, AZURE_LIMITS, chunk_bytes=chunk_bytes) == block_bytes
    assert -(-size_bytes // block_bytes) <= 50_000


def test_small_objects_take_one_request_each_way(azure_container):
    recorder = Recorder()
    storage = azure_storage(azure_container, hooks={"raw_request_hook": recorder})
    storage.put("small", b"abc")
    assert storage.get("small") == b"abc"
    assert [(r["method"], r["comp"]) for r in recorder.requests] == [("PUT", None), ("GET", None)]


def test_a_listing_reads_every_page(azure_container):
    recorder = Recorder()
    storage = azure_storage(azure_container, hooks={"raw_request_hook": recorder})
    storage.list_page_size = 7
    keys = [f"k/{i:02d}" for i in range(20)]
    for key in keys:
        storage.put(key, b".")
    recorder.requests.clear()
    assert [info.key for info in storage.list("k/")] == keys
    assert len(recorder.of("GET", "list")) == 3


@pytest.mark.parametrize("existing", ["none", "put-blob", "block-list"])
def test_a_put_stream_whose_source_raises_leaves_no_blob_and_no_uncommitted_blocks(azure_container, existing):
    """Three blocks staged, then the source dies: the blocks are discarded, a blob that was there
    keeps its bytes (whether one Put Blob or a block list wrote it), and a new key stays absent."""
    recorder = Recorder()
    storage = azure_storage(azure_container, max_concurrency=1, hooks={"raw_request_hook": recorder})
    old = payload(LARGE_BYTES, seed=7) if existing == "block-list" else b"old content"
    if existing != "none":
        storage.put("k", old)
    recorder.requests.clear()
    source = BytesSource(payload(4 * 5 * MIB + 1000), fail_at=3 * 5 * MIB + 10, error=RuntimeError("writer died"))
    with pytest.raises(RuntimeError, match="writer died"):
        storage.put_stream("k", source, chunk_bytes=MIB)
    assert len([r for r in recorder.of("PUT", "block") if r["blockid"]]) >= 3  # staged before it died
    assert uncommitted_names(azure_container) == []
    if existing == "none":
        assert storage.exists("k") is False
    else:
        assert storage.get("k") == old
        assert stray_block_ids(azure_container, "p/k") == []
    assert storage.unfinished_uploads() == []


# --- what killed writers leave ---------------------------------------------------------

_SLOW_WRITER = textwrap.dedent(
    """
    import sys, time
    from spotrun.storage import open_storage
    from spotrun.storage.base import ByteSource

    MIB = 1024 * 1024

    class Slow(ByteSource):
        size_bytes = 8 * MIB

        def readinto(self, offset, out):
            if offset >= 2 * MIB:
                time.sleep(3600)  # killed here, two blocks staged
            out[:] = bytes([offset // MIB]) * len(out)

    storage = open_storage(
        sys.argv[1], multipart_threshold_bytes=MIB, part_size_bytes=MIB, max_part_size_bytes=MIB, max_concurrency=1
    )
    storage.put_stream(sys.argv[2], Slow(), chunk_bytes=MIB)
    """
)


def kill_a_writer_mid_upload(container: Any, uri: str, key: str, name: str) -> None:
    """Start a real writer process on ``key``, wait until it has staged two blocks, SIGKILL it."""
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, uri, key], env=dict(os.environ))
    try:
        blob = raw_container(container).get_blob_client(name)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if len(blob.get_block_list("uncommitted")[1]) >= 2:
                    break
            except HttpResponseError:
                pass
            time.sleep(0.05)  # polling a condition, not synchronising on time
        assert proc.poll() is None, "the writer ended before it was killed"
        assert len(stray_block_ids(container, name)) >= 2
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("target", ["new-key", "replacing-a-put-blob", "replacing-a-block-list"])
def test_a_killed_writers_blocks_are_listed_and_discarded(azure_container, target):
    storage = azure_storage(azure_container)
    old = {"replacing-a-put-blob": b"old content", "replacing-a-block-list": payload(LARGE_BYTES, seed=2)}.get(target)
    if old is not None:
        storage.put("step/shard", old)
    before = time.time()
    kill_a_writer_mid_upload(azure_container, f"{azure_container.uri}/p", "step/shard", "p/step/shard")
    uploads = storage.unfinished_uploads()
    assert [u.key for u in uploads] == ["step/shard"]
    assert before - 2 <= uploads[0].time_unix_s <= time.time() and re.fullmatch("[0-9a-f]{16}", uploads[0].upload_id)
    assert storage.unfinished_uploads("step/") == uploads and storage.unfinished_uploads("other/") == []
    storage.abort_upload(uploads[0])
    assert storage.unfinished_uploads() == []
    assert uncommitted_names(azure_container) == []
    if old is None:
        assert storage.exists("step/shard") is False
    else:
        assert storage.get("step/shard") == old
        assert stray_block_ids(azure_container, "p/step/shard") == []
    storage.abort_upload(uploads[0])  # one already gone is not an error


def test_discarding_an_upload_leaves_the_blocks_of_a_newer_one(azure_container):
    """A newer upload may still be running: its blocks stay; discarding it discards the older too."""
    storage = azure_storage(azure_container)
    blob = raw_container(azure_container).get_blob_client("p/k")
    now = int(time.time())
    blob.stage_block(block_id(now - 2 * HOUR_S, "a" * 16, 0), b"old")
    blob.stage_block(block_id(now, "b" * 16, 0), b"new")
    uploads = {u.upload_id: u for u in storage.unfinished_uploads()}
    assert {tag: u.time_unix_s for tag, u in uploads.items()} == {"a" * 16: now - 2 * HOUR_S, "b" * 16: now}
    storage.abort_upload(uploads["a" * 16])
    assert len(stray_block_ids(azure_container, "p/k")) == 2
    storage.abort_upload(uploads["b" * 16])
    assert storage.unfinished_uploads() == [] and uncommitted_names(azure_container) == []


def test_another_clients_blocks_are_reported_only_where_no_blob_is_committed(azure_container):
    storage = azure_storage(azure_container)
    raw = raw_container(azure_container)
    raw.get_blob_client("p/theirs").stage_block("their-own-block-id", b"x")
    storage.put("committed", b"kept")
    raw.get_blob_client("p/committed").stage_block("their-own-block-id", b"y")
    uploads = storage.unfinished_uploads()
    assert [(u.key, u.upload_id) for u in uploads] == [("theirs", FOREIGN_BLOCKS)]
    storage.abort_upload(uploads[0])
    assert uncommitted_names(azure_container) == [] and storage.get("committed") == b"kept"


def save_steps(storage: Any, steps: list[int]) -> None:
    """Save ``steps`` of a tiny state (a tensor holding the step number)."""
    import torch

    import spotrun

    state = {"model": {"w": torch.zeros(4)}}
    ckpt = spotrun.Checkpointer(state, storage=storage, handle_signals=False)
    for step in steps:
        state["model"]["w"].fill_(float(step))
        ckpt.save(step)
    ckpt.close()


def gc(*args: str) -> tuple[int, list[str], str]:
    """``spotrun gc ARGS`` in a process of its own: (exit code, stdout lines, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "gc", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPOTRUN_PROGRESS": "0"},
    )
    return done.returncode, done.stdout.splitlines(), done.stderr


def statuses(storage: Any) -> dict[int, str]:
    return {s.step: s.status for s in catalog.list_steps(storage)}


def test_gc_on_az_discards_a_killed_writers_leftovers(azure_container):
    """``spotrun gc`` keeps a young killed writer's blocks and an old one's step, discards a 2 h
    old upload's blocks; with a zero threshold it deletes the incomplete step and the rest."""
    uri = f"{azure_container.uri}/job"
    storage = open_storage(uri)
    save_steps(storage, [10, 20])
    shard = "rank-00000.i000000001.safetensors"
    kill_a_writer_mid_upload(azure_container, uri, f"{step_dir(30)}/{shard}", f"job/{step_dir(30)}/{shard}")
    storage.put(f"{step_dir(40)}/rank-00001.i000000001.safetensors", b"partial")
    stale = raw_container(azure_container).get_blob_client(f"job/{step_dir(40)}/{shard}")
    stale.stage_block(block_id(int(time.time()) - 2 * HOUR_S, "c" * 16, 0), b"x" * 1024)

    code, lines, stderr = gc(uri)
    assert code == 0, stderr
    expected = [
        r"step 10        complete   kept          no keep_last: every complete step is kept",
        r"step 20        complete   kept          no keep_last: every complete step is kept",
        r"step 40        incomplete kept          newest object \d+ s old, under the 3600 s threshold: a save may "
        r"still be writing it",
        rf"uncommitted blocks of {step_dir(30)}/{shard}: kept, \d+ s old, under the 3600 s threshold: a save may still "
        r"be writing it",
        rf"uncommitted blocks of {step_dir(40)}/{shard}: aborted, 72\d\d s old \(threshold 3600 s\)",
        r"deleted 0 step\(s\) \(0 objects, 0 B\) and 1 unfinished write\(s\); kept 3 step\(s\) and 1 "
        rf"unfinished write\(s\) under {uri}",
    ]
    assert len(lines) == len(expected), lines
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    assert uncommitted_names(azure_container) == [f"job/{step_dir(30)}/{shard}"]

    code, lines, stderr = gc(uri, "--incomplete-older-than-s", "0")
    assert code == 0, stderr
    assert re.fullmatch(
        rf"uncommitted blocks of {step_dir(30)}/{shard}: aborted, \d+ s old \(threshold 0 s\)", lines[-2]
    )
    assert uncommitted_names(azure_container) == [] and storage.unfinished_uploads() == []
    assert statuses(open_storage(uri)) == {10: "complete", 20: "complete"}


# --- the commit primitive ---------------------------------------------------------------


def test_two_writers_racing_put_if_absent_have_exactly_one_winner(azure_container):
    writers = [azure_storage(azure_container), azure_storage(azure_container)]  # separate clients
    for round_number in range(10):
        key = f"commit-{round_number}"
        barrier = threading.Barrier(2)
        outcome: dict[int, str] = {}

        def write(i: int, key: str = key, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                writers[i].put_if_absent(key, f"writer-{i}".encode())
                outcome[i] = "won"
            except ObjectExistsError:
                outcome[i] = "lost"

        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcome.values()) == ["lost", "won"]
        winner = next(i for i, result in outcome.items() if result == "won")
        assert writers[0].get(key) == f"writer-{winner}".encode()


def test_a_lost_answer_to_our_own_conditional_put_is_success(azure_container):
    attempts = []

    def lose_the_first_answer(pipeline_response: Any) -> None:
        request = pipeline_response.http_request
        if request.method == "PUT" and "comp=" not in request.url:
            attempts.append(1)
            if len(attempts) == 1:
                raise ServiceResponseError("connection reset after the blob was stored")

    fake = FakeTime()
    storage = azure_storage(
        azure_container, sleep=fake.sleep, clock=fake.clock, hooks={"raw_response_hook": lose_the_first_answer}
    )
    storage.put_if_absent("manifest.json", b"mine")
    assert len(attempts) == 2 and storage.get("manifest.json") == b"mine"
    with pytest.raises(ObjectExistsError):
        storage.put_if_absent("manifest.json", b"mine")  # a first attempt that loses is not ours


def test_put_if_absent_beyond_one_put_blob_is_refused(azure_container, monkeypatch):
    monkeypatch.setattr("spotrun.storage.azure.MAX_SINGLE_PUT_BYTES", 10)
    storage = azure_storage(azure_container)
    with pytest.raises(StorageError) as info:
        storage.put_if_absent("big", b"x" * 11)
    assert info.value.errno == errno.EFBIG and storage.exists("big") is False


@pytest.mark.parametrize("operation", ["get", "read_into"])
def test_an_object_replaced_during_a_ranged_read_is_reported(azure_container, operation):
    gets = []
    admin_blob = raw_container(azure_container).get_blob_client("p/big")

    def replace_after_the_first_range(request: dict[str, Any]) -> None:
        if request["method"] == "GET" and request["comp"] is None:
            gets.append(request)
            if len(gets) == 2:  # the first range was answered; another writer replaces the object
                admin_blob.upload_blob(payload(LARGE_BYTES, seed=9), overwrite=True)

    storage = azure_storage(
        azure_container, max_concurrency=1, hooks={"raw_request_hook": Recorder(replace_after_the_first_range)}
    )
    storage.put("big", payload(LARGE_BYTES, seed=1))
    with pytest.raises(StorageError) as info:
        if operation == "get":
            storage.get("big")
        else:
            storage.read_into("big", 0, [bytearray(LARGE_BYTES)])
    assert info.value.errno == errno.EAGAIN and not isinstance(info.value, ObjectNotFoundError)


# --- throttling and deadlines -------------------------------------------------------------


def test_throttling_is_retried_with_backoff_until_it_passes(azure_container, monkeypatch):
    fake = FakeTime()
    with throttling_proxy(azure_container.endpoint_url, fail_first=2) as (url, requests):
        monkeypatch.setenv(CONNECTION_STRING, connection_string(url))
        storage = open_storage(f"{azure_container.uri}/p", sleep=fake.sleep, clock=fake.clock)
        storage.put("k", b"data")
    assert len(requests) == 3 and len(fake.sleeps_s) == 2 and all(s >= 0 for s in fake.sleeps_s)
    monkeypatch.setenv(CONNECTION_STRING, azure_container.connection_string)
    assert open_storage(f"{azure_container.uri}/p").get("k") == b"data"


@pytest.mark.parametrize(
    ("status", "code"), [(503, "ServerBusy"), (500, "InternalError"), (500, "OperationTimedOut"), (429, "TooMany")]
)
def test_throttling_that_persists_ends_before_the_deadline(monkeypatch, status, code):
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    fake = FakeTime()
    with throttling_proxy(None, fail_first=None, status=status, code=code) as (url, requests):
        monkeypatch.setenv(CONNECTION_STRING, connection_string(url))
        storage = open_storage("az://c-1/p", retry_deadline_s=5, sleep=fake.sleep, clock=fake.clock)
        with pytest.raises(StorageError, match=code) as info:
            storage.put("k", b"1")
        with storage.deadline(0), pytest.raises(StorageError, match="deadline passed"):
            storage.get("k")
    assert type(info.value) is StorageError
    assert len(fake.sleeps_s) >= 2 and sum(fake.sleeps_s) < 5
    assert len(requests) == len(fake.sleeps_s) + 1  # the SDK never retried on its own


def test_an_endpoint_not_listening_fails_within_the_deadline(monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    url = f"http://127.0.0.1:{free_loopback_port()}"
    monkeypatch.setenv(CONNECTION_STRING, connection_string(url))
    fake = FakeTime()
    storage = open_storage("az://c-1/p", retry_deadline_s=5, sleep=fake.sleep, clock=fake.clock)
    with pytest.raises(StorageError, match=re.escape(url)) as info:
        storage.put("k", b"1")
    assert type(info.value) is StorageError and isinstance(info.value.__cause__, ServiceRequestError)
    assert len(fake.sleeps_s) >= 2 and sum(fake.sleeps_s) < 5


# --- errors ---------------------------------------------------------------------------------


def test_a_missing_container_is_not_found_and_named(azure_container):
    storage = open_storage("az://spotrun-no-such-container/p")
    for operation in (
        lambda: storage.get("k"),
        lambda: storage.stat("k"),
        lambda: storage.put("k", b"1"),
        lambda: storage.put("big", payload(LARGE_BYTES)),
        lambda: storage.put_if_absent("k", b"1"),
        lambda: storage.read_into("k", 0, [bytearray(1)]),
        lambda: storage.delete("k"),
        storage.list,
        storage.unfinished_uploads,
    ):
        with pytest.raises(ObjectNotFoundError, match="container 'spotrun-no-such-container' does not exist") as info:
            operation()
        assert isinstance(info.value.__cause__, HttpResponseError)


def test_a_wrong_key_is_a_permission_error(azure_container, monkeypatch):
    wrong_key = base64.b64encode(b"not the account key" * 3).decode()
    monkeypatch.setenv(CONNECTION_STRING, connection_string(azure_container.endpoint_url, account_key=wrong_key))
    storage = open_storage(f"{azure_container.uri}/p")
    for operation in (
        lambda: storage.get("k"),
        lambda: storage.stat("k"),
        lambda: storage.put("k", b"1"),
        storage.list,
    ):
        with pytest.raises(StoragePermissionError) as info:
            operation()
        assert isinstance(info.value, PermissionError) and isinstance(info.value.__cause__, HttpResponseError)


def test_no_credentials_at_all_is_one_clear_error(monkeypatch):
    for name in (CONNECTION_STRING, "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_BLOB_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StoragePermissionError) as info:
        open_storage("az://c-1/p")
    message = str(info.value)
    assert "\n" not in message and "AZURE_STORAGE_CONNECTION_STRING" in message and "AZURE_STORAGE_ACCOUNT" in message


def test_an_account_without_an_identity_is_a_permission_error(monkeypatch):
    class NoIdentity:
        def get_token(self, *scopes: str, **kwargs: Any) -> Any:
            raise CredentialUnavailableError("no identity here")

    monkeypatch.delenv(CONNECTION_STRING, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "spotrunnoaccount")
    monkeypatch.setattr("azure.identity.DefaultAzureCredential", NoIdentity)
    storage = open_storage("az://c-1/p")
    assert storage.container.url.startswith("https://spotrunnoaccount.blob.core.windows.net/c-1")
    with pytest.raises(StoragePermissionError, match="DefaultAzureCredential got no token") as info:
        storage.get("k")
    assert isinstance(info.value.__cause__, ClientAuthenticationError)


def test_a_malformed_connection_string_is_a_config_error_that_hides_it(monkeypatch):
    monkeypatch.setenv(CONNECTION_STRING, "secret-value-without-structure")
    with pytest.raises(ConfigError) as info:
        open_storage("az://c-1/p")
    assert "secret-value" not in str(info.value)


@pytest.mark.parametrize(
    "uri",
    ["az://", "az:///p", "az://ab", "az://Upper", "az://a--b", "az://-ab", "az://ab-", "az://a_b", "az://" + "a" * 64,
     "az://c-1/a//b", "az://c-1/../x", "az://c-1/./x", "az://c-1/a/.."],
)  # fmt: skip
def test_bad_uris_are_config_errors(uri):
    with pytest.raises(ConfigError):
        parse_location(uri)


@pytest.mark.parametrize(
    "options", [{"part_size_bytes": 0}, {"part_size_bytes": 4001 * MIB}, {"max_concurrency": 0}, {"no_such": 1}]
)
def test_bad_options_are_config_errors(options):
    with pytest.raises(ConfigError):
        AzureStorage.from_uri("az://c-1", **options)


def test_the_location_names_the_root_its_workers_and_a_sibling():
    location = parse_location("az://c-1/runs/exp1/")
    assert location.uri == "az://c-1/runs/exp1" and location.is_remote
    assert location.worker_env() == {spotrun_env.CHECKPOINT_URI: "az://c-1/runs/exp1"}
    assert re.fullmatch(r"az://c-1/runs/exp1-drill/[0-9a-f]{12}", location.scratch_sibling("drill").location.uri)


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name.startswith("azure") else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError) as info:
        parse_location("az://c-1/p")
    assert str(info.value) == MISSING_EXTRA and "\n" not in MISSING_EXTRA and "spotrun[azure]" in MISSING_EXTRA


class FakeResponse:
    """An HTTP answer as azure-core's errors read it."""

    def __init__(self, status: int, code: str, message: str) -> None:
        self.status_code = status
        self.reason = "injected"
        self.headers = {"x-ms-error-code": code}
        self._body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"

    def text(self, encoding: str | None = None) -> str:
        return self._body


def http_error(status: int, code: str, message: str = "injected") -> HttpResponseError:
    return HttpResponseError(message=message, response=FakeResponse(status, code, message))


@pytest.mark.parametrize(
    ("status", "code", "message", "expected", "names_container"),
    [
        (403, "AuthenticationFailed", "BlobNotFound ContainerNotFound", StoragePermissionError, False),
        (403, "AuthorizationPermissionMismatch", "ContainerNotFound", StoragePermissionError, False),
        (404, "ContainerNotFound", "AuthenticationFailed BlobNotFound", ObjectNotFoundError, True),
        (404, "BlobNotFound", "ContainerNotFound", ObjectNotFoundError, False),
        (503, "ServerBusy", "BlobNotFound AuthenticationFailed", StorageError, False),
    ],
)
def test_translation_is_decided_by_code_not_message(status, code, message, expected, names_container):
    error = translate(http_error(status, code, message), what="get az://c-1/k", container="my-container")
    assert type(error) is expected and error.strerror.startswith("get az://c-1/k")
    assert ("my-container" in str(error)) is names_container


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (http_error(503, "ServerBusy"), True),
        (http_error(500, "InternalError"), True),
        (http_error(500, "OperationTimedOut"), True),
        (http_error(429, "TooManyRequests"), True),
        (http_error(502, ""), True),
        (ServiceRequestError("connection refused"), True),
        (ServiceResponseError("connection reset"), True),
        (http_error(404, "BlobNotFound", "ServerBusy"), False),
        (http_error(403, "AuthenticationFailed", "ServerBusy"), False),
        (http_error(412, "ConditionNotMet", "ServerBusy"), False),
        (http_error(409, "BlobAlreadyExists"), False),
        (ClientAuthenticationError("no token"), False),
        (ValueError("bug"), False),
    ],
)
def test_retryable_classification(exc, retry):
    assert is_retryable(exc) is retry


def test_a_tls_failure_is_not_retried():
    import requests

    assert is_retryable(ServiceRequestError("tls", error=requests.exceptions.SSLError("bad certificate"))) is False


def test_an_uncommitted_blob_is_invisible_to_listings_and_the_catalog(azure_container):
    """An uncommitted blob is invisible to listings and so to the catalog (no half-written step)."""
    storage = azure_storage(azure_container)
    raw_container(azure_container).get_blob_client(f"p/{step_dir(5)}/shard").stage_block(
        block_id(int(time.time()), "d" * 16, 0), b"x"
    )
    assert storage.list() == [] and catalog.list_steps(storage) == []


def test_an_api_version_the_store_does_not_know_says_so():
    """Azurite (and an Azure Stack) older than the SDK answers 400 InvalidHeaderValue to every request."""
    error = translate(http_error(400, "InvalidHeaderValue"), what="list az://c-1/", container="c-1")
    assert "API version" in str(error) and "--skipApiVersionCheck" in str(error)
