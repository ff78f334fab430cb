"""How a notice reaches a launch's workers: the request file for a job that announced
spotrun's protocol, a signal to the worker processes for one that saves by itself."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from spotrun import listeners
from spotrun.supervisor.foreign import Delivery, NoticeDelivery, choose_delivery, oldest_age_s, worker_processes


@pytest.mark.parametrize(
    ("kinds", "forced", "age_s", "expected"),
    [
        (["checkpointer"], False, 100.0, Delivery.REQUEST_FILE),
        (["checkpointer", "poll"], False, 100.0, Delivery.REQUEST_FILE),
        (["poll"], False, 100.0, Delivery.POLL),
        ([], False, 100.0, Delivery.SIGNAL),  # silent and old enough: foreign
        ([], False, 10.0, Delivery.SIGNAL),  # exactly the timeout
        ([], False, 3.0, Delivery.UNDECIDED),  # silent but may still be starting
        ([], False, None, Delivery.UNDECIDED),  # torchrun has not started its workers yet
        (["checkpointer"], True, 100.0, Delivery.SIGNAL),  # --notify-signal: always
        ([], True, None, Delivery.SIGNAL),
    ],
)
def test_choose_delivery_table(kinds, forced, age_s, expected):
    choice = choose_delivery(kinds, signal_forced=forced, oldest_worker_age_s=age_s, announce_timeout_s=10.0)
    assert choice.delivery is expected
    assert choice.foreign == (expected in (Delivery.POLL, Delivery.SIGNAL))
    if expected is Delivery.UNDECIDED:
        assert choice.recheck_in_s == pytest.approx(10.0 - (age_s or 0.0))
    else:
        assert choice.recheck_in_s is None


def _sleeper_tree() -> subprocess.Popen:
    """A launcher (like torchrun) with two worker children that log the signal they get."""
    # One os.write per line: the two workers share the pipe, and a line must not be split.
    code = (
        "import subprocess, sys\n"
        "worker = 'import os, signal, sys, time\\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: (os.write(1, b\"got %d\\\\n\" % s), sys.exit(0)))\\n"
        "os.write(1, b\"ready\\\\n\")\\n"
        "time.sleep(60)\\n'\n"
        "children = [subprocess.Popen([sys.executable, '-c', worker]) for _ in range(2)]\n"
        "sys.exit(max(c.wait() for c in children))\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_silent_job_gets_the_notify_signal_on_its_workers_not_its_launcher(tmp_path):
    launcher = _sleeper_tree()
    try:
        assert launcher.stdout.readline() == "ready\n" and launcher.stdout.readline() == "ready\n"
        workers = worker_processes(launcher.pid, torchrun=True)
        assert len(workers) == 2 and all(info.ppid == launcher.pid for info in workers)
        assert oldest_age_s(workers) >= 0.0
        delivery = NoticeDelivery(str(tmp_path), launcher.pid, torchrun=True, notify_signal=signal.SIGUSR1,
                                  forced=False, announce_timeout_s=0.0)
        assert delivery.deliver() is None and delivery.choice.delivery is Delivery.SIGNAL
        assert launcher.wait(timeout=30) == 0  # the launcher was not signalled: its workers exited 0
        assert sorted(launcher.stdout.read().split()) == ["10", "10", "got", "got"]
    finally:
        launcher.kill()
        launcher.wait()


def test_a_job_that_announced_itself_gets_no_signal(tmp_path, monkeypatch):
    launcher = _sleeper_tree()
    try:
        assert launcher.stdout.readline() == "ready\n" and launcher.stdout.readline() == "ready\n"
        monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(tmp_path))
        listeners.announce("checkpointer")
        delivery = NoticeDelivery(str(tmp_path), launcher.pid, torchrun=True, notify_signal=signal.SIGUSR1,
                                  forced=False, announce_timeout_s=0.0)
        assert delivery.deliver() is None and delivery.choice.delivery is Delivery.REQUEST_FILE
        time.sleep(0.5)
        assert launcher.poll() is None and delivery.signalled == []
    finally:
        launcher.kill()
        launcher.wait()


def test_a_young_silent_job_is_undecided_until_it_announces(tmp_path, monkeypatch):
    launcher = _sleeper_tree()
    try:
        assert launcher.stdout.readline() == "ready\n" and launcher.stdout.readline() == "ready\n"
        delivery = NoticeDelivery(str(tmp_path), launcher.pid, torchrun=True, notify_signal=signal.SIGUSR1,
                                  forced=False, announce_timeout_s=3600.0)
        recheck_unix_s = delivery.deliver()
        assert recheck_unix_s is not None and recheck_unix_s > time.time() + 3000
        monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(tmp_path))
        listeners.announce("checkpointer")  # it was still starting
        assert delivery.deliver() is None and delivery.choice.delivery is Delivery.REQUEST_FILE
        assert launcher.poll() is None
    finally:
        launcher.kill()
        launcher.wait()
