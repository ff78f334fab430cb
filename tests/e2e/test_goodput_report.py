"""Acceptance of ``spotrun report``: a real run under ``spotrun run`` and torchrun (2 ranks,
gloo), preempted twice - once killed without notice (SIGKILL of the supervisor and every
process under it), once with a notice (SIGTERM to ``spotrun``: emergency checkpoint, exit 143)
- then run to the end. The steps lost and the goodput that ``spotrun report --json`` gives are
compared with what this test computes on its own from the job's training log (one line per
step with its wall-clock time, tests/jobs/goodput_job.py) and from its own clock around
each run.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotrun.supervisor.process import descendants
from tests.support.paths import JOBS
from tests.support.trainrun import start_supervised

WORKER = JOBS / "goodput_job.py"
STEPS, INTERVAL, STEP_S = 40, 10, 0.05
KILL_AFTER = 25  # not a save step: the steps since the periodic save of step 20 are lost
NOTICE_AT = 28


def job_command(uri: str, log_file: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(WORKER),
        uri,
        str(log_file),
        str(out),
        "--steps",
        str(STEPS),
        "--interval",
        str(INTERVAL),
        "--step-s",
        str(STEP_S),
        *extra,
    ]


def wait_until(condition, proc: subprocess.Popen, what: str, timeout_s: float = 300) -> None:
    """Poll ``condition`` until it holds; fail if the job exits first or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the job exited with {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def progress_stored(root: Path, step: int) -> bool:
    """Whether rank 0's event object holds a progress record of ``step`` (read as plain JSON lines)."""
    for path in (root / "events").glob("*.rank-00000.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["event"] == "progress" and record["step"] == step:
                return True
    return False


def kill_without_notice(proc: subprocess.Popen) -> None:
    """SIGKILL ``spotrun`` and every process under it, all frozen first (SIGSTOP) so that none
    reacts to another's death: no notice, no emergency save."""
    tree = [proc.pid] + [p.pid for p in descendants(proc.pid)]
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    for pid in tree + [p.pid for p in descendants(proc.pid) if p.pid not in tree]:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)


def runs_in_log(log_file: Path) -> list[dict]:
    """The training log split into runs: resumed step, when training began, each step's end."""
    runs = []
    for line in log_file.read_text().splitlines():
        row = json.loads(line)
        if row.get("event") == "restored":
            runs.append({"resumed": row["step"], "began": row["time_unix_s"], "steps": []})
        else:
            runs[-1]["steps"].append((row["step"], row["time_unix_s"]))
    return runs


@pytest.mark.slow
def test_report_of_a_run_preempted_twice_matches_its_training_log(tmp_path, processes):
    root, log_file = tmp_path / "ck", tmp_path / "train.jsonl"
    uri = str(root)
    env = {"SPOTRUN_EVENT_INTERVAL_S": "0.1"}

    def launch(name: str, *extra: str) -> tuple[subprocess.Popen, float]:
        started = time.time()
        proc = start_supervised(
            uri,
            job_command(uri, log_file, tmp_path, *extra),
            env=env,
            extra_options=["--notice", "none"],
            log_path=tmp_path / f"{name}.log",
        )
        processes.append(proc)
        return proc, started

    # 1. killed without notice once step KILL_AFTER is in the event log
    proc, began = launch("killed", "--hold-after", str(KILL_AFTER))
    wait_until(
        lambda: (tmp_path / f"held-{KILL_AFTER}").exists() and progress_stored(root, KILL_AFTER),
        proc,
        f"step {KILL_AFTER} recorded",
    )
    kill_without_notice(proc)
    # The job did nothing after its last step but wait to be killed; the report cannot see past
    # its last record (that step), so the test's wall time for this run ends there too.
    killed_run_ended = runs_in_log(log_file)[-1]["steps"][-1][1]
    walls_s = [killed_run_ended - began]

    # 2. a notice (SIGTERM to spotrun) while step NOTICE_AT waits for it: saved, 143
    proc, began = launch("noticed", "--hold-for-notice-at", str(NOTICE_AT))
    wait_until(lambda: (tmp_path / f"held-{NOTICE_AT}").exists(), proc, f"step {NOTICE_AT} reached")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=300) == 143, (tmp_path / "noticed.log").read_text()[-3000:]
    walls_s.append(time.time() - began)

    # 3. to the end
    proc, began = launch("finished")
    assert proc.wait(timeout=300) == 0, (tmp_path / "finished.log").read_text()[-3000:]
    walls_s.append(time.time() - began)

    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "report", uri, "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows, totals = report["incarnations"], report["totals"]

    # What the training log says, computed here without the event log.
    runs = runs_in_log(log_file)
    assert [run["resumed"] for run in runs] == [0, KILL_AFTER // INTERVAL * INTERVAL, NOTICE_AT]
    last = [run["steps"][-1][0] for run in runs]
    assert last == [KILL_AFTER, NOTICE_AT, STEPS]
    resumed_next = [run["resumed"] for run in runs[1:]] + [None]
    lost = [max(0, L - R) if R is not None else 0 for L, R in zip(last, resumed_next)]
    kept = [(min(L, R) if R is not None else L) - run["resumed"] for L, R, run in zip(last, resumed_next, runs)]
    # time training per step: from the end of the restore to the end of the last step
    step_s = [(run["steps"][-1][1] - run["began"]) / (L - run["resumed"]) for L, run in zip(last, runs)]
    useful_s = sum(k * s for k, s in zip(kept, step_s))
    goodput = useful_s / sum(walls_s)

    assert [row["steps_lost"] for row in rows] == lost == [KILL_AFTER - 20, 0, 0]
    assert totals["steps_lost"] == sum(lost)
    assert [row["resumed_step"] for row in rows] == [run["resumed"] for run in runs]
    assert [row["steps_trained"] for row in rows] == [L - run["resumed"] for L, run in zip(last, runs)]
    assert [row["ended"] for row in rows] == ["no_exit_recorded", "preempted_saved", "finished"]
    print(
        f"goodput: report {totals['goodput']:.4f}, training log {goodput:.4f}; useful: report "
        f"{totals['useful_s']:.3f} s, log {useful_s:.3f} s; wall: report {[round(r['wall_s'], 3) for r in rows]}, "
        f"test {[round(w, 3) for w in walls_s]}; save stalls {totals['save_stall_s']:.3f} s"
    )
    # Useful time (kept steps x step time) from the two sources: the report leaves the save
    # stalls out of the training time, which the log cannot see; 0.1 s covers the moments
    # between the worker's clock readings and the Checkpointer's (end of restore, end of the
    # last step: microseconds on an idle machine, a context switch on a busy one).
    assert abs(totals["useful_s"] - useful_s) <= totals["save_stall_s"] + 0.1
    # The report's wall time never exceeds the test's: each run starts before `spotrun` exists
    # and ends after it is gone (slack: /proc's 10 ms process start time, clock reads).
    assert all(row["wall_s"] <= wall_s + 0.05 for row, wall_s in zip(rows, walls_s))
    # Goodput: besides the useful time above, only the wall times differ. The test's clock also
    # runs while the supervisor's interpreter exits after its last record (it has imported torch)
    # in the two runs that exit by themselves. That shutdown slows down with the machine's load
    # as the runs' start-up does (each run starts four processes that import torch), so its share
    # of the wall time stays about the same: measured 0.7-0.8 s of 11-12 s runs at load average 2
    # (goodput 5.3 % higher in the report), 1.1-1.7 s of 23-28 s runs at load average 5 (4.2 %).
    assert totals["goodput"] == pytest.approx(goodput, rel=0.1)
    # One interruption lost work (the kill); the notice's did not: too few to suggest an interval.
    assert (totals["interruptions"], totals["unsaved_interruptions"]) == (2, 1)
    assert report["interval"]["interval_steps"] is None and "too few" in report["interval"]["reason"]
