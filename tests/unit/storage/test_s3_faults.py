"""Faults between the ranks and S3: 2-rank torchrun saves and restores through a proxy
(tests/support/fault_proxy.py) that fails chosen requests in front of the real moto server.

Each worker (tests/jobs/s3_ckpt.py) reports, per rank, whether each save succeeded,
how long it took and a digest of the saved or restored state.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from spotrun.checkpoint import catalog
from spotrun.checkpoint.restore import load_committed
from spotrun.storage import open_storage
from tests.support.ckpt_files import has_manifest
from tests.support.fault_proxy import ALL_KINDS, LOST_RESPONSE, SLOW_DOWN, FaultProxy, FaultRule, upload_of
from tests.support.paths import JOBS
from tests.support.rank_reports import run_ranks

pytestmark = pytest.mark.slow

WORKER = JOBS / "s3_ckpt.py"
PROXY_SEED = 20251130  # the proxy fixture's (conftest.py)
#: A hung save or collective shows up as this timeout instead of blocking the suite.
TORCHRUN_TIMEOUT_S = 240
#: Field case C10: a failing save must fail on every rank within this bound.
C10_BOUND_S = 60.0


@pytest.fixture
def uri(s3_bucket) -> str:
    return f"{s3_bucket.uri}/job"


def torchrun(
    proxy: FaultProxy, uri: str, out_dir: pathlib.Path, *args: str, env: dict[str, str] | None = None
) -> list[dict]:
    """Run the worker on 2 ranks through ``proxy``; each rank's report, by rank."""
    args = ["--uri", uri, "--out-dir", str(out_dir), *args]
    env = {"AWS_ENDPOINT_URL": proxy.url, **(env or {})}
    return run_ranks(2, WORKER, args, out_dir, env, timeout_s=TORCHRUN_TIMEOUT_S)[0]


def statuses(uri: str) -> dict[int, str]:
    """Step -> status, read straight from moto (not through the proxy)."""
    return {s.step: s.status for s in catalog.list_steps(open_storage(uri))}


def verify_checksums(uri: str, step: int) -> None:
    """Read every file of ``step`` as each rank would, checking sizes and SHA-256."""
    storage = open_storage(uri)
    for rank in range(2):
        load_committed(storage, step, rank, 2)


def test_saves_and_restores_stay_exact_with_10_percent_of_requests_failing(proxy, uri, tmp_path):
    # 503 SlowDown, 500, dropped connections, and answers lost after the server acted.
    proxy.set_rule(FaultRule(fraction=0.1, kinds=(*ALL_KINDS, LOST_RESPONSE)))
    steps = [1, 2, 3, 4, 5]
    saved = torchrun(proxy, uri, tmp_path / "save", "--save-steps", *map(str, steps))
    restored = torchrun(proxy, uri, tmp_path / "restore", "--restore")

    injected = proxy.injected
    print(f"{len(injected)} faults injected:", *[f"{i.kind} {i.method} {i.path}" for i in injected], sep="\n  ")
    assert {i.kind for i in injected} == {*ALL_KINDS, LOST_RESPONSE}, "every kind of fault must have happened"
    for rank in range(2):
        assert [s["ok"] for s in saved[rank]["saves"]] == [True] * len(steps), saved[rank]["saves"]
        assert restored[rank]["restored"] == {"step": steps[-1], "digest": saved[rank]["saves"][-1]["digest"]}
    assert statuses(uri) == {step: "complete" for step in steps}


def test_save_fails_within_its_deadline_on_every_rank_when_every_request_fails(proxy, uri, tmp_path):
    # Step 1 saves cleanly; every request of the step-2 save fails, in every way.
    proxy.set_rule(FaultRule(fraction=1.0, match=lambda r: "/step-000000002/" in r.path))
    timeout_s = 8.0
    saved = torchrun(proxy, uri, tmp_path / "save", "--save-steps", "1", "2", "--save-timeout-s", str(timeout_s))
    print(json.dumps(saved, indent=1))
    assert {i.kind for i in proxy.injected} == set(ALL_KINDS)
    for rank in range(2):
        first, second = saved[rank]["saves"]
        assert first["ok"], first
        assert not second["ok"]
        # Rank 0 may fail first (its check for an existing commit), and then tells rank 1.
        assert "save of step 2 failed on rank" in second["error"]
        assert "nothing was committed" in second["error"]
        # Without the save deadline each upload would retry for its own 120 s.
        assert second["elapsed_s"] < C10_BOUND_S, second
    storage = open_storage(uri)
    assert not has_manifest(storage, 2)
    assert statuses(uri).get(1) == "complete" and statuses(uri).get(2) != "complete"

    proxy.set_rule(FaultRule())
    restored = torchrun(proxy, uri, tmp_path / "restore", "--restore")
    for rank in range(2):
        assert restored[rank]["restored"] == {"step": 1, "digest": saved[rank]["saves"][0]["digest"]}


@pytest.mark.parametrize(
    "failures, succeeds", [(6, True), (50, False)], ids=["6-slowdowns-succeeds", "50-slowdowns-fails"]
)
def test_slowdowns_on_one_rank_are_retried_until_the_emergency_deadline(proxy, uri, tmp_path, failures, succeeds):
    """Field case C10.

    Rank 1's uploads get 503 SlowDown ``failures`` times during an emergency save whose
    deadline (as the supervisor writes it) is 25 s away: 30 s grace - 5 s margin."""
    proxy.set_rule(FaultRule(count=failures, kinds=(SLOW_DOWN,), match=upload_of("rank-00001.")))
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    saved = torchrun(
        proxy,
        uri,
        tmp_path / "save",
        "--save-steps",
        "1",
        "--emergency-deadline-s",
        "25",
        env={"SPOTRUN_CONTROL_DIR": str(control_dir)},
    )
    injected = proxy.injected
    reports = [saved[rank]["saves"][0] for rank in range(2)]
    print(f"{len(injected)} SlowDowns injected; reports:", json.dumps(reports, indent=1))
    assert injected and all("rank-00001." in i.path for i in injected)
    if succeeds:
        assert len(injected) == failures
        assert all(r["ok"] for r in reports), reports
        assert statuses(uri) == {1: "complete"}
        verify_checksums(uri, 1)
        return
    assert len(injected) < failures, "the deadline must stop the retries"
    for report in reports:
        assert not report["ok"]
        assert "failed on rank(s) [1]" in report["error"] and "SlowDown" in report["error"], report
        assert report["elapsed_s"] < C10_BOUND_S, report
    assert not has_manifest(open_storage(uri), 1)
    assert statuses(uri).get(1) != "complete"
