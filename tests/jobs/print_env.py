"""Fake launch command that writes what the supervisor told it.

usage: print_env.py OUT_JSON
Writes the SPOTRUN_* and TORCH_ELASTIC_SHUTDOWN_TIMEOUT variables, the working directory,
and whether the control directory exists, as JSON; exits 0.
"""

import json
import os
import sys


def main() -> int:
    seen = {k: v for k, v in os.environ.items() if k.startswith("SPOTRUN_") or k == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    control_dir = os.environ.get("SPOTRUN_CONTROL_DIR")
    doc = {"env": seen, "control_dir_exists": bool(control_dir) and os.path.isdir(control_dir)}
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
