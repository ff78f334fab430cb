"""Where the suite's files lie, the same from a test at any depth of tests/."""

import pathlib

#: The repository's root (the working directory of the subprocesses that import ``tests.*``).
REPO = pathlib.Path(__file__).resolve().parents[2]
#: Scripts the tests run as jobs: torchrun workers and fake launch commands.
JOBS = REPO / "tests" / "jobs"
#: Checked-in checkpoints written by earlier versions of spotrun.
GOLDEN = REPO / "tests" / "golden"


def glob_live(root: pathlib.Path, pattern: str, attempts: int = 50) -> list[pathlib.Path]:
    """``root.glob(pattern)`` of a tree that another process changes while it is read (a tier whose
    old steps are pruned): Python 3.11's glob raises when a directory vanishes in the middle of the
    scan, so the scan starts again (a consistent listing, not a retried assertion)."""
    for _ in range(attempts - 1):
        try:
            return list(root.glob(pattern))
        except FileNotFoundError:
            continue
    return list(root.glob(pattern))
