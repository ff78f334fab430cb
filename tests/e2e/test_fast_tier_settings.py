"""Nodes whose fast-tier settings differ (a node started without `--memory-interval-steps`, or
with another interval) run with storage only, said once, and never hang: the tier's saves are
collectives, so it is on for every rank or for none (found by a user: two nodes, one without the
tier, sat in a futex wait until gloo's 30-minute timeout)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import JOBS

WORKER = JOBS / "mixed_tier_nodes.py"


@pytest.mark.parametrize(
    "mode, said",
    [
        ("one-without", "rank(s) [1] cannot share theirs (no fast tier on its node (--memory-interval-steps unset))"),
        ("intervals", "the nodes save it at different intervals (2, 4 steps)"),
        ("neither", None),
    ],
)
def test_nodes_that_disagree_on_the_fast_tier_run_with_storage_only(tmp_path, mode, said):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            mode,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,  # a hang fails here, not at gloo's 30 minutes
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result == {"tier": False, "tier_files": []}, result
    warnings = [line for line in done.stderr.splitlines() if "the fast tier is off" in line]
    if said is None:
        assert warnings == [], warnings
    else:
        assert len(warnings) == 1 and said in warnings[0], done.stderr[-4000:]
