"""The supervisor as PID 1 of a new PID namespace, as in a container without tini.

PID 1 gets no default signal actions from the kernel and inherits every orphan of the
namespace. Under `unshare --pid --fork --mount-proc`, SIGTERM to spotrun: the emergency
checkpoint commits, orphans are reaped (no zombies), and the exit code is 143.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from spotrun.supervisor.process import descendants
from tests.support.trainrun import read_log, torchrun_command, wait_for_step

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare"),
]


def namespace_available() -> bool:
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


def zombies(root_pid: int) -> list[int]:
    return [p.pid for p in _all_below(root_pid) if p.state == "Z"]


def _all_below(root_pid: int):
    from spotrun.supervisor.process import _all_processes

    children: dict[int, list] = {}
    for info in _all_processes():
        children.setdefault(info.ppid, []).append(info)
    stack, found = [root_pid], []
    while stack:
        for info in children.get(stack.pop(), []):
            found.append(info)
            stack.append(info.pid)
    return found


def test_supervisor_as_pid1_saves_reaps_and_exits_cleanly(tmp_path):
    if not namespace_available():
        pytest.skip("cannot create a PID namespace here (needs root or user namespaces)")
    ck, log_file = tmp_path / "ck", tmp_path / "train.jsonl"
    train = shlex.join(torchrun_command(30, 10, log_file, "--step-sleep-s", "0.05"))
    # The launch command leaves orphans behind (a subshell's background sleeps), which the
    # kernel re-parents to PID 1: spotrun must reap them or they stay zombies.
    launch = f"(sleep 0.5 &); (sleep 1 &); exec {train}"
    unshare = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--checkpoint-uri",
            str(ck),
            "--grace-period-s",
            "60",
            "--",
            "sh",
            "-c",
            launch,
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not [p for p in descendants(unshare.pid) if p.ppid == unshare.pid]:
            assert time.monotonic() < deadline and unshare.poll() is None
            time.sleep(0.05)
        pid1 = [p.pid for p in descendants(unshare.pid) if p.ppid == unshare.pid][0]
        with open(f"/proc/{pid1}/status") as f:
            nspid = [line.split()[-1] for line in f if line.startswith("NSpid:")]
        assert nspid == ["1"], "spotrun is not PID 1 of the new namespace"

        wait_for_step(log_file, 5, unshare)  # the orphaned sleeps (0.5 s, 1 s) have exited by now
        assert zombies(unshare.pid) == []
        os.kill(pid1, signal.SIGTERM)
        assert unshare.wait(timeout=300) == 143
    finally:
        if unshare.poll() is None:
            os.killpg(unshare.pid, signal.SIGKILL)
    listed = json.loads(
        subprocess.run(
            [sys.executable, "-m", "spotrun", "ls", str(ck), "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    emergency = [row for row in listed if row["reason"] == "emergency"]
    assert len(emergency) == 1 and emergency[0]["status"] == "complete"
    assert emergency[0]["step"] >= read_log(log_file)[0]["step"]
