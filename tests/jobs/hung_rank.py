"""Fake launch command whose first launch reports a rank that stopped answering.

By default as a worker whose background save's gather gave up while its training thread is
stuck in the job's own collective: it writes ``collective-timeout.json`` (rank 1 did not arrive)
into the control directory, ignores SIGTERM and sleeps; only SIGKILL ends it. With
``--reporter-exits`` as torchrun after a worker raised: a child process writes the report and
exits, and this process (the launcher) exits 1 some seconds later, on its own. A later launch
exits 0 at once.

usage: hung_rank.py STATE_DIR [--after-request] [--reporter-exits]
    STATE_DIR/launches    one line per launch
    STATE_DIR/ready       written once the first launch runs (its pid)
    STATE_DIR/reported    when the report was written (time.time())
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

from spotrun.control import hangs, listeners

#: How long the launcher runs on after its worker reported and exited (more than the supervisor's
#: wait for a reporter to exit), in seconds.
LAUNCHER_RUNS_ON_S = 15.0


def report(state: pathlib.Path) -> None:
    hangs.write_collective_timeout_report(
        os.environ["SPOTRUN_CONTROL_DIR"],
        ranks=[1],
        what="the write gather of step 40's save",
        timeout_s=12.0,
        message="rank(s) [1] did not arrive at the write gather of step 40's save within 12 s",
        rank=0,
    )
    (state / "reported").write_text(repr(time.time()))


def main() -> int:
    state = pathlib.Path(sys.argv[1])
    if "--reporter" in sys.argv:  # the worker that raised: report, then exit
        report(state)
        return 1
    with open(state / "launches", "a") as f:
        f.write(f"{os.getpid()}\n")
    if len((state / "launches").read_text().splitlines()) > 1:
        return 0
    listeners.announce("checkpointer")  # it reads the save request: no notice signal for it
    (state / "ready").write_text(str(os.getpid()))
    if "--reporter-exits" in sys.argv:
        subprocess.run([sys.executable, __file__, str(state), "--reporter"], check=False)
        time.sleep(LAUNCHER_RUNS_ON_S)
        return 1
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--after-request" in sys.argv:  # report once a notice reached it
        while not os.path.exists(os.path.join(os.environ["SPOTRUN_CONTROL_DIR"], "save-request.json")):
            time.sleep(0.05)
    report(state)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
