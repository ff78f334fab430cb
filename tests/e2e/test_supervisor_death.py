"""Issue 8, section 1(c): the job dies with its supervisor.

However `spotrun run` dies (SIGKILL, SIGSEGV), its launch command gets SIGTERM from the kernel
(PR_SET_PDEATHSIG), and every worker with a Checkpointer notices that the supervisor is gone
(a pidfd), takes an emergency checkpoint at its next step boundary and exits; a worker that
does neither is killed by its own watch one grace period after the supervisor died. No
process of the job is left running. Processes are checked in /proc, by pid and start time.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from spotrun.supervisor import process
from tests.support import trainrun
from tests.support.fake_launch import FAKE, WAIT_S
from tests.support.trainrun import ls_json, start_supervised, torchrun_command, wait_for_step


def wait_until_gone(infos: list[process.ProcInfo], timeout_s: float) -> list[process.ProcInfo]:
    """Wait until none of ``infos`` runs (a zombie counts as gone); the survivors after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        survivors = [i for i in infos if process.is_alive(i)]
        if not survivors or time.monotonic() > deadline:
            return survivors
        time.sleep(0.05)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture
def no_core_dumps():
    """Processes started meanwhile write no core file (a SIGSEGV would, where the limit allows)."""
    old = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, old)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV], ids=lambda s: s.name)
def test_1c_supervisor_death_sends_its_command_sigterm(spotrun_run, tmp_path, signum, no_core_dumps):
    """The launch command gets SIGTERM from the kernel when spotrun dies, whatever kills it."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    run = spotrun_run(["--checkpoint-uri", str(tmp_path / "ckpt"), "--notice", "none"], sleeper)
    run.wait_until(lambda: "started pid" in run.log(), "the command started")
    [child] = [p for p in process.descendants(run.proc.pid) if p.ppid == run.proc.pid]
    run.proc.send_signal(signum)
    assert run.wait() == -signum
    assert wait_until_gone([child], WAIT_S) == [], "the command outlived its supervisor"


def test_1c_launch_child_exits_at_once_when_its_supervisor_is_already_gone(tmp_path):
    """The race of PR_SET_PDEATHSIG: if the supervisor died between the fork and the prctl, no
    signal would ever come, so the child checks its parent and exits (143) instead of starting.
    Here the child's parent is not the process that prepared the setup: exactly that case."""
    script = (
        "import os, subprocess\n"
        "from spotrun.supervisor.process import die_with_parent\n"
        "setup = die_with_parent()  # prepared by this process, the 'supervisor'\n"
        "pid = os.fork()\n"
        "if pid == 0:  # the forked middle process launches the command: its parent is not the supervisor\n"
        "    child = subprocess.Popen(['sh', '-c', 'touch started'], preexec_fn=setup)\n"
        "    os._exit(child.wait())\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_S, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(process.EXIT_PARENT_GONE)
    assert not (tmp_path / "started").exists(), "the command must not start"


def test_1c_stuck_worker_ends_itself_a_grace_period_after_the_supervisor_dies(spotrun_run, tmp_path, state):
    """A worker that ignores SIGTERM and never reaches a step boundary (as one blocked in a
    collective): its supervisor watch kills it once the grace period after the supervisor's
    death is over."""
    grace_s = 2.0
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), "--notice", "none", "--grace-period-s", str(grace_s)],
        [sys.executable, FAKE / "stuck.py", state],
    )
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    [worker] = [p for p in process.descendants(run.proc.pid) if p.pid == int((state / "ready").read_text())]
    run.proc.kill()
    assert run.wait() == -signal.SIGKILL
    assert wait_until_gone([worker], WAIT_S) == [], "the stuck worker outlived its supervisor"
    log = run.log()  # the worker's stderr is the supervisor's
    assert f"the supervisor (pid {run.proc.pid}) is gone" in log
    assert f"still running {grace_s:.1f} s after the supervisor (pid {run.proc.pid}) died: killing this process" in log


def _start_job(tmp_path, processes):
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    command = torchrun_command(
        trainrun.REFERENCE_STEPS, trainrun.REFERENCE_SAVE_INTERVAL, log_file, "--step-sleep-s", "0.05"
    )
    proc = start_supervised(ck, command, log_path=tmp_path / "first.log")
    processes.append(proc)
    wait_for_step(log_file, 12, proc)
    return ck, log_file, command, proc


def _assert_emergency_then_exact_resume(reference, tmp_path, processes, ck, log_file, command) -> None:
    """An emergency checkpoint (step >= 12) committed, and the same command resumes from it to
    the end, bit-identical to the uninterrupted reference run."""
    emergency = [row for row in ls_json(ck) if row["reason"] == "emergency"]
    assert len(emergency) == 1 and emergency[0]["status"] == "complete" and emergency[0]["step"] >= 12, emergency
    trainrun.restart_resumes_exactly(reference, tmp_path, processes, ck, log_file, command, emergency[0]["step"])


@pytest.mark.slow
def test_1c_sigkill_of_supervisor_stops_the_job(reference, tmp_path, processes):
    """`kill -KILL <spotrun>` during training: torchrun and both ranks stop (the ranks after an
    emergency checkpoint), and the same command resumes from that checkpoint exactly."""
    ck, log_file, command, proc = _start_job(tmp_path, processes)
    job = process.descendants(proc.pid)
    assert any("torch.distributed.run" in cmdline(p.pid) for p in job)
    assert (
        len(
            [
                p
                for p in job
                if "spotrun.examples.train_gpt" in cmdline(p.pid) and "torch.distributed.run" not in cmdline(p.pid)
            ]
        )
        == 2
    )
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert wait_until_gone(job, 120) == [], [cmdline(p.pid) for p in job if process.is_alive(p)]
    _assert_emergency_then_exact_resume(reference, tmp_path, processes, ck, log_file, command)


@pytest.mark.slow
def test_1c_sigkill_of_supervisor_and_torchrun_stops_the_workers(reference, tmp_path, processes):
    """spotrun and torchrun both SIGKILLed, so no signal reaches the ranks: they notice that the
    supervisor is gone, save an emergency checkpoint and exit. torchrun is stopped (SIGSTOP)
    first, so the kernel's SIGTERM on the supervisor's death can never reach it."""
    ck, log_file, command, proc = _start_job(tmp_path, processes)
    job = process.descendants(proc.pid)
    [torchrun] = [p for p in job if p.ppid == proc.pid]
    ranks = [p for p in job if p.ppid == torchrun.pid]
    assert len(ranks) == 2 and all("spotrun.examples.train_gpt" in cmdline(p.pid) for p in ranks)
    os.kill(torchrun.pid, signal.SIGSTOP)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    os.kill(torchrun.pid, signal.SIGKILL)
    assert wait_until_gone(job, 120) == [], [cmdline(p.pid) for p in job if process.is_alive(p)]
    first_log = (tmp_path / "first.log").read_text()
    assert f"the supervisor (pid {proc.pid}) is gone" in first_log
    assert "killing this process" not in first_log, "the ranks should have stopped by themselves"
    _assert_emergency_then_exact_resume(reference, tmp_path, processes, ck, log_file, command)


def test_1c_worker_watches_no_process_that_is_not_its_ancestor(caplog):
    """A $SPOTRUN_SUPERVISOR_PID naming a process outside this one's ancestry (a reused pid,
    another PID namespace, a launcher outside the supervisor's tree) is never watched, so its
    exit can never stop training."""
    from spotrun.train import supervisor_watch

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert supervisor_watch.is_ancestor(os.getppid()) and not supervisor_watch.is_ancestor(other.pid)
        assert supervisor_watch._start(other.pid, grace_period_s=1.0) is None
        assert f"(pid {other.pid}) is not an ancestor of this process" in caplog.text
    finally:
        other.kill()
        other.wait()
