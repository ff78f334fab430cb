"""A save's storage work is bounded: ``Checkpointer(save_timeout_s=...)``, and for an
emergency save the supervisor's deadline. One process; the multi-rank cases are in
tests/unit/storage/test_s3_faults.py."""

from __future__ import annotations

import signal
import time

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.control import files as control
from spotrun.errors import CheckpointSaveError, ConfigError
from spotrun.storage import LocalStorage, open_storage
from tests.support.fault_proxy import FaultProxy, FaultRule

#: Without a save deadline, S3 retries of one request go on for 120 s.
BOUND_S = 60.0


@pytest.fixture(autouse=True)
def restore_signal_mask():
    """An emergency save blocks SIGCHLD in the main thread (its process exits right after);
    this test process goes on, and its later children would inherit the blocked signal."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture
def proxied_storage(s3_bucket):
    """(proxy, storage): an S3 storage whose requests go through a fault proxy."""
    with FaultProxy(s3_bucket.endpoint_url, seed=3) as proxy:
        yield proxy, open_storage(f"{s3_bucket.uri}/job", endpoint_url=proxy.url)


def make_checkpointer(storage, **options) -> tuple[spotrun.Checkpointer, dict]:
    weights = {"w": torch.arange(16, dtype=torch.float32)}
    return spotrun.Checkpointer(state={"weights": weights}, storage=storage, handle_signals=False, **options), weights


def test_save_fails_within_save_timeout_when_storage_keeps_failing(proxied_storage):
    proxy, storage = proxied_storage
    ckpt, weights = make_checkpointer(storage, save_timeout_s=3.0)
    ckpt.save(1)
    proxy.set_rule(FaultRule(fraction=1.0))
    weights["w"] += 1
    started_s = time.monotonic()
    with pytest.raises(CheckpointSaveError, match="save of step 2 failed on rank"):
        ckpt.save(2)
    assert time.monotonic() - started_s < BOUND_S
    assert len(proxy.injected) > 1, "the save must have retried before giving up"

    proxy.set_rule(FaultRule())
    assert [(s.step, s.status) for s in catalog.list_steps(storage)] == [(1, "complete")]
    fresh, restored = make_checkpointer(storage)
    assert fresh.restore() == 1
    assert torch.equal(restored["w"], torch.arange(16, dtype=torch.float32))


def test_emergency_save_is_bounded_by_the_supervisors_deadline(proxied_storage, tmp_path, monkeypatch):
    proxy, storage = proxied_storage
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(tmp_path))
    ckpt, _ = make_checkpointer(storage)  # save_timeout_s: the default 300 s
    proxy.set_rule(FaultRule(fraction=1.0))
    now_s = time.time()
    control.write_save_request(str(tmp_path), control.SaveRequest("SIGTERM", now_s, now_s + 3.0))
    with pytest.raises(CheckpointSaveError, match="nothing was committed"):
        ckpt.end_of_step(1)
    assert time.time() - now_s < BOUND_S
    assert control.read_commit_report(str(tmp_path)) is None


def test_emergency_save_after_the_deadline_does_not_try(proxied_storage, tmp_path, monkeypatch):
    proxy, storage = proxied_storage
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(tmp_path))
    ckpt, _ = make_checkpointer(storage)
    now_s = time.time()
    control.write_save_request(str(tmp_path), control.SaveRequest("SIGTERM", now_s - 10, now_s - 1))
    with pytest.raises(CheckpointSaveError, match="deadline passed"):
        ckpt.end_of_step(1)
    assert proxy.forwarded == 0 and proxy.injected == []


def test_local_saves_ignore_the_deadline(tmp_path):
    """Local writes do not retry, so the bound does not apply to them (and must not break them)."""
    storage = LocalStorage(str(tmp_path / "ck"), fsync=False)
    with storage.deadline(0.0):
        storage.put("a", b"x")
    ckpt, _ = make_checkpointer(storage, save_timeout_s=1e-9)
    ckpt.save(1)
    assert [s.status for s in catalog.list_steps(storage)] == ["complete"]


@pytest.mark.parametrize("timeout_s", [0, -1.0])
def test_save_timeout_must_be_positive(tmp_path, timeout_s):
    with pytest.raises(ConfigError, match="save_timeout_s"):
        make_checkpointer(LocalStorage(str(tmp_path)), save_timeout_s=timeout_s)
