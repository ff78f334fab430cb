"""Jobs with a rank that stops answering: wait for the other ranks' reports, and make sure that
nothing stays stopped after a test (the workers write their pids to ``pid-rank-R`` files)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Iterator


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def end_workers(out_dir: pathlib.Path, script: str) -> None:
    """SIGCONT then SIGKILL every worker that wrote a ``pid-rank-R`` file under ``out_dir`` and
    still runs ``script`` (a pid taken by another process since is left alone)."""
    for pid_file in out_dir.glob("**/pid-rank-*"):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        if script in _cmdline(pid):
            for signum in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)


@contextlib.contextmanager
def job_tree(command: list[str], out_dir: pathlib.Path, script: str, **popen: object) -> Iterator[subprocess.Popen]:
    """Run ``command`` in a session of its own; at the end its workers (:func:`end_workers`) and
    its whole process group are killed, whatever the test found."""
    proc = subprocess.Popen(command, start_new_session=True, **popen)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        end_workers(out_dir, script)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def wait_for_reports(out_dir: pathlib.Path, ranks: list[int], proc: subprocess.Popen, timeout_s: float) -> list[dict]:
    """The ``rank-R.json`` reports of ``ranks``, waiting up to ``timeout_s`` for them."""
    deadline = time.monotonic() + timeout_s
    paths = [out_dir / f"rank-{r}.json" for r in ranks]
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise AssertionError(f"no report {missing} after {timeout_s:.0f} s (job exit code {proc.poll()})")
        time.sleep(0.2)
    return [json.loads(p.read_text()) for p in paths]
