"""How a notice reaches a launch's workers: the request file for a job that announced
spotrun's protocol, a signal to the worker processes for one that saves by itself."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from spotrun.control import listeners
from spotrun.supervisor import process
from spotrun.supervisor.foreign import (
    ANNOUNCE_WAIT_SHARE,
    Delivery,
    NoticeDelivery,
    choose_delivery,
    elastic_workers,
    oldest_age_s,
    worker_processes,
)


@pytest.mark.parametrize(
    ("kinds", "forced", "age_s", "decide_in_s", "expected"),
    [
        (["checkpointer"], False, 100.0, None, Delivery.REQUEST_FILE),
        (["checkpointer", "poll"], False, 100.0, None, Delivery.REQUEST_FILE),
        (["poll"], False, 100.0, None, Delivery.POLL),
        ([], False, 100.0, None, Delivery.SIGNAL),  # silent and old enough: foreign
        ([], False, 10.0, None, Delivery.SIGNAL),  # exactly the timeout
        ([], False, 3.0, None, Delivery.UNDECIDED),  # silent but may still be starting
        ([], False, None, None, Delivery.UNDECIDED),  # torchrun has not started its workers yet
        ([], False, 3.0, 2.0, Delivery.UNDECIDED),  # the notice may wait 2 s more: recheck then
        ([], False, 3.0, 0.0, Delivery.SIGNAL),  # the notice cannot wait longer: foreign
        ([], False, None, -1.0, Delivery.SIGNAL),
        (["checkpointer"], True, 100.0, None, Delivery.REQUEST_FILE),  # --notify-signal never kills a Checkpointer
        (["poll"], True, 100.0, None, Delivery.SIGNAL),  # --notify-signal: every other job
        ([], True, None, None, Delivery.SIGNAL),  # at once, however young
    ],
)
def test_choose_delivery_table(kinds, forced, age_s, decide_in_s, expected):
    choice = choose_delivery(
        kinds, signal_forced=forced, oldest_worker_age_s=age_s, announce_timeout_s=10.0, decide_in_s=decide_in_s
    )
    assert choice.delivery is expected
    assert choice.foreign == (expected in (Delivery.POLL, Delivery.SIGNAL))
    if expected is Delivery.UNDECIDED:
        assert choice.recheck_in_s == pytest.approx(min(10.0 - (age_s or 0.0), decide_in_s or float("inf")))
    else:
        assert choice.recheck_in_s is None


#: A launcher like torchrun (a script named ``torchrun``, as the console script runs) with two
#: worker children that log the signal they get. One os.write per line: the workers share the
#: pipe, and a line must not be split.
FAKE_TORCHRUN = (
    "import subprocess, sys\n"
    "worker = 'import os, signal, sys, time\\n"
    'signal.signal(signal.SIGUSR1, lambda s, f: (os.write(1, b"got %d\\\\n" % s), sys.exit(0)))\\n'
    'os.write(1, b"ready\\\\n")\\n'
    "time.sleep(60)\\n'\n"
    "children = [subprocess.Popen([sys.executable, '-c', worker]) for _ in range(2)]\n"
    "sys.exit(max(c.wait() for c in children))\n"
)


def _launcher(tmp_path, wrapper: list[str] | None = None) -> subprocess.Popen:
    """The fake torchrun, started directly or through ``wrapper`` (a shell command prefix)."""
    script = tmp_path / "bin" / "torchrun"
    script.parent.mkdir(exist_ok=True)
    script.write_text(FAKE_TORCHRUN)
    command = [sys.executable, str(script)]
    if wrapper is not None:
        command = [*wrapper[:-1], f"{wrapper[-1]} {shlex.join(command)}"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline() == "ready\n" and launcher.stdout.readline() == "ready\n"
    return launcher


def test_a_silent_job_gets_the_notify_signal_on_its_workers_not_its_launcher(tmp_path):
    launcher = _launcher(tmp_path)
    try:
        workers = worker_processes(launcher.pid)
        assert len(workers) == 2 and all(info.ppid == launcher.pid for info in workers)
        assert oldest_age_s(workers) >= 0.0
        delivery = NoticeDelivery(
            str(tmp_path), launcher.pid, notify_signal=signal.SIGUSR1, forced=False, announce_timeout_s=0.0
        )
        assert delivery.deliver(time.time() + 20) is None and delivery.choice.delivery is Delivery.SIGNAL
        assert launcher.wait(timeout=30) == 0  # the launcher was not signalled: its workers exited 0
        assert sorted(launcher.stdout.read().split()) == ["10", "10", "got", "got"]
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize("wrapper", [["sh", "-c", "exec"], ["sh", "-c", "true;"]], ids=["exec", "child"])
def test_torchrun_behind_a_shell_wrapper_is_found_and_not_signalled(tmp_path, wrapper):
    """``sh -c "exec torchrun ..."`` becomes torchrun; ``sh -c "...; torchrun ..."`` runs it as a
    child: either way the signal goes to torchrun's children, never to torchrun or the shell.
    (These children carry no elastic agent's environment: torchrun is known by its command line.)"""
    launcher = _launcher(tmp_path, wrapper)
    try:
        workers = worker_processes(launcher.pid)
        assert len(workers) == 2 and all(info.pid != launcher.pid for info in workers)
        delivery = NoticeDelivery(
            str(tmp_path), launcher.pid, notify_signal=signal.SIGUSR1, forced=True, announce_timeout_s=10.0
        )
        assert delivery.deliver(time.time() + 20) is None and len(delivery.signalled) == 2
        assert launcher.wait(timeout=30) == 0  # torchrun (and the shell) were not signalled
        assert sorted(launcher.stdout.read().split()) == ["10", "10", "got", "got"]
    finally:
        launcher.kill()
        launcher.wait()


def test_a_plain_command_is_signalled_itself(tmp_path):
    command = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert command.stdout.readline() == "ready\n"
        assert [info.pid for info in worker_processes(command.pid)] == [command.pid]
    finally:
        command.kill()
        command.wait()


#: A launcher built on torch's elastic agent but not named torchrun (as ``accelerate launch``
#: runs the agent in its own process): it starts two ranks with the variables the agent sets
#: for its workers. Each rank forks a loader (a DataLoader worker: same environment) before it
#: says it is ready; a rank told by SIGUSR1 ends its loader and exits 0, a loader told by it
#: says so and exits 1. One os.write per line: they all share the pipe.
FAKE_ELASTIC_LAUNCHER = """\
import os, subprocess, sys
worker = os.path.join(os.path.dirname(__file__), "rank.py")
ranks = [subprocess.Popen([sys.executable, worker], env={
    **os.environ, "TORCHELASTIC_RUN_ID": "inner", "TORCHELASTIC_RESTART_COUNT": "0", "LOCAL_RANK": str(rank),
    "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}) for rank in range(2)]
sys.exit(max(rank.wait() for rank in ranks))
"""
FAKE_RANK = """\
import os, signal, sys, time
loader = os.fork()
if loader == 0:
    signal.signal(signal.SIGUSR1, lambda s, f: (os.write(1, b"loader-got %d\\n" % s), os._exit(1)))
    os.write(1, b"ready loader %d\\n" % os.getpid())
    time.sleep(60)
    os._exit(0)
def on_signal(signum, frame):
    os.write(1, b"rank-got %d\\n" % signum)
    os.kill(loader, signal.SIGKILL)
    os.waitpid(loader, 0)
    sys.exit(0)
signal.signal(signal.SIGUSR1, on_signal)
os.write(1, b"ready rank %d\\n" % os.getpid())
time.sleep(60)
"""
#: Another agent's worker environment: spotrun itself run inside an elastic worker.
OUTER_WORKER_ENV = {
    "TORCHELASTIC_RUN_ID": "outer",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "LOCAL_RANK": "0",
    "RANK": "0",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}


@pytest.mark.parametrize(
    ("wrapper", "supervisor_env", "launcher_env"),
    [
        ([], {}, {}),
        (["sh", "-c", "true;"], {}, {}),  # behind a shell that stays its parent
        ([], {}, {"LOCAL_RANK": "0"}),  # a batch script exported LOCAL_RANK for the launcher
        (["sh", "-c", "true;"], OUTER_WORKER_ENV, {}),  # the whole tree inside another agent's worker
    ],
    ids=["launcher", "behind-sh", "launcher-with-LOCAL_RANK", "inside-an-outer-elastic-worker"],
)
def test_the_ranks_of_any_elastic_launcher_are_signalled_not_it_nor_their_loaders(
    tmp_path, monkeypatch, wrapper, supervisor_env, launcher_env
):
    """C19: the workers are found by the environment torch's elastic agent gives them, not by
    the launcher's name: each rank gets the notify signal; the launcher, a wrapper and the
    loaders each rank forked (same environment as their rank) do not."""
    for name, value in supervisor_env.items():  # the supervisor (this process) runs with it
        monkeypatch.setenv(name, value)
    (tmp_path / "launch.py").write_text(FAKE_ELASTIC_LAUNCHER)
    (tmp_path / "rank.py").write_text(FAKE_RANK)
    command = [sys.executable, str(tmp_path / "launch.py")]
    if wrapper:
        command = [*wrapper[:-1], f"{wrapper[-1]} {shlex.join(command)}"]
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, **launcher_env}
    )
    try:
        ready = [launcher.stdout.readline().split() for _ in range(4)]
        ranks = sorted(int(pid) for _, role, pid in ready if role == "rank")
        loaders = sorted(int(pid) for _, role, pid in ready if role == "loader")
        assert len(ranks) == 2 and len(loaders) == 2, ready
        assert sorted(info.pid for info in worker_processes(launcher.pid)) == ranks
        delivery = NoticeDelivery(
            str(tmp_path), launcher.pid, notify_signal=signal.SIGUSR1, forced=True, announce_timeout_s=10.0
        )
        assert delivery.deliver(time.time() + 20) is None
        assert sorted(info.pid for info in delivery.signalled) == ranks
        assert launcher.wait(timeout=30) == 0  # neither the launcher nor a wrapper was signalled
        assert sorted(launcher.stdout.read().split()) == ["10", "10", "rank-got", "rank-got"]  # no loader-got
    finally:
        with contextlib.suppress(ProcessLookupError):  # (the group is gone when the test passed)
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_a_process_that_is_gone_is_no_worker_and_no_error():
    """A process that exits while the tree is read has no environment to read: it is skipped."""
    gone = subprocess.Popen(
        [sys.executable, "-c", "print('up', flush=True); import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **OUTER_WORKER_ENV},
    )
    # Until its exec has finished (Popen may return before: vfork), /proc shows no environment.
    assert gone.stdout.readline() == b"up\n"
    info = process.proc_info(gone.pid)
    assert info is not None and process.environ(gone.pid)["TORCHELASTIC_RUN_ID"] == "outer"
    assert [worker.pid for worker in elastic_workers([info])] == [gone.pid]
    gone.communicate(b"", timeout=30)
    assert process.environ(gone.pid) is None
    assert elastic_workers([info]) == []


def test_a_job_that_announced_itself_gets_no_signal(tmp_path, monkeypatch):
    launcher = _launcher(tmp_path)
    try:
        monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(tmp_path))
        listeners.announce("checkpointer")
        for forced in (False, True):  # --notify-signal does not change it: the signal would kill it
            delivery = NoticeDelivery(
                str(tmp_path), launcher.pid, notify_signal=signal.SIGUSR1, forced=forced, announce_timeout_s=0.0
            )
            assert delivery.deliver(time.time() + 20) is None and delivery.choice.delivery is Delivery.REQUEST_FILE
        time.sleep(0.5)
        assert launcher.poll() is None and delivery.signalled == []
    finally:
        launcher.kill()
        launcher.wait()


def test_a_young_silent_job_is_undecided_until_it_announces(tmp_path, monkeypatch):
    launcher = _launcher(tmp_path)
    try:
        delivery = NoticeDelivery(
            str(tmp_path), launcher.pid, notify_signal=signal.SIGUSR1, forced=False, announce_timeout_s=3600.0
        )
        recheck_unix_s = delivery.deliver(time.time() + 1e5)
        assert recheck_unix_s is not None and recheck_unix_s > time.time() + 3000
        monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(tmp_path))
        listeners.announce("checkpointer")  # it was still starting
        assert delivery.deliver(time.time() + 1e5) is None and delivery.choice.delivery is Delivery.REQUEST_FILE
        assert launcher.poll() is None
    finally:
        launcher.kill()
        launcher.wait()


def test_a_notice_waits_for_an_announcement_at_most_a_share_of_the_time_left(tmp_path):
    """A notice early in a launch (workers young, silent) must not use up the job's time to
    save: the wait for an announcement ends after ANNOUNCE_WAIT_SHARE of the time left, then
    the workers get the signal, however young."""
    launcher = _launcher(tmp_path)
    try:
        delivery = NoticeDelivery(
            str(tmp_path), launcher.pid, notify_signal=signal.SIGUSR1, forced=False, announce_timeout_s=3600.0
        )
        notice_unix_s = time.time()
        recheck_unix_s = delivery.deliver(notice_unix_s + 8.0)
        assert recheck_unix_s == pytest.approx(notice_unix_s + ANNOUNCE_WAIT_SHARE * 8.0, abs=0.5)
        assert delivery.choice is None and delivery.signalled == []
        time.sleep(max(0.0, recheck_unix_s - time.time()))
        assert delivery.deliver(notice_unix_s + 8.0) is None and delivery.choice.delivery is Delivery.SIGNAL
        assert launcher.wait(timeout=30) == 0
        assert sorted(launcher.stdout.read().split()) == ["10", "10", "got", "got"]
    finally:
        launcher.kill()
        launcher.wait()
