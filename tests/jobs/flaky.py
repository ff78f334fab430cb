"""Fake launch command that fails its first launches.

usage: flaky.py STATE_DIR FAIL_TIMES EXIT_CODE
Appends one JSON line per launch to STATE_DIR/launches.jsonl (time, incarnation, resume
step) and exits EXIT_CODE while it has been launched at most FAIL_TIMES times, else 0.
"""

import json
import os
import pathlib
import sys
import time


def main() -> int:
    state_dir, fail_times, exit_code = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    log = state_dir / "launches.jsonl"
    record = {
        "time_unix_s": time.time(),
        "incarnation": os.environ.get("SPOTRUN_INCARNATION"),
        "resume_step": os.environ.get("SPOTRUN_RESUME_STEP"),
        "run_id": os.environ.get("SPOTRUN_RUN_ID"),
    }
    with open(log, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    launches = len(log.read_text().splitlines())
    return exit_code if launches <= fail_times else 0


if __name__ == "__main__":
    sys.exit(main())
