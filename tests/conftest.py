"""Fixtures shared by the end-to-end tests."""

import signal

import pytest

from tests.trainrun import (
    REFERENCE_SAVE_INTERVAL,
    REFERENCE_STEPS,
    final_tensors,
    kill_tree,
    last_loss_per_step,
    start_supervised,
    torchrun_command,
)


@pytest.fixture(autouse=True)
def _signal_mask_restored():
    """An in-process emergency save blocks SIGCHLD in the main thread for good (the process is
    meant to exit right after); restore the test process's mask so later tests do not inherit it."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture
def processes():
    """Supervisors started by a test; any still running at the end are killed with their trees."""
    started = []
    yield started
    for proc in started:
        kill_tree(proc)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One uninterrupted supervised 2-rank run of the example trainer (REFERENCE_STEPS steps,
    a checkpoint every REFERENCE_SAVE_INTERVAL): (per-step losses, final model and optimizer
    tensors, its checkpoint directory). Shared by every test that checks exact resume."""
    root = tmp_path_factory.mktemp("reference")
    log_file = root / "train.jsonl"
    proc = start_supervised(str(root / "ck"), torchrun_command(REFERENCE_STEPS, REFERENCE_SAVE_INTERVAL, log_file),
                            extra_options=["--notice", "none"], log_path=root / "supervisor.log")
    try:
        assert proc.wait(timeout=600) == 0, (root / "supervisor.log").read_text()[-3000:]
    finally:
        kill_tree(proc)
    losses = last_loss_per_step(log_file)
    assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1))
    return losses, final_tensors(str(root / "ck"), REFERENCE_STEPS), root / "ck"
