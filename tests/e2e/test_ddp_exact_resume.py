"""DDP on more than 2 ranks resumes bit-exactly (found by a new user's trial: a 4-rank DDP MLP
resumed with losses 1e-7 off and `spotrun drill` failed). A fresh DDP buckets its gradients in
reverse definition order and rebuilds them after its first step in the order they became ready;
on 3+ ranks the ring all-reduce sums an element in an order set by its offset in the bucket, so
the first step after a resume summed differently. spotrun saves the rebuilt layout and gives the
resumed DDP a reducer built with it (spotrun/state/ddp_buckets.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import JOBS

pytestmark = pytest.mark.slow

JOB = JOBS / "ddp_mlp.py"


def test_a_user_ddp_script_on_4_ranks_passes_spotruns_drill_bit_exactly(tmp_path):
    """The user's shape (README loop, DDP over a 3-layer MLP, SGD with momentum, 4 gloo ranks):
    `spotrun drill` preempts it after step 6, resumes it and compares every saved value with an
    uninterrupted run's one step after the resume: identical, model and optimizer included."""
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "drill", "--after-steps", "6", "--checkpoint-uri", str(tmp_path / "ck")]
        + ["--json", "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
        + [str(JOB), "40", "0.25"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(done.stdout)
    assert report["passed"], (report["problems"], report["differences"][:5], done.stderr[-3000:])
    assert report["exact"] is True and report["difference_count"] == 0
    assert "gradient buckets" not in done.stderr  # nothing said it could not restore them
