"""Helpers for tests of jobs that checkpoint by their own means (the recipes in examples/).

Both recipes append JSON lines to ``--log-file``: ``start`` (rank, pid, resumed_step), ``step``
(rank 0), ``signal`` (received_unix_s), ``notice`` (seen_unix_s), ``saved`` (step), ``done`` (step).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from tests.support.paths import REPO

EXAMPLES = REPO / "examples"
DCP_SCRIPT = EXAMPLES / "dcp_on_signal.py"
HF_SCRIPT = EXAMPLES / "hf_trainer.py"
LIGHTNING_SCRIPT = EXAMPLES / "lightning_trainer.py"
#: Generous: two cores shared with other test runs; each launch imports torch in every process.
WAIT_S = 180.0


def torchrun(script: pathlib.Path, *args: object) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        *map(str, args),
    ]


def accelerate_launch(script: pathlib.Path, *args: object) -> list[str]:
    """``accelerate launch --multi_gpu`` with 2 processes on CPU (field case C19): accelerate
    runs torch's elastic agent in its own process, no torchrun on any command line. Every
    option given, so it reads no config file; port 0: a free one."""
    return [
        str(pathlib.Path(sys.executable).with_name("accelerate")),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        "0",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script),
        *map(str, args),
    ]


def start(command: list[str], output: pathlib.Path, env: dict | None = None) -> subprocess.Popen:
    """Start ``command`` in its own session, stdout and stderr appended to ``output``."""
    with open(output, "ab") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )


def events(log_file: pathlib.Path) -> list[dict]:
    if not log_file.exists():
        return []
    rows = []
    for line in log_file.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            continue
    return rows


def wait_for_training(
    log_file: pathlib.Path, proc: subprocess.Popen, *, ranks: int, step: int, since: int = 0
) -> list[int]:
    """Wait until every rank logged its start and rank 0 logged ``step`` (events after the first
    ``since``); returns the workers' pids."""
    deadline = time.monotonic() + WAIT_S
    while True:
        new = events(log_file)[since:]
        pids = [e["pid"] for e in new if e["event"] == "start"]
        if len(pids) == ranks and any(e["event"] == "step" and e["step"] >= step for e in new):
            return pids
        assert proc.poll() is None, f"the job exited with {proc.returncode} before step {step}"
        assert time.monotonic() < deadline, f"step {step} not reached in {WAIT_S} s"
        time.sleep(0.02)


def saved_step(new_events: list[dict], ranks: int) -> int:
    """The one step every rank saved (asserted)."""
    saved = {e["rank"]: e["step"] for e in new_events if e["event"] == "saved"}
    assert sorted(saved) == list(range(ranks)), f"ranks that saved: {saved}"
    assert len(set(saved.values())) == 1, f"ranks saved different steps: {saved}"
    return saved[0]


def assert_resumed_and_finished(new_events: list[dict], *, from_step: int, last_step: int, ranks: int) -> None:
    """The run whose events are ``new_events`` started at ``from_step + 1`` on every rank and
    trained every step to ``last_step``."""
    assert {e["rank"]: e["resumed_step"] for e in new_events if e["event"] == "start"} == {
        r: from_step for r in range(ranks)
    }
    assert [e["step"] for e in new_events if e["event"] == "step"] == list(range(from_step + 1, last_step + 1))
    assert {e["rank"]: e["step"] for e in new_events if e["event"] == "done"} == {r: last_step for r in range(ranks)}
