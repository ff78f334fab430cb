"""spotrun's bounded collectives on 3 real gloo ranks under torchrun, with one rank really
stopped (SIGSTOP) or killed (SIGKILL) by its own hand (tests/jobs/stopped_rank.py); issue 26,
point 4. The roll call itself, against a store in memory: test_rollcall.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spotrun.tools import rollcall
from tests.support.paths import JOBS
from tests.support.stopped_ranks import job_tree, wait_for_reports

pytestmark = pytest.mark.slow

JOB = JOBS / "stopped_rank.py"
#: The collectives' bound in these jobs, seconds.
TIMEOUT_S = 3.0
#: Generous: a busy 2-core machine runs several torchrun jobs at once.
SLACK_S = 30.0
#: How long the reports may take: torchrun's start on a busy machine, and the bound.
REPORTS_WAIT_S = 180.0


def run(tmp_path, collective: str, how: str, victim: int = 1) -> list[dict]:
    """The reports of the ranks other than ``victim`` (by rank)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    command += [str(JOB), str(tmp_path), collective, how, str(victim), str(TIMEOUT_S)]
    with job_tree(command, tmp_path, JOB.name, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        return wait_for_reports(tmp_path, [r for r in range(3) if r != victim], proc, REPORTS_WAIT_S)


HAPPY = {
    "gather": [{"rank": 0}, {"rank": 1}, {"rank": 2}],
    "broadcast": {"rank": 2},
    "allreduce": [True, False],
    "transfer": [0, 1, 2],
}


@pytest.mark.parametrize("collective", ["gather", "broadcast", "allreduce"])
def test_a_stopped_rank_is_named_by_the_others_within_the_bound(tmp_path, collective):
    """Issue 26 point 4: rank 1 is SIGSTOPped before an all-gather, a broadcast (from rank 2) or an
    all-reduce; ranks 0 and 2 raise CollectiveTimeoutError naming rank 1 after the bound and the roll
    call's window (plus slack for a busy machine), and the same group refuses the next collective at once.
    Before, every rank got the right result (the happy path is unchanged)."""
    for report in run(tmp_path, collective, "stop"):
        assert report["happy"] == HAPPY[collective]
        assert report["error"] is not None, "the collective must fail without rank 1"
        assert report["ranks"] == [1], report
        assert "rank(s) [1] did not arrive at the test's collective within 3 s" in report["error"]
        assert TIMEOUT_S <= report["elapsed_s"] < TIMEOUT_S + rollcall.window_s(TIMEOUT_S) + SLACK_S, report
        # never reused: the next collective raises without waiting for its bound
        assert "is not used again: the collective after it cannot run" in report["again"]
        assert report["again_elapsed_s"] < TIMEOUT_S, report


def test_a_rank_stopped_before_its_transfers_is_named_by_its_peers_within_the_bound(tmp_path):
    """Issue 26 point 4: point-to-point transfers (a cooperative restore's) on a bounded group of 3
    ranks, each sending to and receiving from the others; rank 1 is SIGSTOPped before a phase of them.
    Ranks 0 and 2 name rank 1 (it never checked in at the phase's roll call, they both did) after
    the bound and the roll call's window, and the group refuses the next phase at once."""
    for report in run(tmp_path, "transfer", "stop"):
        assert report["happy"] == HAPPY["transfer"]
        assert report["ranks"] == [1], report
        assert "rank(s) [1] did not answer the test's collective within 3 s" in report["error"]
        assert TIMEOUT_S <= report["elapsed_s"] < TIMEOUT_S + rollcall.window_s(TIMEOUT_S) + SLACK_S, report
        assert "is not used again: the collective after it cannot run" in report["again"]
        assert report["again_elapsed_s"] < TIMEOUT_S, report


@pytest.mark.parametrize("collective", ["gather", "transfer"])
def test_a_killed_rank_is_named_too(tmp_path, collective):
    """Issue 26 point 4: rank 1 dies (SIGKILL) before an all-gather or a phase of transfers; ranks 0
    and 2 fail (gloo sees its connection closed, or the bound passes) and name rank 1 within the bound."""
    for report in run(tmp_path, collective, "kill"):
        assert report["ranks"] == [1], report
        assert "rank(s) [1] did not " in report["error"]
        assert report["elapsed_s"] < TIMEOUT_S + rollcall.window_s(TIMEOUT_S) + SLACK_S, report
        assert report["again"] is not None
