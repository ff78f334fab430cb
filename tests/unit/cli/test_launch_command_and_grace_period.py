"""Issue 8, section 6: `--` before the launch command, a proportionate safety margin for a
short grace period, and the stop of an uncooperative tree within the grace period.
(`spotrun ls` of a root that does not exist: tests/unit/cli/test_cli_ls.py, test_6_ls_...)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.fake_launch import FAKE, WAIT_S, alive, sigterm_ignored_until_stopped, steps_on


@pytest.mark.parametrize(
    "words",
    [
        ["run", "python", "-c", "open('started', 'w')"],
        ["run", "--notice", "none", "python", "-c", "open('started', 'w')"],
        ["run", "python", "-c", "open('started', 'w')", "--", "x"],
        ["drill", "--cloud", "signal", "python", "-c", "open('started', 'w')"],
    ],
    ids=["run", "run-after-options", "run-dashes-later", "drill"],
)
def test_6_launch_command_without_dashes_is_refused(tmp_path, words):
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", *words], capture_output=True, text=True, timeout=WAIT_S, cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line == (
        f"spotrun: error: 'python' is not an option of spotrun {words[0]}: put the launch command "
        f"after '--', as in spotrun {words[0]} [options] -- torchrun --nproc-per-node 8 train.py"
    )
    assert not (tmp_path / "started").exists(), "nothing may be launched"
    assert not (tmp_path / "checkpoints").exists(), "nothing may be written"


def test_6_launch_command_after_dashes_may_contain_dashes(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--notice",
            "none",
            "--checkpoint-uri",
            "ck",
            "--",
            sys.executable,
            "-c",
            "import sys; open('argv', 'w').write(repr(sys.argv[1:]))",
            "--",
            "--grace-period-s",
        ],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "argv").read_text() == repr(["--", "--grace-period-s"])


def test_6_short_grace_period_gets_a_proportionate_safety_margin(spotrun_run, tmp_path, state):
    """--grace-period-s 2 (less than the default 5 s margin) without --safety-margin-s: the
    margin is half the grace period, 1 s, and the save gets the other second."""
    ckpt = tmp_path / "ckpt"
    run = spotrun_run(
        ["--checkpoint-uri", str(ckpt), "--notice", "none", "--grace-period-s", "2"],
        [sys.executable, FAKE / "saver.py", state],
    )
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    sent_unix_s = time.time()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 143, run.log()
    assert "grace period 2.0 s, safety margin 1.0 s" in run.log()
    request = json.loads((state / "request.json").read_text())
    assert sent_unix_s + 1.0 <= request["deadline_unix_s"] <= request["requested_unix_s"] + 1.0
    assert [(s.status, s.reason) for s in steps_on(ckpt)] == [("complete", "emergency")]


def test_6_explicit_safety_margin_not_shorter_than_the_grace_period_is_refused(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--grace-period-s",
            "2",
            "--safety-margin-s",
            "2",
            "--",
            sys.executable,
            "-c",
            "pass",
        ],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("spotrun: error: safety margin must be >= 0 and < the grace period")


def test_6_uncooperative_tree_is_stopped_within_the_grace_period(spotrun_run, tmp_path, state):
    """Workers that ignore the save request and SIGTERM (one of them in another session), with a
    --stop-timeout-s far longer than the grace period: SIGTERM at the save deadline, SIGKILL
    halfway through the safety margin, so nothing waits for the stop timeout."""
    grace_s, margin_s, stop_timeout_s = 3.0, 1.0, 60.0
    run = spotrun_run(
        [
            "--checkpoint-uri",
            str(tmp_path / "ckpt"),
            "--notice",
            "none",
            "--grace-period-s",
            str(grace_s),
            "--safety-margin-s",
            str(margin_s),
            "--stop-timeout-s",
            str(stop_timeout_s),
        ],
        [sys.executable, FAKE / "ignorer.py", state],
    )
    worker_pid, grandchild_pid, waited_s = sigterm_ignored_until_stopped(run, state)
    assert waited_s >= grace_s - margin_s, "the command was stopped before the save deadline"
    assert waited_s < stop_timeout_s, f"the stop took {waited_s:.1f} s: it waited for --stop-timeout-s"
    assert not alive(worker_pid) and not alive(grandchild_pid)
    assert "SIGKILL" in run.log()


def test_output_into_a_closed_pipe_ends_quietly_with_sigpipes_code(tmp_path):
    """`spotrun ls ROOT | head -0`: the reader is gone before spotrun writes; spotrun exits
    128 + SIGPIPE, as Unix tools do, with no traceback."""
    (tmp_path / "ck" / "step-000000010").mkdir(parents=True)
    (tmp_path / "ck" / "step-000000010" / "rank-00000.i000000000.safetensors").write_bytes(b"x")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before spotrun starts: its first write fails, whatever the timing
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotrun", "ls", str(tmp_path / "ck")], stdout=write_end, stderr=subprocess.PIPE
    )
    os.close(write_end)
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=WAIT_S) == 128 + signal.SIGPIPE, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
