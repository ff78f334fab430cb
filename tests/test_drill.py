"""`spotrun drill`: a rehearsed preemption of the user's own job, its restart, and the report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.trainrun import ls_json, read_log, torchrun_command

pytestmark = pytest.mark.slow

PREEMPTED = 143


def drill(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotrun", "drill", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def test_drill_rehearses_an_azure_preemption_and_a_restart(tmp_path):
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    result = drill("--cloud", "azure", "--after-steps", "10", "--checkpoint-uri", ck, "--json", "--",
                   *torchrun_command(30, 10, log_file, "--step-sleep-s", "0.2"))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["problems"] == []
    assert report["first_exit_code"] == PREEMPTED and report["restart_exit_code"] == PREEMPTED
    emergency = report["emergency_step"]
    assert 10 <= emergency < 30
    assert report["resume_step"] == emergency
    assert report["first_step_after_restart"] == emergency + 1  # train_gpt checks for requests every step
    assert report["notice_unix_s"] <= report["commit_unix_s"] <= report["acknowledged_unix_s"] <= report["exit_unix_s"]
    assert all(seconds is not None and seconds >= 0 for seconds in report["phases_s"].values()), report["phases_s"]

    listed = {row["step"]: row for row in ls_json(ck)}
    assert listed[emergency]["status"] == listed[emergency + 1]["status"] == "complete"
    assert max(listed) == emergency + 1  # the job is left resumable, one step further
    steps = [row["step"] for row in read_log(log_file)]
    restart = steps[steps.index(emergency) + 1:]
    assert restart == [emergency + 1], steps  # the restart ran exactly one step, the one after the emergency step


def test_drill_fails_on_a_job_that_does_not_save(tmp_path):
    """A job without spotrun's Checkpointer ignores the save request: the supervisor stops it at
    the deadline (exit 142) and the drill says so, exit code 1."""
    result = drill("--cloud", "signal", "--after-s", "1", "--grace-period-s", "6", "--checkpoint-uri",
                   str(tmp_path / "ck"), "--", sys.executable, "-c", "import time; time.sleep(300)", timeout_s=180)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "FAILED" in result.stdout
    assert "exited 142 after the notice" in result.stdout


@pytest.mark.parametrize("args", [
    ["--after-steps", "3", "--after-s", "2", "--", "true"],  # two triggers
    ["--cloud", "oracle", "--", "true"],
    ["--after-steps", "0", "--", "true"],
    ["--cloud", "aws"],  # no command
])
def test_drill_refuses_bad_options(tmp_path, args):
    result = drill("--checkpoint-uri", str(tmp_path / "ck"), *args, timeout_s=120)
    assert result.returncode == 2
    assert "error" in result.stderr
    assert not (tmp_path / "ck").exists()  # nothing was launched
