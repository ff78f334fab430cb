"""Fake launch command whose first launch reports a rank that stopped answering, then hangs.

As a worker whose background save's gather gave up while its training thread is stuck in the
job's own collective: it writes ``collective-timeout.json`` (rank 1 did not arrive) into the
control directory, ignores SIGTERM and sleeps; only SIGKILL ends it. A later launch exits 0 at once.

usage: hung_rank.py STATE_DIR
    STATE_DIR/launches    one line per launch
    STATE_DIR/ready       written once the first launch runs (its pid)
    STATE_DIR/reported    when the report was written (time.time())
"""

import os
import pathlib
import signal
import sys
import time

from spotrun.control import hangs, listeners


def main() -> int:
    state = pathlib.Path(sys.argv[1])
    with open(state / "launches", "a") as f:
        f.write(f"{os.getpid()}\n")
    if len((state / "launches").read_text().splitlines()) > 1:
        return 0
    listeners.announce("checkpointer")  # it reads the save request: no notice signal for it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (state / "ready").write_text(str(os.getpid()))
    if len(sys.argv) > 2 and sys.argv[2] == "--after-request":  # report once a notice reached it
        while not os.path.exists(os.path.join(os.environ["SPOTRUN_CONTROL_DIR"], "save-request.json")):
            time.sleep(0.05)
    hangs.write_collective_timeout_report(
        os.environ["SPOTRUN_CONTROL_DIR"],
        ranks=[1],
        what="the write gather of step 40's save",
        timeout_s=12.0,
        message="rank(s) [1] did not arrive at the write gather of step 40's save within 12 s",
        rank=0,
    )
    (state / "reported").write_text(repr(time.time()))
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
