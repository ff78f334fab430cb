"""Issue 13, item 3: spotrun.preemption_notice() and its callback form, for scripts that save by themselves."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

import spotrun
from spotrun.control import files as control
from spotrun.control.listeners import read_listeners

WAIT_S = 10.0


@pytest.fixture
def control_dir(tmp_path):
    path = tmp_path / "control"
    path.mkdir()
    return path


@pytest.fixture
def env(control_dir):
    return {"SPOTRUN_CONTROL_DIR": str(control_dir)}


def request(control_dir, *, deadline_unix_s=2_000_000_000.0, save=True, reason="SIGTERM"):
    control.write_save_request(
        str(control_dir),
        control.SaveRequest(
            reason=reason, requested_unix_s=1_900_000_000.0, deadline_unix_s=deadline_unix_s, save=save
        ),
    )


def test_no_notice_outside_spotrun_run():
    assert spotrun.preemption_notice(env={}) is None


def test_no_notice_until_the_supervisor_writes_one_and_then_every_call_sees_it(control_dir, env):
    assert spotrun.preemption_notice(env=env) is None
    request(control_dir)
    expected = spotrun.PreemptionNotice(
        reason="SIGTERM", deadline_unix_s=2_000_000_000.0, requested_unix_s=1_900_000_000.0, save=True
    )
    assert spotrun.preemption_notice(env=env) == expected
    assert spotrun.preemption_notice(env=env) == expected


def test_first_call_announces_a_poll_listener(control_dir, env):
    spotrun.preemption_notice(env=env)
    spotrun.preemption_notice(env=env)
    assert [(x.kind, x.pid) for x in read_listeners(str(control_dir))] == [("poll", os.getpid())]


def test_no_time_to_save_and_no_deadline_pass_through(control_dir, env):
    request(control_dir, deadline_unix_s=None, save=False)
    notice = spotrun.preemption_notice(env=env)
    assert (notice.save, notice.deadline_unix_s, notice.seconds_left()) == (False, None, None)


def test_seconds_left_counts_down_to_zero():
    notice = spotrun.PreemptionNotice(reason="SIGTERM", deadline_unix_s=100.0, requested_unix_s=90.0)
    assert notice.seconds_left(now_unix_s=92.5) == 7.5
    assert notice.seconds_left(now_unix_s=130.0) == 0.0
    soon = spotrun.PreemptionNotice(reason="SIGTERM", deadline_unix_s=time.time() + 20, requested_unix_s=0.0)
    assert 0 < soon.seconds_left() <= 20


def test_damaged_request_file_is_a_notice_without_deadline(control_dir, env, caplog):
    (control_dir / control.SAVE_REQUEST_FILE).write_text('{"reason": "SIG')
    with caplog.at_level(logging.WARNING, logger="spotrun.control.preemption"):
        notice = spotrun.preemption_notice(env=env)
    assert (notice.reason, notice.deadline_unix_s, notice.save) == ("unreadable save request", None, True)
    assert "taking it as a preemption notice" in caplog.text


def test_callback_runs_once_in_a_thread_when_the_notice_comes(control_dir, env):
    calls, called = [], threading.Event()

    def callback(notice):
        calls.append((notice, threading.current_thread().name))
        called.set()

    watch = spotrun.on_preemption_notice(callback, poll_interval_s=0.01, env=env)
    assert watch.active and [x.kind for x in read_listeners(str(control_dir))] == ["poll"]
    time.sleep(0.05)
    assert calls == []
    request(control_dir, reason="aws spot instance-action")
    assert called.wait(WAIT_S)
    watch.cancel(timeout_s=WAIT_S)
    assert not watch.active
    [(notice, thread_name)] = calls
    assert notice.reason == "aws spot instance-action" and watch.notice == notice
    assert thread_name != threading.main_thread().name


def test_cancelled_watch_never_calls_back(control_dir, env):
    calls = []
    watch = spotrun.on_preemption_notice(calls.append, poll_interval_s=0.01, env=env)
    watch.cancel(timeout_s=WAIT_S)
    assert not watch.active
    request(control_dir)
    time.sleep(0.1)
    assert calls == [] and watch.notice is None


def test_outside_spotrun_run_no_thread_starts():
    calls = []
    watch = spotrun.on_preemption_notice(calls.append, env={})
    assert not watch.active
    watch.cancel()
    assert calls == []


def test_failing_callback_is_logged_not_raised(control_dir, env, caplog):
    def callback(notice):
        raise RuntimeError("boom")

    request(control_dir)
    with caplog.at_level(logging.ERROR, logger="spotrun.control.preemption"):
        watch = spotrun.on_preemption_notice(callback, poll_interval_s=0.01, env=env)
        deadline = time.monotonic() + WAIT_S
        while watch.active and time.monotonic() < deadline:  # the thread ends after the callback
            time.sleep(0.01)
    assert watch.notice is not None and not watch.active
    assert "the preemption notice callback failed" in caplog.text and "boom" in caplog.text


@pytest.mark.parametrize("interval_s", [0, -1.0, float("nan")])
def test_poll_interval_must_be_positive(env, interval_s):
    with pytest.raises(ValueError, match="poll_interval_s"):
        spotrun.on_preemption_notice(print, poll_interval_s=interval_s, env=env)
