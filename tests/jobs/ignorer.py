"""Fake worker that ignores save requests and SIGTERM, with a grandchild in a new session.

usage: ignorer.py STATE_DIR [--exit-after-spawn | --fail-after-spawn]
    STATE_DIR/pids             "WORKER_PID GRANDCHILD_PID", written once both run
    STATE_DIR/request-seen     written when a save request appears (and is ignored)
With --exit-after-spawn the worker exits 0 at once, leaving the grandchild behind; with
--fail-after-spawn it exits 1 (a launcher that crashed, leaving a worker behind).
"""

import os
import pathlib
import signal
import subprocess
import sys
import time


def grandchild(ready: pathlib.Path) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.write_text(str(os.getpid()))
    while True:
        signal.pause()


def main() -> int:
    if sys.argv[1] == "--grandchild":
        grandchild(pathlib.Path(sys.argv[2]))
        return 0
    state_dir = pathlib.Path(sys.argv[1])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready = state_dir / "grandchild-pid"
    # A new session, as torchrun gives its workers: killing our process group misses it.
    child = subprocess.Popen([sys.executable, __file__, "--grandchild", str(ready)], start_new_session=True)
    while not ready.exists():
        if child.poll() is not None:
            return 1
        time.sleep(0.01)
    (state_dir / "pids.tmp").write_text(f"{os.getpid()} {child.pid}")
    os.replace(state_dir / "pids.tmp", state_dir / "pids")
    if "--exit-after-spawn" in sys.argv:
        return 0
    if "--fail-after-spawn" in sys.argv:
        return 1
    from spotrun.control import env
    from spotrun.control import files as control  # after the grandchild branch: it needs neither

    control_dir = env.WorkerEnv.from_environ().control_dir
    while True:
        time.sleep(0.02)
        if control.save_requested(control_dir):
            (state_dir / "request-seen").touch()


if __name__ == "__main__":
    sys.exit(main())
