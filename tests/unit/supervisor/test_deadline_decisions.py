"""Deadline-aware decisions: the supervisor saves only when the save can commit in time.

2-rank example trainer under `spotrun run` with checkpoints on S3 (the real moto server)
behind a proxy that holds every shard upload for a few seconds (a slow link to the store),
so each save takes several seconds and the supervisor measures that.

* A notice whose deadline is shorter than the measured save: the supervisor says it will
  not save and why, the workers stop at the next step boundary without starting a save,
  the exit is 142, nothing half-written is left, and the newest complete checkpoint (the
  last periodic one) is confirmed. A later notice with time enough is saved (143), the
  estimate then coming from the manifest of the step the job resumed from. The job ends
  bit-identical to an uninterrupted run. (Synchronous periodic saves, so that no save is in
  flight at the notice.)
* A notice during a background periodic save, with time to finish that save but not for one
  more: the save in flight commits first, then the workers stop without another save.
"""

from __future__ import annotations

import re
import time

import pytest

from spotrun.checkpoint import catalog
from spotrun.storage import open_storage
from tests.support import trainrun
from tests.support.fault_proxy import FaultProxy, upload_of
from tests.support.trainrun import read_log, sigterm, start_supervised, torchrun_command, wait_for_step

pytestmark = pytest.mark.slow

STEPS = trainrun.REFERENCE_STEPS
SAVE_INTERVAL = trainrun.REFERENCE_SAVE_INTERVAL
PREEMPTED_SAVED, PREEMPTED_NOT_SAVED = 143, 142
WAIT_S = 300
#: Seconds the proxy holds each shard upload: every save takes at least this long.
SLOW_UPLOAD_S = 6.0
_ESTIMATE = re.compile(r"would take (\d+\.\d) s .* more than the (\d+\.\d) s left")


@pytest.fixture
def slow_store(s3_bucket):
    """(checkpoint URI, proxy) with every shard upload held SLOW_UPLOAD_S seconds."""
    with FaultProxy(s3_bucket.endpoint_url) as proxy:
        proxy.set_latency(SLOW_UPLOAD_S, upload_of(".safetensors"))
        yield f"{s3_bucket.uri}/job", proxy


def launch(uri: str, proxy: FaultProxy, log_file, supervisor_log, grace_period_s: float, processes, *extra: str):
    proc = start_supervised(
        uri,
        torchrun_command(STEPS, SAVE_INTERVAL, log_file, "--step-sleep-s", "0.1", *extra),
        grace_period_s=grace_period_s,
        extra_options=["--s3-endpoint-url", proxy.url, "--notice", "none"],
        log_path=supervisor_log,
        drop_env=("AWS_ENDPOINT_URL",),
    )
    processes.append(proc)
    return proc


def steps_on_storage(uri: str) -> dict[int, str]:
    return {s.step: s.status for s in catalog.list_steps(open_storage(uri))}


def test_no_save_when_it_cannot_commit_in_time_then_exact_resume(reference, slow_store, tmp_path, processes):
    uri, proxy = slow_store
    log_file = tmp_path / "train.jsonl"

    # 1. Periodic saves at steps 10 and 20 took > SLOW_UPLOAD_S each; the notice leaves
    #    10 - 5 (safety margin) = 5 s: not enough to save, enough to stop. No save is started.
    #    Synchronous saves: a background save of SLOW_UPLOAD_S would still be in flight at step
    #    23 (training runs on during it); that case is the next test's.
    first_log = tmp_path / "first.log"
    proc = launch(uri, proxy, log_file, first_log, 10, processes, "--sync-saves")
    wait_for_step(log_file, 23, proc, timeout_s=WAIT_S)
    uploads_before = len(proxy.seen(upload_of(".safetensors")))
    sigterm(proc)
    assert proc.wait(timeout=WAIT_S) == PREEMPTED_NOT_SAVED, first_log.read_text()[-3000:]
    text = first_log.read_text()
    decision = _ESTIMATE.search(text)
    assert decision, text[-3000:]
    estimate_s, left_s = map(float, decision.groups())
    assert estimate_s >= SLOW_UPLOAD_S and left_s <= 5.0
    assert "NOT saving" in text and "from 2 saves of this launch" in text
    assert "the newest complete checkpoint is step 20" in text
    assert "deadline passed" not in text  # the workers stopped on their own, in time
    assert len(proxy.seen(upload_of(".safetensors"))) == uploads_before  # no save was started
    assert steps_on_storage(uri) == {10: "complete", 20: "complete"}  # nothing half-written
    stopped_at = read_log(log_file)[-1]["step"]
    assert 23 <= stopped_at < 30

    # 2. The restart resumes from step 20; a notice with 60 - 5 s left is saved, the
    #    estimate coming from the manifest of step 20 (nothing saved in this launch yet).
    second_log = tmp_path / "second.log"
    proc = launch(uri, proxy, log_file, second_log, 60, processes, "--sync-saves")
    wait_for_step(log_file, 25, proc, timeout_s=WAIT_S)
    sigterm(proc)
    assert proc.wait(timeout=WAIT_S) == PREEMPTED_SAVED, second_log.read_text()[-3000:]
    text = second_log.read_text()
    assert "resuming from step 20" in text
    assert "emergency checkpoint requested: estimated" in text and "from the manifest of step 20" in text
    emergency = max(steps_on_storage(uri))
    assert 25 <= emergency < 30 and steps_on_storage(uri)[emergency] == "complete"

    # 3. The job finishes; the result is bit-identical to an uninterrupted run.
    third_log = tmp_path / "third.log"
    proc = launch(uri, proxy, log_file, third_log, 60, processes)
    assert proc.wait(timeout=WAIT_S) == 0, third_log.read_text()[-3000:]
    trainrun.assert_same_as_reference(reference, uri, log_file)


def test_a_save_in_progress_commits_before_the_workers_stop(slow_store, tmp_path, processes):
    uri, proxy = slow_store
    log_file, supervisor_log = tmp_path / "train.jsonl", tmp_path / "supervisor.log"
    # 15 - 5 s left: enough to finish the save of step 20 (about SLOW_UPLOAD_S = 6 s) and
    # stop, not enough for one more save after it (about 12 s in all).
    proc = launch(uri, proxy, log_file, supervisor_log, 15, processes)
    give_up = time.monotonic() + WAIT_S
    while not proxy.seen(upload_of("step-000000020/rank-")):
        assert proc.poll() is None and time.monotonic() < give_up, supervisor_log.read_text()[-3000:]
        time.sleep(0.02)
    sigterm(proc)  # the save of step 20 is being uploaded now
    assert proc.wait(timeout=WAIT_S) == PREEMPTED_NOT_SAVED, supervisor_log.read_text()[-3000:]
    text = supervisor_log.read_text()
    assert "NOT saving" in text and "after the save of step 20 in progress commits" in text, text[-3000:]
    assert "the newest complete checkpoint is step 20" in text
    assert "deadline passed" not in text
    assert steps_on_storage(uri) == {10: "complete", 20: "complete"}
    assert 20 <= read_log(log_file)[-1]["step"] < 30
