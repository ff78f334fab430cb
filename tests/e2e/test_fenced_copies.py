"""Field case C20, two live copies of one job: the same command started twice on one root (a
retry while the first copy still runs), each under `spotrun run --max-restarts 2`.

The newer copy fences the older one. The older copy's supervisor must stop with exit 86 and a
line naming the newer incarnation, and never restart (a restart would claim yet another
incarnation and fence the newer copy in turn: before the fix the two took turns; the field
report counted 5 incarnations claimed). The newer copy finishes. Real `spotrun run`, torchrun
(one rank each: two copies on two shared cores) and the example trainer; the older copy's processes are paused (SIGSTOP)
while the newer one claims its incarnation, so the older one is fenced at a known point
instead of racing to its last step.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from spotrun.checkpoint import catalog, fencing
from spotrun.control import files as control
from spotrun.storage import LocalStorage
from spotrun.supervisor import EXIT_FENCED, process
from tests.support.trainrun import TRAIN_ARGS, read_log, start_supervised, wait_for_step

pytestmark = pytest.mark.slow
STEPS, SAVE_INTERVAL = 30, 5
SUPERVISOR_OPTIONS = ["--max-restarts", "2", "--restart-backoff-s", "0", "--notice", "signal"]
WAIT_S = 300.0  # two cores shared with other test runs; every process imports torch


def one_rank_command(log_file: Path) -> list[str]:
    """The example trainer on one rank; --standalone picks a free rendezvous port, so two copies
    run side by side on one machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "spotrun.examples.train_gpt",
        "--steps",
        str(STEPS),
        "--save-interval",
        str(SAVE_INTERVAL),
        "--log-file",
        str(log_file),
        *TRAIN_ARGS,
        "--step-sleep-s",
        "0.1",
    ]


def signal_job(supervisor, signum: int) -> None:
    """``signum`` to every process the supervisor started (torchrun and its workers)."""
    for info in process.descendants(supervisor.pid):
        try:
            os.kill(info.pid, signum)
        except ProcessLookupError:
            pass


def wait_until(condition, what: str, *alive) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        for proc in alive:
            assert proc.poll() is None, f"exited {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def control_dir_of(supervisor) -> Path:
    """The control directory of the supervisor's running launch, from its command's environment."""
    for info in process.descendants(supervisor.pid):
        for item in Path(f"/proc/{info.pid}/environ").read_bytes().split(b"\0"):
            name, _, value = item.partition(b"=")
            if name == b"SPOTRUN_CONTROL_DIR":
                return Path(value.decode())
    raise AssertionError("no process of the job has SPOTRUN_CONTROL_DIR")


def incarnation_records(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "incarnations").iterdir())


def start_paused_older_copy(ck: Path, tmp_path: Path, processes: list):
    """The first copy, trained past its first checkpoint, then paused (every process of its job)."""
    older = start_supervised(
        str(ck),
        one_rank_command(tmp_path / "older.jsonl"),
        extra_options=SUPERVISOR_OPTIONS,
        log_path=tmp_path / "older.log",
    )
    processes.append(older)
    wait_for_step(tmp_path / "older.jsonl", SAVE_INTERVAL + 1, older, timeout_s=WAIT_S)
    signal_job(older, signal.SIGSTOP)
    assert older.poll() is None and read_log(tmp_path / "older.jsonl")[-1]["step"] < STEPS, (
        "the older copy finished before it was paused: nothing left to show"
    )
    return older


def test_a_fenced_copy_is_not_restarted_and_the_newer_copy_finishes(tmp_path, processes):
    """C20: the older copy, fenced by the newer one, exits 86 naming the newer incarnation and
    claims nothing more; the newer copy trains to the end; two incarnations in all."""
    ck = tmp_path / "ck"
    older = start_paused_older_copy(ck, tmp_path, processes)
    newer = start_supervised(
        str(ck),
        one_rank_command(tmp_path / "newer.jsonl"),
        extra_options=SUPERVISOR_OPTIONS,
        log_path=tmp_path / "newer.log",
    )
    processes.append(newer)
    wait_until(lambda: fencing.read_fences(LocalStorage(str(ck))).newest == 1, "the newer copy's claim", newer)
    signal_job(older, signal.SIGCONT)

    older_code = older.wait(timeout=WAIT_S)
    older_log = (tmp_path / "older.log").read_text()
    assert older_code == EXIT_FENCED, older_log[-3000:]
    host = socket.gethostname()
    assert re.search(
        rf"fenced: incarnation 1 \(host {re.escape(host)}, pid \d+, spotrun run pid {newer.pid}\)", older_log
    ), older_log[-3000:]
    assert "restart 1 of 2" not in older_log
    assert newer.wait(timeout=WAIT_S) == 0, (tmp_path / "newer.log").read_text()[-3000:]

    assert incarnation_records(ck) == ["incarnation-000000000.json", "incarnation-000000001.json"]
    final = catalog.committed(LocalStorage(str(ck)), STEPS)
    assert final.manifest.incarnation == 1
    assert [row["step"] for row in read_log(tmp_path / "newer.jsonl")][-1] == STEPS
    assert read_log(tmp_path / "older.jsonl")[-1]["step"] < STEPS, "the older copy trained on to the end"


def test_a_copy_fenced_while_it_saves_for_a_notice_exits_86_not_142(tmp_path, processes):
    """C20, the race with a notice: the older copy gets a notice while a newer start has claimed
    the root; its emergency save is fenced. It exits 86 (a 142 would be retried by the
    platform, and that retry would fence the newer copy), not restarted, naming the newer
    start (claimed here by the library itself, as a newer copy's first restore does)."""
    ck = tmp_path / "ck"
    older = start_paused_older_copy(ck, tmp_path, processes)
    storage = LocalStorage(str(ck))
    resumed = catalog.newest_complete(storage)
    newer = fencing.claim(storage, resumed_step=resumed.step if resumed else None, run_id="the newer copy")
    request = control_dir_of(older) / control.SAVE_REQUEST_FILE
    older.send_signal(signal.SIGTERM)  # the notice: the supervisor writes the save request
    wait_until(request.exists, "the save request", older)
    signal_job(older, signal.SIGCONT)  # the workers see it at their next step and save: fenced

    older_code = older.wait(timeout=WAIT_S)
    older_log = (tmp_path / "older.log").read_text()
    assert older_code == EXIT_FENCED, older_log[-3000:]
    assert "preemption notice: SIGTERM" in older_log, older_log[-3000:]
    # The save that meets the fence is the emergency one, or (on a loaded machine) the periodic
    # save still in flight when the copy was paused, whose commit comes first after SIGCONT.
    assert re.search(
        r"save requested \(supervisor: SIGTERM\): emergency checkpoint of step"
        r"|commit of step \d+ failed on rank 0: FencedError",
        older_log,
    ), older_log[-3000:]
    assert f"fenced: incarnation {newer.incarnation} (host {socket.gethostname()}, pid {os.getpid()})" in older_log
    assert "restart 1 of 2" not in older_log
    assert incarnation_records(ck) == ["incarnation-000000000.json", "incarnation-000000001.json"]
    # the fenced save was refused before its commit (a later commit would be listed fenced): at
    # most its uncommitted files are left, which `spotrun gc` removes
    assert [
        (s.step, s.problem)
        for s in catalog.list_steps(storage)
        if s.status != catalog.COMPLETE and s.manifest is not None
    ] == []
