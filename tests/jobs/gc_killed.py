"""Run ``spotrun gc`` in this process and SIGKILL it at one persistence point of its deletions
(the hooks of tests/support/crash_points.py: every call that changes a file under a local root, or
before and after every S3 request that changes the bucket).

Usage: gc_killed.py POINTS_FILE KILL_AT local ROOT -- GC_ARGS...
       gc_killed.py POINTS_FILE KILL_AT s3 PREFIX -- GC_ARGS...
KILL_AT is the 0-based index of the point to die at, or ``none`` to count them all; the
names of the points passed are written to POINTS_FILE (one JSON list) when gc ends.
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root: tests.*

from tests.support.crash_points import LocalHooks, PointCounter, S3Hooks  # noqa: E402

points_file, kill_at, backend, where = sys.argv[1:5]
gc_args = sys.argv[sys.argv.index("--") + 1 :]
counter = PointCounter(None if kill_at == "none" else int(kill_at))
if backend == "local":
    LocalHooks(where, counter).install()
else:
    S3Hooks(counter, where).install()

from spotrun.cli import main  # noqa: E402

code = main(["gc", *gc_args])
pathlib.Path(points_file).write_text(json.dumps(counter.names))
sys.exit(code)
