"""`spotrun run` and a worker's report that a rank stopped answering (collective-timeout.json),
around a fake command (tests/jobs/hung_rank.py) that reports and then hangs deaf to SIGTERM, as a
worker whose training thread is stuck in the job's own collective, or whose reporting worker exits
and leaves the rest to its launcher, as torchrun; issue 26, point 4."""

from __future__ import annotations

import datetime
import re
import signal
import sys

from spotrun.control.hangs import LOOK_INTERVAL_S
from spotrun.supervisor.hang_watch import REPORTER_EXIT_WAIT_S
from tests.support.fake_launch import FAKE, FAST, STOP_S

NAMED = "a rank stopped answering: rank(s) [1] did not arrive at the write gather of step 40's save within 12 s"
#: Generous: a busy 2-core machine.
SLACK_S = 30.0


def said_at(log: str, text: str) -> float:
    """When the supervisor logged the first line holding ``text`` (``time.time()``)."""
    line = next(line for line in log.splitlines() if text in line)
    stamp = re.search(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z", line).group(1)
    return datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.timezone.utc).timestamp()


def test_a_reported_rank_is_named_and_the_stuck_command_stopped_and_restarted(spotrun_run, tmp_path, state):
    """The supervisor names rank 1 within a look of the report; the reporting process still runs
    after REPORTER_EXIT_WAIT_S (stuck), so it stops the command though it ignores SIGTERM (SIGKILL
    after --stop-timeout-s), and restarts it (--max-restarts 1)."""
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST, "--max-restarts", "1", "--restart-backoff-s", "0"],
        [sys.executable, FAKE / "hung_rank.py", state],
    )
    assert run.wait() == 0, run.log()
    log = run.log()
    assert f"{NAMED} (reported by rank 0)" in log
    reported_s = float((state / "reported").read_text())
    assert said_at(log, NAMED) - reported_s < LOOK_INTERVAL_S + SLACK_S
    stopped = "still runs 10 s after its report: stuck (in the job's own collective?); stopping the command"
    assert stopped in log
    assert said_at(log, stopped) - said_at(log, NAMED) >= REPORTER_EXIT_WAIT_S
    assert "the command failed with exit code 137: restart 1 of 1" in log
    assert len((state / "launches").read_text().splitlines()) == 2


def test_without_restarts_left_the_command_exit_code_is_spotruns(spotrun_run, tmp_path, state):
    """No restart left: spotrun exits with the command's code, 137 (it had to SIGKILL it), after
    naming the rank; never 0, 142 or 143."""
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST], [sys.executable, FAKE / "hung_rank.py", state]
    )
    assert run.wait() == 137, run.log()
    assert NAMED in run.log() and "no restarts left" in run.log()


def test_a_rank_that_stops_answering_at_a_stop_ends_it_before_the_deadline_with_142(spotrun_run, tmp_path, state):
    """A notice reached the worker, then its agreement gave up: the supervisor names the rank and stops
    the command at once, not at the deadline, and exits 142 (no emergency checkpoint)."""
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), "--grace-period-s", "60", "--stop-timeout-s", str(STOP_S)],
        [sys.executable, FAKE / "hung_rank.py", state, "--after-request"],
    )
    run.wait_until(lambda: (state / "ready").exists(), "the worker started")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 142, run.log()
    log = run.log()
    assert NAMED in log and "deadline passed" not in log
    deadline_s = 60 - 5  # the grace period less the default safety margin
    assert said_at(log, "the command exited") - said_at(log, "preemption notice") < deadline_s - 10


def test_a_reporter_that_exits_leaves_the_rest_to_the_launcher(spotrun_run, tmp_path, state):
    """The worker that raised exited (torchrun then stops the others itself, and may restart them
    in place, as an elastic job does): the supervisor names the rank but does not stop the
    command; when it fails, the launch is restarted."""
    run = spotrun_run(
        ["--checkpoint-uri", str(tmp_path / "ckpt"), *FAST, "--max-restarts", "1", "--restart-backoff-s", "0"],
        [sys.executable, FAKE / "hung_rank.py", state, "--reporter-exits"],
    )
    assert run.wait() == 0, run.log()
    log = run.log()
    assert NAMED in log and "stopping the command" not in log
    assert "the command failed with exit code 1: restart 1 of 1" in log
