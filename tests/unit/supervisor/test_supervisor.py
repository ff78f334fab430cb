"""`spotrun run`: real supervisor processes around fake launch commands (tests/jobs)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.jobs.fakeckpt import write_step
from tests.support.fake_launch import (
    FAKE,
    FAST,
    GRACE_S,
    MARGIN_S,
    WAIT_S,
    alive,
    sigterm_ignored_until_stopped,
    steps_on,
)


def launches(state: pathlib.Path) -> list[dict]:
    path = state / "launches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_command_that_finishes_exits_0(spotrun_run, tmp_path, state):
    ckpt = tmp_path / "ckpt"
    run = spotrun_run(
        ["--checkpoint-uri", str(ckpt), *FAST], [sys.executable, FAKE / "saver.py", state, "--max-steps", "3"]
    )
    assert run.wait() == 0, run.log()
    assert steps_on(ckpt) == []
    assert not (state / "request.json").exists()


def test_sigterm_requests_a_save_and_exits_143_once_it_committed(spotrun_run, tmp_path, state):
    ckpt = tmp_path / "ckpt"
    run = spotrun_run(["--checkpoint-uri", str(ckpt), *FAST], [sys.executable, FAKE / "saver.py", state])
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    sent_unix_s = time.time()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 143, run.log()

    request = json.loads((state / "request.json").read_text())
    assert request["reason"] == "SIGTERM"
    # deadline = notice time + grace - margin, and the notice came after we sent it
    assert sent_unix_s + GRACE_S - MARGIN_S <= request["deadline_unix_s"]
    assert request["deadline_unix_s"] <= request["requested_unix_s"] + GRACE_S - MARGIN_S
    assert not (state / "got-signal").exists(), "the supervisor must not signal the launch command"
    [saved] = steps_on(ckpt)
    assert (saved.status, saved.reason) == ("complete", "emergency")


def test_worker_that_never_saves_is_stopped_at_the_deadline_with_no_process_left(spotrun_run, tmp_path, state):
    run = spotrun_run(["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST], [sys.executable, FAKE / "ignorer.py", state])
    worker_pid, grandchild_pid, waited_s = sigterm_ignored_until_stopped(run, state)

    assert (state / "request-seen").exists(), "the save request never reached the worker"
    assert waited_s >= GRACE_S - MARGIN_S, "the command was stopped before the save deadline"
    # both ignore SIGTERM and the grandchild is in another session: only a SIGKILL to each works
    assert not alive(worker_pid)
    assert not alive(grandchild_pid)
    assert "SIGKILL" in run.log()


def test_processes_left_behind_by_a_finished_command_are_stopped(spotrun_run, tmp_path, state):
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST],
        [sys.executable, FAKE / "ignorer.py", state, "--exit-after-spawn"],
    )
    assert run.wait() == 0, run.log()
    _worker_pid, grandchild_pid = map(int, (state / "pids").read_text().split())
    assert not alive(grandchild_pid)


def test_processes_left_behind_by_a_failed_command_are_killed_without_a_save_request(spotrun_run, tmp_path, state):
    """A launcher that crashed (torchrun SIGKILLed) leaves its workers behind: they are SIGKILLed
    at once, not sent a SIGTERM, on which a worker takes an emergency checkpoint that the
    supervisor would read as a preemption (exit 143) instead of restarting (issue 23)."""
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST, "--max-restarts", "0"],
        [sys.executable, FAKE / "ignorer.py", state, "--fail-after-spawn"],
    )
    assert run.wait() == 1, run.log()
    _worker_pid, grandchild_pid = map(int, (state / "pids").read_text().split())
    assert not alive(grandchild_pid)
    assert "the command failed and left 1 process(es) running: killing them" in run.log()
    assert "sent SIGTERM" not in run.log()


def test_second_notice_is_ignored_and_the_save_still_counts(spotrun_run, tmp_path, state):
    ckpt = tmp_path / "ckpt"
    run = spotrun_run(["--checkpoint-uri", str(ckpt), *FAST], [sys.executable, FAKE / "saver.py", state])
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    run.proc.send_signal(signal.SIGINT)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 143, run.log()
    assert json.loads((state / "request.json").read_text())["reason"] in ("SIGINT", "SIGTERM")
    assert "ignoring another notice" in run.log()
    assert [s.status for s in steps_on(ckpt)] == ["complete"]


def test_commit_report_without_a_complete_checkpoint_exits_142(spotrun_run, tmp_path, state):
    ckpt = tmp_path / "ckpt"
    run = spotrun_run(
        ["--checkpoint-uri", str(ckpt), *FAST], [sys.executable, FAKE / "saver.py", state, "--no-manifest"]
    )
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 142, run.log()
    assert [s.status for s in steps_on(ckpt)] == ["incomplete"]


def test_notice_then_exit_0_without_a_save_means_training_finished(spotrun_run, tmp_path, state):
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST],
        [sys.executable, FAKE / "saver.py", state, "--exit-without-saving"],
    )
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()
    assert (state / "request.json").exists()


def test_workers_stopped_without_a_save_by_another_node_exit_142(spotrun_run, tmp_path, state):
    """No notice on this node, but its workers stopped without saving because another node's
    supervisor found no time for a save: preempted, not finished; the resume point is named."""
    ckpt = tmp_path / "ckpt"
    write_step(str(ckpt), 7, commit=True)
    run = spotrun_run(
        ["--checkpoint-uri", str(ckpt), *FAST],
        [sys.executable, FAKE / "saver.py", state, "--stopped-without-save-at", "12"],
    )
    assert run.wait() == 142, run.log()
    assert "the workers stopped after step 12 without saving" in run.log()
    assert "the newest complete checkpoint is step 7" in run.log()


@pytest.mark.parametrize(
    ("worker_options", "notice"),
    [
        (["--fenced-at", "3", "--fenced-exit-code", "1"], False),  # the FencedError ended the script
        (["--fenced-at", "3", "--fenced-exit-code", "0"], False),  # a script that caught it: not "finished"
        (["--fenced-at", "3", "--fenced-exit-code", "137"], False),  # killed after reporting: not a crash
        (["--fenced-on-request", "--fenced-exit-code", "1"], True),  # the emergency save was fenced: not 142
        (["--fenced-on-request", "--fenced-exit-code", "0"], True),  # nor 0 after a notice
    ],
    ids=["exit-1", "exit-0", "exit-137", "notice-exit-1", "notice-exit-0"],
)
def test_fenced_workers_are_never_restarted_and_exit_86_naming_the_newer_incarnation(
    spotrun_run, tmp_path, state, worker_options, notice
):
    """C20: whatever the command's exit code, and during a notice too, a launch whose workers
    report a fence (a newer start of the job owns the root) ends spotrun with exit 86 and a
    line naming the newer incarnation, though restarts are left."""
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST, "--max-restarts", "2", "--restart-backoff-s", "0"],
        [sys.executable, FAKE / "saver.py", state, *worker_options],
    )
    if notice:
        run.wait_until(lambda: (state / "ready").exists(), "the worker started")
        run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 86, run.log()
    assert len((state / "launches").read_text().splitlines()) == 1, run.log()
    assert (
        "was fenced: incarnation 7 (host other-host, pid 1234, spotrun run pid 99) of this job started "
        "on the same checkpoint root"
    ) in run.log()
    assert "exiting 86" in run.log() and "restart 1 of 2" not in run.log()


def test_signals_blocked_by_the_parent_are_unblocked(tmp_path, state):
    """A parent that blocked SIGCHLD and SIGTERM (the mask is inherited): the supervisor still
    sees its command exit, and still takes SIGTERM as a notice."""
    blocked = {signal.SIGCHLD, signal.SIGTERM}
    ckpt = str(tmp_path / "ckpt")
    finished = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--checkpoint-uri",
            ckpt,
            *FAST,
            "--",
            sys.executable,
            FAKE / "saver.py",
            state,
            "--max-steps",
            "3",
        ],
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, blocked),
        timeout=WAIT_S,
        capture_output=True,
        text=True,
    )
    assert finished.returncode == 0, finished.stderr
    state = tmp_path / "second"
    state.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--checkpoint-uri",
            ckpt,
            *FAST,
            "--",
            sys.executable,
            FAKE / "saver.py",
            state,
        ],
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, blocked),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while not (state / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 143, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_failing_command_passes_its_exit_code_through(spotrun_run, tmp_path, state):
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST], [sys.executable, FAKE / "flaky.py", state, 99, 3]
    )
    assert run.wait() == 3, run.log()
    assert len(launches(state)) == 1


def test_command_killed_by_a_signal_exits_128_plus_the_signal(spotrun_run, tmp_path):
    kill_self = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    run = spotrun_run(["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST], [sys.executable, "-c", kill_self])
    assert run.wait() == 128 + signal.SIGKILL, run.log()


def test_crash_restarts_with_growing_backoff_then_success(spotrun_run, tmp_path, state):
    backoff_s = 0.2
    run = spotrun_run(
        [
            "--checkpoint-uri",
            str(tmp_path / "ckpt"),
            *FAST,
            "--max-restarts",
            "3",
            "--restart-backoff-s",
            str(backoff_s),
        ],
        [sys.executable, FAKE / "flaky.py", state, 2, 3],
    )
    assert run.wait() == 0, run.log()
    runs = launches(state)
    assert [r["incarnation"] for r in runs] == ["0", "1", "2"]
    assert len({r["run_id"] for r in runs}) == 1
    gaps_s = [b["time_unix_s"] - a["time_unix_s"] for a, b in zip(runs, runs[1:])]
    assert gaps_s[0] >= backoff_s and gaps_s[1] >= 2 * backoff_s


def test_restarts_run_out_and_the_exit_code_is_passed_through(spotrun_run, tmp_path, state):
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST, "--max-restarts", "1", "--restart-backoff-s", "0"],
        [sys.executable, FAKE / "flaky.py", state, 99, 5],
    )
    assert run.wait() == 5, run.log()
    assert len(launches(state)) == 2


def test_notice_during_restart_backoff_exits_142_at_once(spotrun_run, tmp_path, state):
    backoff_s = 60.0
    run = spotrun_run(
        [
            "--checkpoint-uri",
            str(tmp_path / "ckpt"),
            *FAST,
            "--max-restarts",
            "1",
            "--restart-backoff-s",
            str(backoff_s),
        ],
        [sys.executable, FAKE / "flaky.py", state, 99, 3],
    )
    run.wait_until(lambda: "restart 1 of 1" in run.log(), "the restart backoff began")
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 142, run.log()
    assert time.monotonic() - sent < backoff_s, "the notice did not end the backoff wait"
    assert len(launches(state)) == 1


def test_environment_names_the_newest_complete_step(spotrun_run, tmp_path):
    ckpt = tmp_path / "ckpts"
    write_step(str(ckpt), 5, run_id="run-abc", incarnation=1)
    write_step(str(ckpt), 10, run_id="run-abc", incarnation=2)
    write_step(str(ckpt), 15, corrupt=True, run_id="run-abc", incarnation=3)
    write_step(str(ckpt), 20, commit=False)
    out = tmp_path / "env.json"
    run = spotrun_run(["--checkpoint-uri", "ckpts", *FAST], [sys.executable, FAKE / "print_env.py", out], cwd=tmp_path)
    assert run.wait() == 0, run.log()

    seen = json.loads(out.read_text())
    env = seen["env"]
    assert env["SPOTRUN_RESUME_STEP"] == "10"
    assert env["SPOTRUN_INCARNATION"] == "3"
    assert env["SPOTRUN_RUN_ID"] == "run-abc"
    assert env["SPOTRUN_CHECKPOINT_URI"] == str(ckpt)  # absolute, although given relative
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "3"
    assert seen["control_dir_exists"]
    assert not os.path.exists(env["SPOTRUN_CONTROL_DIR"]), "the control dir must be removed at exit"
    log = run.log()
    assert "ignoring incomplete step 20" in log and "ignoring corrupt step 15" in log


def test_environment_names_the_newest_complete_step_on_s3(spotrun_run, tmp_path, s3_bucket):
    uri = f"{s3_bucket.uri}/job"
    write_step(uri, 30, run_id="run-s3", incarnation=4)
    write_step(uri, 40, commit=False)
    out = tmp_path / "env.json"
    run = spotrun_run(["--checkpoint-uri", uri, *FAST], [sys.executable, FAKE / "print_env.py", out])
    assert run.wait() == 0, run.log()

    env = json.loads(out.read_text())["env"]
    assert env["SPOTRUN_CHECKPOINT_URI"] == uri
    assert (env["SPOTRUN_RESUME_STEP"], env["SPOTRUN_INCARNATION"], env["SPOTRUN_RUN_ID"]) == ("30", "5", "run-s3")


def test_environment_of_a_fresh_start(spotrun_run, tmp_path):
    out = tmp_path / "env.json"
    parent_env = {**os.environ, "SPOTRUN_RESUME_STEP": "99", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "empty"), *FAST],
        [sys.executable, FAKE / "print_env.py", out],
        env=parent_env,
    )
    assert run.wait() == 0, run.log()

    env = json.loads(out.read_text())["env"]
    assert "SPOTRUN_RESUME_STEP" not in env, "a stale resume step must not reach the workers"
    assert env["SPOTRUN_INCARNATION"] == "0"
    assert len(env["SPOTRUN_RUN_ID"]) == 32 and int(env["SPOTRUN_RUN_ID"], 16) >= 0
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "7", "the user's own setting wins"
    assert "fresh start" in run.log()


@pytest.mark.parametrize(
    "options",
    [
        ["--grace-period-s", "3", "--safety-margin-s", "5"],
        ["--checkpoint-uri", "ftp://host/dir"],
        ["--max-restarts", "-1"],
    ],
)
def test_bad_options_give_one_error_line_and_exit_2(tmp_path, options):
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "run", *options, "--", sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("spotrun: error: ")
    assert "Traceback" not in done.stderr


def test_missing_command_is_a_clear_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "run", "--", str(tmp_path / "no-such-program")],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "spotrun: error: cannot start" in done.stderr and "Traceback" not in done.stderr
