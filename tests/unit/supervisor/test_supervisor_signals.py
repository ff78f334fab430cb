"""Issue 8, section 2: no signal to `spotrun run` ends it and leaves its job unsupervised.

SIGUSR1 and SIGUSR2 (SLURM's `--signal=USR1@90`, submitit) are notices by default, like
SIGTERM/SIGINT/SIGHUP; `--notice-signals` (or `notice_signals` in a config file) chooses the
set; every other signal whose default action would end the supervisor is logged and ignored.
Fault signals (SIGSEGV, ...) and SIGKILL end it: tests/e2e/test_supervisor_death.py.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys

import pytest

from spotrun.notices.signals import parse_notice_signals, signal_name, terminating_signals
from tests.support import trainrun
from tests.support.fake_launch import FAKE, FAST, WAIT_S, steps_on
from tests.support.trainrun import ls_json, start_supervised, torchrun_command, wait_for_step

PREEMPTED = 143


def request_reason(state) -> str:
    return json.loads((state / "request.json").read_text())["reason"]


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGUSR2], ids=lambda s: s.name)
def test_2_usr1_and_usr2_are_notices_by_default(spotrun_run, tmp_path, state, signum):
    ckpt = tmp_path / "ckpt"
    run = spotrun_run(["--checkpoint-uri", str(ckpt), *FAST], [sys.executable, FAKE / "saver.py", state])
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    run.proc.send_signal(signum)
    assert run.wait() == PREEMPTED, run.log()
    assert request_reason(state) == signum.name
    [saved] = steps_on(ckpt)
    assert (saved.status, saved.reason) == ("complete", "emergency")


def test_2_other_terminating_signals_leave_the_supervisor_running(spotrun_run, tmp_path, state):
    """Every signal whose default action would end spotrun and that is not a notice (SIGALRM,
    SIGPIPE, SIGQUIT, SIGPWR, SIGXCPU, every real-time signal, ...): logged once, ignored; the
    job goes on, and a later SIGTERM still takes the emergency checkpoint."""
    ckpt = tmp_path / "ckpt"
    run = spotrun_run(["--checkpoint-uri", str(ckpt), *FAST], [sys.executable, FAKE / "saver.py", state])
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    others = sorted(terminating_signals() - parse_notice_signals("TERM,INT,HUP,USR1,USR2"))
    assert {signal.SIGALRM, signal.SIGPIPE, signal.SIGRTMIN + 3} <= set(others)
    for signum in others:
        run.proc.send_signal(signum)
    for signum in others:
        run.wait_until(
            lambda: f"ignoring {signal_name(signum)}: not a notice signal" in run.log(), f"{signal_name(signum)} logged"
        )
    run.proc.send_signal(signal.SIGALRM)  # again: not logged a second time
    assert run.proc.poll() is None, run.log()
    assert not (state / "request.json").exists(), "an ignored signal must not ask for a save"

    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == PREEMPTED, run.log()
    assert request_reason(state) == "SIGTERM"
    assert run.log().count("ignoring SIGALRM") == 1
    assert [s.status for s in steps_on(ckpt)] == ["complete"]


def test_2_notice_signals_option_chooses_the_notices(spotrun_run, tmp_path, state):
    """`--notice-signals TERM,RTMIN+2`: SIGUSR1 is then only logged; SIGRTMIN+2 is a notice."""
    ckpt = tmp_path / "ckpt"
    run = spotrun_run(
        ["--checkpoint-uri", str(ckpt), *FAST, "--notice-signals", "TERM,RTMIN+2"],
        [sys.executable, FAKE / "saver.py", state],
    )
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    run.proc.send_signal(signal.SIGUSR1)
    run.wait_until(lambda: "ignoring SIGUSR1: not a notice signal" in run.log(), "SIGUSR1 logged")
    assert not (state / "request.json").exists()
    run.proc.send_signal(signal.SIGRTMIN + 2)
    assert run.wait() == PREEMPTED, run.log()
    assert request_reason(state) == "SIGRTMIN+2"


def test_2_notice_signals_config_key(spotrun_run, tmp_path, state):
    """`notice_signals: [TERM, INT]` in the config file: SIGUSR2 is then only logged."""
    config = tmp_path / "spotrun.yaml"
    config.write_text("notice_signals: [TERM, INT]\n")
    run = spotrun_run(
        ["--config", str(config), "--checkpoint-uri", str(tmp_path / "ckpt"), *FAST],
        [sys.executable, FAKE / "saver.py", state],
    )
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    run.proc.send_signal(signal.SIGUSR2)
    run.wait_until(lambda: "ignoring SIGUSR2: not a notice signal" in run.log(), "SIGUSR2 logged")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == PREEMPTED, run.log()
    assert request_reason(state) == "SIGINT"


@pytest.mark.parametrize("value", ["KILL", "SEGV", "CHLD", "TERM,NOPE", "RTMIN+99", ""])
def test_2_bad_notice_signals_are_one_error_line_and_exit_2(tmp_path, value):
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "run", "--notice-signals", value, "--", sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("spotrun: error: --notice-signals") and "Traceback" not in done.stderr


@pytest.mark.slow
def test_2_usr1_to_supervisor_is_a_notice(reference, tmp_path, processes):
    """A real 2-rank torchrun job: `kill -USR1 <spotrun>` (SLURM's warning before the time limit)
    -> emergency checkpoint, exit 143; the same command then resumes and finishes bit-exactly."""
    step = random.Random().randint(3, trainrun.REFERENCE_STEPS - 4)
    print(f"SIGUSR1 at step {step}")
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    command = torchrun_command(
        trainrun.REFERENCE_STEPS, trainrun.REFERENCE_SAVE_INTERVAL, log_file, "--step-sleep-s", "0.05"
    )
    proc = start_supervised(ck, command, log_path=tmp_path / "first.log")
    processes.append(proc)
    wait_for_step(log_file, step, proc)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=600) == PREEMPTED, (tmp_path / "first.log").read_text()[-3000:]
    emergency = [row for row in ls_json(ck) if row["reason"] == "emergency"]
    assert len(emergency) == 1 and emergency[0]["status"] == "complete" and emergency[0]["step"] >= step
    output = (tmp_path / "first.log").read_text()
    assert "preemption notice: SIGUSR1" in output
    # The Checkpointer announced itself: the notice reached the ranks as the request file, no signal.
    assert "the workers run a spotrun Checkpointer: no signal sent" in output
    assert "save requested (supervisor: SIGUSR1)" in output and "save requested (SIG" not in output

    trainrun.restart_resumes_exactly(reference, tmp_path, processes, ck, log_file, command, emergency[0]["step"])
