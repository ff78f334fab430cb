"""`spotrun run` as a real process around the fake launch commands in ``tests/jobs`` (``saver.py``,
``ignorer.py``, ...): its options for short deadlines and a handle on the process. The fixture
that starts one, ``spotrun_run``, is in ``tests/conftest.py``."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from spotrun.checkpoint import catalog
from spotrun.storage import LocalStorage
from spotrun.supervisor import process
from tests.support.paths import JOBS

#: The fake launch commands.
FAKE = JOBS
GRACE_S, MARGIN_S, STOP_S = 3.0, 1.0, 1.0
FAST = ["--grace-period-s", str(GRACE_S), "--safety-margin-s", str(MARGIN_S), "--stop-timeout-s", str(STOP_S)]
#: Generous: two cores shared with other test runs, and every process imports torch.
WAIT_S = 120.0


class Spotrun:
    """One `python -m spotrun run ... -- COMMAND` process, its stderr in a file."""

    def __init__(self, tmp_path: pathlib.Path, options: list[str], command: list, *, cwd=None, env=None):
        self.log_path = tmp_path / "spotrun.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spotrun", "run", *options, "--", *map(str, command)],
                stderr=log,
                cwd=cwd,
                env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_until(self, condition, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            assert self.proc.poll() is None, f"spotrun exited {self.proc.returncode} before {what}:\n{self.log()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.log()}"
            time.sleep(0.02)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"spotrun did not exit:\n{self.log()}")

    def kill_everything(self) -> None:
        """Test cleanup only: leave nothing running if an assertion failed mid-test."""
        if self.proc.poll() is None:
            for info in process.descendants(self.proc.pid):
                os.kill(info.pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def steps_on(ckpt: pathlib.Path) -> list[catalog.StepInfo]:
    return catalog.list_steps(LocalStorage(str(ckpt)))


def sigterm_ignored_until_stopped(run, state) -> tuple[int, int, float]:
    """SIGTERM to a supervisor whose worker (tests/jobs/ignorer.py) and its grandchild
    ignore it: the supervisor must stop them and exit 142. Returns (worker pid, grandchild
    pid, seconds from the SIGTERM to the exit)."""
    run.wait_until(lambda: (state / "pids").exists(), "the worker and its grandchild started")
    worker_pid, grandchild_pid = map(int, (state / "pids").read_text().split())
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 142, run.log()
    return worker_pid, grandchild_pid, time.monotonic() - sent
