"""Where the suite's files lie, the same from a test at any depth of tests/."""

import pathlib

#: The repository's root (the working directory of the subprocesses that import ``tests.*``).
REPO = pathlib.Path(__file__).resolve().parents[2]
#: Scripts the tests run as jobs: torchrun workers and fake launch commands.
JOBS = REPO / "tests" / "jobs"
#: Checked-in checkpoints written by earlier versions of spotrun.
GOLDEN = REPO / "tests" / "golden"
