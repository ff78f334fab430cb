"""A rank that stops answering (a real SIGSTOP, tests/jobs/hang_job.py on 3 torchrun ranks under
`spotrun run`) during a save, during a restore and at a stop: the others fail within the documented
bound, the supervisor's log names the rank, and the job restarts and resumes exactly as an
uninterrupted run (issue 26, point 4; bounds: docs/reference/timeouts.md)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import re
import signal
import sys
import time

import pytest

from spotrun.checkpoint.save_bounds import SAVE_SETTLE_S
from spotrun.supervisor.hang_watch import LOOK_INTERVAL_S
from spotrun.tools import rollcall
from tests.support.paths import JOBS
from tests.support.stopped_ranks import end_workers
from tests.support.trainrun import start_supervised

pytestmark = pytest.mark.slow

JOB = JOBS / "hang_job.py"
STEPS, INTERVAL = 30, 5
#: Generous: a busy 2-core machine, three ranks and a supervisor.
SLACK_S = 30.0
#: The longest a supervised run of the job may take here.
RUN_TIMEOUT_S = 300.0
SAVE_TIMEOUT_S = 2.0
RESTORE_TIMEOUT_S = 3.0
GRACE_PERIOD_S = 20.0
NAMED = re.compile(r"^spotrun: (\S+)Z ERROR a rank stopped answering: (.*)$", re.M)


def command(out: pathlib.Path, *job_args: str, steps: int = STEPS) -> list[str]:
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(JOB)),
        *(str(out), "--steps", str(steps), "--interval", str(INTERVAL), *job_args),
    ]


@contextlib.contextmanager
def supervised(tmp_path: pathlib.Path, job: list[str], *, env: dict | None = None, log: str = "spotrun.log"):
    """`spotrun run --max-restarts 1` around ``job``; at the end nothing of it stays (stopped or not)."""
    proc = start_supervised(
        str(tmp_path / "ckpt"),
        job,
        grace_period_s=GRACE_PERIOD_S,
        env=env,
        extra_options=["--max-restarts", "1", "--restart-backoff-s", "0.2"],
        log_path=tmp_path / log,
    )
    try:
        yield proc
    finally:
        end_workers(tmp_path / "out", JOB.name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def run(tmp_path: pathlib.Path, job: list[str], **kwargs) -> tuple[int, str]:
    with supervised(tmp_path, job, **kwargs) as proc:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    return code, (tmp_path / kwargs.get("log", "spotrun.log")).read_text()


def outcome(out: pathlib.Path) -> tuple[dict, dict]:
    """(each rank's loss at each step, its last value when a step ran twice; the final weights)."""
    losses = {}
    for rank in range(3):
        for line in (out / f"losses-rank-{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            losses[(rank, record["step"])] = record["loss"]
    return losses, json.loads((out / "final.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, dict]:
    """The job uninterrupted, under `spotrun run` (its saves change nothing it computes)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    (tmp_path / "out").mkdir()
    code, log = run(tmp_path, command(tmp_path / "out"))
    assert code == 0, log[-3000:]
    return outcome(tmp_path / "out")


def named_after_stop_s(log: str, out: pathlib.Path) -> tuple[str, float]:
    """(the supervisor's line naming the rank, seconds from the SIGSTOP to that line)."""
    found = NAMED.search(log)
    assert found, f"the supervisor never named a rank:\n{log[-4000:]}"
    said = datetime.datetime.fromisoformat(found.group(1)).replace(tzinfo=datetime.timezone.utc).timestamp()
    return found.group(2), said - float((out / "stopped").read_text())


def resumed_exactly(out: pathlib.Path, reference: tuple[dict, dict]) -> None:
    losses, final = outcome(out)
    assert final == reference[1], "the final weights differ from the uninterrupted run's"
    assert losses == reference[0], "a step's loss differs from the uninterrupted run's"


@pytest.mark.parametrize("saves", ["synchronous", "background"])
def test_a_rank_stopped_in_a_save_is_named_and_the_job_resumes_exactly(tmp_path, reference, saves):
    """Issue 26 point 4: rank 1 stops while writing its shard of step 10. The supervisor names rank 1
    within save_timeout_s + min(save_timeout_s, 70 s) + the roll call + its look. Synchronous: ranks 0
    and 2 give up at the save's write gather and exit; torchrun SIGKILLs rank 1 after its shutdown
    timeout. Background: their training threads are stuck in the job's own all-reduce with rank 1
    (spotrun cannot bound it) while their background savers give up and report; the supervisor stops
    the stuck command. Either way the job restarts (--max-restarts 1) from step 5 and ends as the
    uninterrupted run did."""
    out = tmp_path / "out"
    out.mkdir()
    sync = ["--sync-saves"] if saves == "synchronous" else []
    code, log = run(tmp_path, command(out, *sync, "--save-timeout-s", str(SAVE_TIMEOUT_S), "--stop", "1:save:10"))
    assert code == 0, log[-4000:]
    line, delay_s = named_after_stop_s(log, out)
    assert "rank(s) [1] did not arrive at the write gather of step 10's save" in line, line
    bound_s = SAVE_TIMEOUT_S + min(SAVE_TIMEOUT_S, SAVE_SETTLE_S) + rollcall.WINDOW_S + rollcall.AFTER_CLOSE_S
    assert delay_s < bound_s + LOOK_INTERVAL_S + SLACK_S, (delay_s, line)
    stuck = "still runs 10 s after its report: stuck" in log
    assert stuck == (saves == "background"), "the supervisor stops only a command whose reporter is stuck"
    assert "restart 1 of 1" in log
    resumed_exactly(out, reference)


def test_a_rank_stopped_in_a_restore_is_named_and_the_job_resumes_exactly(tmp_path, reference):
    """Issue 26 point 4: the job ran to step 10 and ended; started again for 30 steps, rank 1 stops
    while reading its share of step 10 (the restore is cooperative: 3 DDP ranks need the same bytes).
    Ranks 0 and 2 give up at the gather after the reads after $SPOTRUN_RESTORE_TIMEOUT_S and the roll
    call, and exit; the supervisor names rank 1, torchrun ends, the command is restarted, and the job
    ends as the uninterrupted run did."""
    out = tmp_path / "out"
    out.mkdir()
    code, log = run(tmp_path, command(out, steps=10), log="first.log")
    assert code == 0, log[-3000:]
    env = {"SPOTRUN_RESTORE_TIMEOUT_S": str(RESTORE_TIMEOUT_S)}
    code, log = run(tmp_path, command(out, "--stop", "1:restore"), env=env)
    assert code == 0, log[-4000:]
    line, delay_s = named_after_stop_s(log, out)
    assert "rank(s) [1] did not arrive at the reads of step 10's restore within 3 s" in line, line
    bound_s = RESTORE_TIMEOUT_S + rollcall.window_s(RESTORE_TIMEOUT_S) + rollcall.AFTER_CLOSE_S + LOOK_INTERVAL_S
    assert delay_s < bound_s + SLACK_S
    assert "restart 1 of 1" in log
    resumed_exactly(out, reference)


def test_a_rank_stopped_at_a_stop_is_named_before_the_deadline_and_the_next_start_resumes_exactly(tmp_path, reference):
    """Issue 26 point 4: a notice (SIGTERM to `spotrun run`, 20 s grace period) reaches the workers at
    step 12 and rank 1 stops there. Ranks 0 and 2 give up at the agreement on the stop early enough
    for the supervisor to name rank 1 before the deadline (notice + grace - margin); it exits 142
    (preempted, no emergency checkpoint: the resume point is step 10); the next start resumes from
    step 10 and ends as the uninterrupted run did."""
    out = tmp_path / "out"
    out.mkdir()
    job = command(out, "--step-s", "0.1", "--stop", "1:notice:12")
    with supervised(tmp_path, job) as proc:
        deadline_s = time.monotonic() + RUN_TIMEOUT_S
        while not any('"step": 12' in p.read_text() for p in out.glob("losses-rank-*.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline_s, "the job never reached step 12"
            time.sleep(0.1)
        noticed_s = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    log = (tmp_path / "spotrun.log").read_text()
    assert code == 142, log[-4000:]
    line, _ = named_after_stop_s(log, out)
    assert "rank(s) [1] did not arrive at the per-step agreement at step 12" in line, line
    said_s = datetime.datetime.fromisoformat(NAMED.search(log).group(1)).replace(tzinfo=datetime.timezone.utc)
    assert said_s.timestamp() - noticed_s < GRACE_PERIOD_S - 5 + 1, "named before the deadline (1 s: the signal's way)"
    assert "newest complete checkpoint is step 10" in log
    code, log = run(tmp_path, job, log="second.log")
    assert code == 0, log[-4000:]
    resumed_exactly(out, reference)
