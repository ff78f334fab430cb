"""Field case C22: ``spotrun report``'s clock starts when spotrun starts, not when the process that
exec'd it did (``bash -c "pip install ... && exec spotrun run ..."``, a container's ``sh -c``
entrypoint: exec keeps the pid, and with it the start time in ``/proc``)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

from tests.support.paths import JOBS, REPO

WORKER = JOBS / "short_saver_job.py"


def test_the_report_excludes_what_the_shell_did_before_it_exec_d_spotrun(tmp_path):
    """C22: a shell sleeps, then execs ``spotrun run`` (same pid); the report's wall time and
    start-up begin after the sleep."""
    root = tmp_path / "ck"
    sleep_s = 3.0
    run = [
        sys.executable,
        "-m",
        "spotrun",
        "run",
        "--checkpoint-uri",
        str(root),
        "--grace-period-s",
        "30",
        "--",
        sys.executable,
        str(WORKER),
        "5",
    ]
    before_s = time.time()
    shell = subprocess.Popen(
        ["bash", "-c", f"sleep {sleep_s} && exec {shlex.join(run)}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, _ = shell.communicate(timeout=300)
    after_s = time.time()
    assert shell.returncode == 0, output
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "report", "--json", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    start = json.loads((next((root / "events").glob("*.supervisor-*.jsonl"))).read_text().splitlines()[0])
    assert start["event"] == "start" and start["pid"] == shell.pid  # the exec'd case: bash's pid and start time
    spotrun_ran_s = after_s - before_s - sleep_s  # at most: spotrun began after the sleep, ended before after_s
    assert report["totals"]["wall_s"] <= spotrun_ran_s, (report["totals"], spotrun_ran_s)
    assert report["totals"]["startup_s"] <= spotrun_ran_s
    assert report["totals"]["steps_trained"] == 5
