"""spotrun's own gloo groups are freed before Python finalizes, so a script that ends normally
exits 0. Found in CI: a 2-rank job ended with SIGABRT ("terminate called without an active
exception") after its last end_of_step, now and then on a busy machine: gloo's worker thread
dropped the finished all-reduce's tensors while Python finalized, and a thread that takes the GIL
then aborts the process. A group freed earlier has joined its threads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import JOBS

pytestmark = pytest.mark.slow

JOB = JOBS / "exit_threads.py"


def run(work, agreement: str, save_mode: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(JOB), str(work), agreement, save_mode],
        capture_output=True,
        text=True,
        timeout=240,  # a hang fails here
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((work / f"rank-{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("agreement, save_mode", [("pipelined", "background"), ("immediate", "synchronous")])
def test_a_script_that_ends_normally_leaves_none_of_spotruns_gloo_threads_to_finalization(
    tmp_path, agreement, save_mode
):
    """The README's loop (restore, end_of_step with saves, close, destroy_process_group, return),
    saving in one run and restoring in the next: when Python starts to finalize, each rank has no
    more gloo process groups (one tcp loop thread each) than the job made itself, though spotrun
    made a training group, a background saver's and a restore's; with a pipelined agreement, the
    all-reduce started at the last step is done too."""
    for _ in ("saves", "restores"):
        for rank, seen in enumerate(run(tmp_path, agreement, save_mode)):
            job_groups = seen["after_init"].count("gloo_tcp_loop")
            assert job_groups == 1, seen
            assert seen["at_exit"].count("gloo_tcp_loop") <= job_groups, (rank, seen)
