"""Issue 8, section 1, the field input: a 2-rank job saving every 5 steps under `spotrun run`;
`kill -KILL` of only the `spotrun` process at step ~12; the same command started again at once.

Required: no committed step's bytes ever change, the newer incarnation wins (it finishes, bit-
identical to an uninterrupted run), and the orphaned job stops. While both run, a watcher
hashes every file that a valid manifest references, each time it sees a newly committed
step, and checks at the end that every one of them still has the bytes it had.
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from pathlib import Path

import pytest

from spotrun.checkpoint import catalog, fencing
from spotrun.checkpoint.layout import step_dir
from spotrun.storage import LocalStorage
from spotrun.supervisor import process
from tests.support import trainrun
from tests.support.trainrun import start_supervised, torchrun_command, wait_for_step

pytestmark = pytest.mark.slow
SAVE_INTERVAL = 5


class CommittedBytesWatcher(threading.Thread):
    """Records the sha256 of every file of every step it ever sees complete."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.first_seen: dict[str, str] = {}
        self.complete_steps: set[int] = set()
        self.stop_event = threading.Event()

    def _files_of_complete_steps(self) -> list[Path]:
        files = []
        for info in catalog.list_steps(LocalStorage(str(self.root))):
            if info.status == catalog.COMPLETE:
                self.complete_steps.add(info.step)
                files += [self.root / step_dir(info.step) / r.path for r in info.manifest.files]
                files.append(self.root / info.manifest_key)
        return files

    def _sweep(self) -> None:
        if not self.root.exists():
            return
        for path in self._files_of_complete_steps():
            if str(path) not in self.first_seen:
                self.first_seen[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()

    def run(self) -> None:
        while not self.stop_event.wait(0.2):
            self._sweep()

    def changed(self) -> dict[str, str]:
        """Files whose bytes differ from (or are gone since) their first sight."""
        self.stop_event.set()
        self.join(timeout=30)
        self._sweep()
        changed = {}
        for path, digest in self.first_seen.items():
            now = hashlib.sha256(Path(path).read_bytes()).hexdigest() if Path(path).exists() else "gone"
            if now != digest:
                changed[path] = now
        return changed


def test_1_zombie_incarnation_after_sigkill_of_the_supervisor(reference, tmp_path, processes):
    ck, log_file = tmp_path / "ck", tmp_path / "train.jsonl"
    command = torchrun_command(trainrun.REFERENCE_STEPS, SAVE_INTERVAL, log_file, "--step-sleep-s", "0.05")
    watcher = CommittedBytesWatcher(ck)
    watcher.start()
    first = start_supervised(str(ck), command, log_path=tmp_path / "first.log")
    processes.append(first)
    wait_for_step(log_file, 12, first)
    old_job = process.descendants(first.pid)
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=60) == -signal.SIGKILL

    second = start_supervised(str(ck), command, log_path=tmp_path / "second.log")  # at once
    processes.append(second)
    deadline = time.monotonic() + 120  # the grace period (30 s) and start-up, with room for a busy machine
    while any(process.is_alive(p) for p in old_job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process.is_alive(p) for p in old_job), "the orphaned job outlived its supervisor"

    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    changed = watcher.changed()
    assert changed == {}, f"committed files changed: {changed}"
    assert {5, 10, 30} <= watcher.complete_steps

    storage = LocalStorage(str(ck))
    fences = fencing.read_fences(storage)
    assert len(fences.resumed) >= 2, fences  # the first start and the restart each claimed one
    final = catalog.committed(storage, trainrun.REFERENCE_STEPS)
    assert final.manifest.incarnation == fences.newest  # the newer incarnation wrote the end
    trainrun.assert_same_as_reference(reference, str(ck), log_file)
