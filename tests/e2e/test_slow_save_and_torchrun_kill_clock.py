"""Field case C08: torchrun's kill clock must not cut a slow emergency save.

A worker whose emergency save takes 36 s; SIGTERM with a 90 s grace period: the save
commits, the workers exit 0, nothing is SIGKILLed. Run twice: SIGTERM to the supervisor
only (Kubernetes sends it to PID 1), and SIGTERM to every process of the job at once
(systemd's control-group kill, where torchrun itself starts its 30 s shutdown clock unless
spotrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT lengthened it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from spotrun.supervisor.process import descendants
from tests.support.paths import JOBS

WORKER = JOBS / "slow_save.py"
SAVE_S, GRACE_S = 36, 90  # the save outlasts torchrun's own 30 s shutdown clock
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("target", ["supervisor", "every-process"])
def test_a_slow_emergency_save_is_not_cut_by_torchruns_kill_clock(tmp_path, target):
    """Field case C08."""
    out = tmp_path / "out"
    out.mkdir()
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--checkpoint-uri",
            str(ck),
            "--grace-period-s",
            str(GRACE_S),
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            str(out),
        ],
        env={**os.environ, "SLOW_SAVE_S": str(SAVE_S)},
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while not (out / "progress").exists() or int((out / "progress").read_text() or 0) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "training never got going"
        time.sleep(0.05)
    victims = [proc.pid] + ([p.pid for p in descendants(proc.pid)] if target == "every-process" else [])
    signalled_at = time.monotonic()
    for pid in victims:
        os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=GRACE_S + 60) == 143
    elapsed_s = time.monotonic() - signalled_at
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]  # both exited 0
    assert all(r["exit"] == 0 and r["save_s"] >= SAVE_S for r in reports), reports
    assert reports[0]["step"] == reports[1]["step"]
    assert SAVE_S <= elapsed_s < GRACE_S, elapsed_s
    listed = json.loads(
        subprocess.run(
            [sys.executable, "-m", "spotrun", "ls", str(ck), "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert [(row["step"], row["status"], row["reason"]) for row in listed] == [
        (reports[0]["step"], "complete", "emergency")
    ]
