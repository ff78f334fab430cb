"""Field case C06: SIGKILL in the middle of writing a shard never yields a complete step."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from tests.support.paths import JOBS

WORKER = JOBS / "stalled_shard_writer.py"


def wait_for(path: pathlib.Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"worker exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "worker never reached the middle of the write"
        time.sleep(0.05)


def ls_json(ckpt_dir: pathlib.Path) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "spotrun", "ls", str(ckpt_dir), "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(out.stdout)


def test_sigkill_in_the_middle_of_a_shard_write_leaves_the_previous_step(tmp_path):
    """Field case C06."""
    ckpt_dir, marker = tmp_path / "ck", tmp_path / "half-written"
    proc = subprocess.Popen([sys.executable, str(WORKER), str(ckpt_dir), str(marker)])
    try:
        wait_for(marker, proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    step_200 = ckpt_dir / "step-000000200"
    leftovers = list(step_200.iterdir())
    half = int(marker.read_text())
    assert any(p.stat().st_size == half for p in leftovers), "the kill did not land mid-write"
    assert not list(step_200.glob("manifest*"))

    listed = {row["step"]: row for row in ls_json(ckpt_dir)}
    assert listed[100]["status"] == "complete"
    assert listed.get(200, {"status": "absent"})["status"] != "complete"

    resumed = subprocess.run(
        [sys.executable, str(WORKER), str(ckpt_dir), "--resume"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.stdout.strip() == "100"
