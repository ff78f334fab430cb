"""Issue 8, sections 3 and 9: the no-overwrite commit primitive, on every kind of store.

Section 3 (storage that lacks the commit primitive):
* a local root whose filesystem has no hard links (``os.link`` failing with ``ENOSYS``,
  ``EPERM`` or ``EOPNOTSUPP``) commits with ``renameat2(RENAME_NOREPLACE)`` instead, which
  keeps every guarantee; where that is missing too, the preflight fails before launch.
  Here the missing hard links are injected by replacing ``os.link`` in the test process
  (the rename underneath is the real syscall on the real filesystem);
  ``tests/unit/storage/test_commit_primitive_fuse.py`` does the same on a real FUSE mount.
* an S3 store answering ``501 NotImplemented`` to a ``PutObject`` with ``If-None-Match: *``
  fails the preflight (``spotrun run`` exits 2 without launching), and a commit that
  meets it is a clear error, sent once, never retried;
* an S3 store that silently ignores the condition fails the preflight: two writers can
  never both believe they committed.
Both S3 stores are a real moto server behind a real HTTP proxy on 127.0.0.1
(``tests/support/fault_proxy.py``) that answers 501, or drops the condition header.

Section 9 (a second, real S3 implementation): on Ceph RGW, which overwrites on a
conditional multipart completion, ``put_if_absent`` of a multipart-sized object onto an
existing key is refused (it is always one conditional ``PutObject``).
"""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import threading

import pytest
import torch

import spotrun
from spotrun.errors import CommitUnsupportedError, ObjectExistsError, StorageError
from spotrun.storage import LocalStorage, open_storage, parse_location
from spotrun.storage import local as local_backend
from spotrun.storage.s3 import MAX_SINGLE_PUT_BYTES
from spotrun.supervisor.preflight import PROBE_PREFIX, check_storage
from tests.support.fault_proxy import IGNORE_CONDITION, NOT_IMPLEMENTED, FaultRule, conditional_put
from tests.support.s3_server import make_client

MIB = 1024 * 1024
#: Above the backend's default multipart threshold, where ``put`` uses multipart uploads.
MULTIPART_SIZED_BYTES = 70 * MIB
RGW_SETUP_TIMEOUT_S = 1200


def spotrun_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spotrun", *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )


def error_line(stderr: str) -> str:
    [line] = [line for line in stderr.splitlines() if line.startswith("spotrun: error: ")]
    return line


def no_hard_links(error_number: int):
    """An ``os.link`` that fails as on a filesystem without hard links."""

    def link(src, dst, *args, **kwargs):
        raise OSError(error_number, os.strerror(error_number), src, None, dst)

    return link


def no_rename_noreplace(src, dst):
    raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), src, None, dst)


def visible_files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


# --- 3: a local root without hard links ---------------------------------------------


@pytest.mark.parametrize(
    "error_number", [errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP], ids=["ENOSYS", "EPERM", "EOPNOTSUPP"]
)
def test_3_local_root_without_hard_links_commits_with_rename_noreplace(tmp_path, monkeypatch, error_number):
    monkeypatch.setattr(os, "link", no_hard_links(error_number))
    root = tmp_path / "ck"
    result = check_storage(parse_location(str(root)))
    assert result.commit_primitive == local_backend.RENAME_NOREPLACE

    storage = LocalStorage(str(root))
    storage.put_if_absent("step-1/manifest.json", b"first")
    with pytest.raises(ObjectExistsError):
        storage.put_if_absent("step-1/manifest.json", b"second")
    assert storage.get("step-1/manifest.json") == b"first"
    assert storage.commit_primitive == local_backend.RENAME_NOREPLACE
    assert visible_files(root) == ["step-1/manifest.json"]  # no temporary file left behind


def test_3_local_root_without_hard_links_has_one_winner_among_racing_writers(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "link", no_hard_links(errno.ENOSYS))
    storage = LocalStorage(str(tmp_path / "ck"))
    writers = 8
    barrier = threading.Barrier(writers)
    outcomes: dict[int, str] = {}

    def write(i: int) -> None:
        barrier.wait()
        try:
            storage.put_if_absent("commit", f"writer-{i}".encode())
            outcomes[i] = "won"
        except ObjectExistsError:
            outcomes[i] = "refused"

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    [winner] = [i for i, outcome in outcomes.items() if outcome == "won"]
    assert sorted(outcomes.values()).count("refused") == writers - 1
    assert storage.get("commit") == f"writer-{winner}".encode()
    assert visible_files(tmp_path / "ck") == ["commit"]


def test_3_local_root_without_hard_links_saves_and_restores_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "link", no_hard_links(errno.ENOSYS))
    uri = str(tmp_path / "ck")
    weights = {"w": torch.zeros(8)}
    ckpt = spotrun.Checkpointer(state={"weights": weights}, uri=uri, handle_signals=False)
    for step in (1, 2):
        weights["w"] = torch.full((8,), float(step))
        ckpt.save(step, reason="periodic")
    restored = {"w": torch.zeros(8)}
    step = spotrun.Checkpointer(state={"weights": restored}, uri=uri, handle_signals=False).restore()
    assert step == 2 and torch.equal(restored["w"], torch.full((8,), 2.0))
    listed = subprocess.run(
        [sys.executable, "-m", "spotrun", "ls", uri, "--json"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert '"status": "complete"' in listed


def test_3_local_root_without_any_no_replace_primitive_fails_preflight(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "link", no_hard_links(errno.ENOSYS))
    monkeypatch.setattr(local_backend, "rename_noreplace", no_rename_noreplace)
    root = tmp_path / "ck"
    with pytest.raises(CommitUnsupportedError) as caught:
        check_storage(parse_location(str(root)))
    message = caught.value.strerror
    assert "preflight" in message and str(root) in message
    assert "no hard links" in message and "Function not implemented" in message
    assert "RENAME_NOREPLACE" in message and "s3://" in message  # the missing feature, and what to do
    assert visible_files(root) == []  # the probes are gone
    # A commit meets the same error: it never falls back to an overwriting rename.
    with pytest.raises(CommitUnsupportedError):
        LocalStorage(str(root)).put_if_absent("step-1/manifest.json", b"m")
    assert visible_files(root) == []


# --- 3: an S3 store answering 501 to the conditional put -------------------------------


def test_3_s3_store_answering_501_to_conditional_put_fails_preflight(s3_bucket, proxy, tmp_path):
    proxy.set_rule(FaultRule(fraction=1.0, kinds=(NOT_IMPLEMENTED,), match=conditional_put))
    uri = f"{s3_bucket.uri}/job"
    with pytest.raises(CommitUnsupportedError) as caught:
        check_storage(parse_location(uri, endpoint_url=proxy.url))
    message = caught.value.strerror
    assert "preflight" in message and "501 NotImplemented" in message and "If-None-Match: *" in message
    assert "Upgrade the store" in message

    marker = tmp_path / "launched"
    done = spotrun_cli(
        "run",
        "--checkpoint-uri",
        uri,
        "--s3-endpoint-url",
        proxy.url,
        "--notice",
        "none",
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
    )
    assert done.returncode == 2, done.stderr
    assert "501 NotImplemented" in error_line(done.stderr) and "Traceback" not in done.stderr
    assert not marker.exists(), "the job must not start on a store that cannot commit"
    done = spotrun_cli("preflight", uri, "--s3-endpoint-url", proxy.url)
    assert done.returncode == 2 and "conditional writes" in error_line(done.stderr)
    assert make_client(s3_bucket.endpoint_url).list_objects_v2(Bucket=s3_bucket.name).get("KeyCount") == 0


def test_3_s3_store_answering_501_at_commit_is_a_clear_error_sent_once(s3_bucket, proxy):
    proxy.set_rule(FaultRule(fraction=1.0, kinds=(NOT_IMPLEMENTED,), match=conditional_put))
    storage = open_storage(f"{s3_bucket.uri}/job", endpoint_url=proxy.url)
    with pytest.raises(CommitUnsupportedError, match="does not support conditional writes"):
        storage.put_if_absent("step-000000010/manifest.json", b"{}")
    assert len(proxy.seen(conditional_put)) == 1, "a 501 must not be retried"
    assert storage.exists("step-000000010/manifest.json") is False


def test_3_s3_store_answering_501_at_commit_fails_the_save_naming_the_feature(s3_bucket, proxy):
    proxy.set_rule(FaultRule(fraction=1.0, kinds=(NOT_IMPLEMENTED,), match=conditional_put))
    storage = open_storage(f"{s3_bucket.uri}/job", endpoint_url=proxy.url)
    ckpt = spotrun.Checkpointer(state={"weights": {"w": torch.ones(4)}}, storage=storage, handle_signals=False)
    with pytest.raises(spotrun.CheckpointSaveError, match="does not support conditional writes"):
        ckpt.save(10)
    assert len(proxy.seen(conditional_put)) == 1  # the first conditional put: this start's record
    assert storage.list("") == []  # nothing written, nothing to clean up


def test_3_store_that_cannot_commit_stops_periodic_saves_at_the_first_failure(s3_bucket, proxy):
    """Periodic saves tolerate a few failures in a row (a store's bad minute); a store that
    cannot commit at all fails the same way every time, so the first one stops training."""
    proxy.set_rule(FaultRule(fraction=1.0, kinds=(NOT_IMPLEMENTED,), match=conditional_put))
    storage = open_storage(f"{s3_bucket.uri}/job", endpoint_url=proxy.url)
    ckpt = spotrun.Checkpointer(
        state={"weights": {"w": torch.ones(4)}},
        storage=storage,
        handle_signals=False,
        interval_steps=1,
        max_failed_periodic_saves=3,
    )
    with pytest.raises(spotrun.CheckpointSaveError, match="does not support conditional writes") as caught:
        ckpt.end_of_step(1)
    assert not caught.value.retryable


# --- 3: an S3 store that ignores the condition ------------------------------------------


def test_3_s3_store_ignoring_the_condition_fails_preflight(s3_bucket, proxy, tmp_path):
    proxy.set_rule(FaultRule(fraction=1.0, kinds=(IGNORE_CONDITION,), match=conditional_put))
    uri = f"{s3_bucket.uri}/job"
    # What the preflight guards against: through this store, two writers both "commit".
    storage = open_storage(uri, endpoint_url=proxy.url)
    storage.put_if_absent("step-000000010/manifest.json", b"writer A")
    storage.put_if_absent("step-000000010/manifest.json", b"writer B")
    storage.delete("step-000000010/manifest.json")

    with pytest.raises(CommitUnsupportedError) as caught:
        check_storage(parse_location(uri, endpoint_url=proxy.url))
    message = caught.value.strerror
    assert "second no-overwrite write onto the same key succeeded" in message
    assert "ignores conditional writes (PutObject with If-None-Match: *)" in message
    assert "two writers could both believe they committed" in message

    marker = tmp_path / "launched"
    done = spotrun_cli(
        "run",
        "--checkpoint-uri",
        uri,
        "--s3-endpoint-url",
        proxy.url,
        "--notice",
        "none",
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
    )
    assert done.returncode == 2, done.stderr
    assert "ignores conditional writes" in error_line(done.stderr)
    assert not marker.exists()
    assert storage.list(PROBE_PREFIX) == []


def test_3_s3_store_enforcing_the_condition_passes_preflight(s3_bucket, proxy):
    result = check_storage(parse_location(f"{s3_bucket.uri}/job", endpoint_url=proxy.url))
    assert result.commit_primitive == "conditional PutObject (If-None-Match: *)"
    # write, read, list, delete, then two conditional puts (the second refused), read, delete
    assert len(proxy.seen(conditional_put)) == 2


# --- 9: put_if_absent never depends on a conditional multipart completion ------------------


@pytest.mark.timeout(RGW_SETUP_TIMEOUT_S)
def test_9_multipart_sized_put_if_absent_onto_existing_key_is_refused_on_rgw(rgw_bucket):
    storage = open_storage(f"{rgw_bucket.uri}/job")  # default transfer settings
    first = os.urandom(MULTIPART_SIZED_BYTES)
    storage.put_if_absent("step-000000010/manifest.json", first)
    with pytest.raises(ObjectExistsError):
        storage.put_if_absent("step-000000010/manifest.json", b"x" * MULTIPART_SIZED_BYTES)
    assert storage.get("step-000000010/manifest.json") == first
    result = check_storage(parse_location(f"{rgw_bucket.uri}/job"))
    assert result.commit_primitive.startswith("conditional PutObject")


def test_9_put_if_absent_larger_than_one_put_is_refused_before_sending(s3_bucket):
    storage = open_storage(f"{s3_bucket.uri}/job")
    too_big = memoryview(mmap.mmap(-1, MAX_SINGLE_PUT_BYTES + 1))  # untouched pages: no memory used
    with pytest.raises(StorageError, match="more than one conditional PutObject may carry") as caught:
        storage.put_if_absent("step-000000010/manifest.json", too_big)
    assert caught.value.errno == errno.EFBIG
    assert storage.exists("step-000000010/manifest.json") is False
