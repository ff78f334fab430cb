"""A notice too short for a save to storage, on two nodes with the fast tier (issue 24, item 6).

Checkpoints on S3 (the real moto server) behind a proxy that holds every shard upload
SLOW_UPLOAD_S seconds, so the supervisors measure a storage save of that length. Node 1 gets a
notice that leaves less than that: its supervisor sends the emergency step to the fast tier
instead (copied to node 0 before the deadline) and exits 143; node 0, which stays, writes the
step to storage, verified, and exits 143 too. Restarted, the job resumes from that step and ends
bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import re
import time

import pytest

from spotrun.checkpoint import catalog
from spotrun.storage import open_storage
from tests.e2e.test_fast_tier_replicas import (
    NODES,
    SAVE_INTERVAL,
    STEPS,
    WAIT_S,
    Job,
    assert_same_as_reference,
    reference_run,
    replicated_on,
)
from tests.support.fault_proxy import FaultProxy, upload_of
from tests.support.trainrun import read_log, sigterm

pytestmark = pytest.mark.slow

#: Seconds the proxy holds each shard upload: a storage save takes at least this long.
SLOW_UPLOAD_S = 8.0
#: The notice's grace period: less the supervisor's 5 s safety margin, 5 s are left for a save.
GRACE_PERIOD_S = 10
PREEMPTED_SAVED = 143


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory)


def test_a_notice_too_short_for_storage_commits_to_the_fast_tier_of_the_node_that_stays(
    reference, s3_bucket, tmp_path, processes
):
    with FaultProxy(s3_bucket.endpoint_url) as proxy:
        proxy.set_latency(SLOW_UPLOAD_S, upload_of(".safetensors"))
        job = Job(tmp_path, processes, "--step-sleep-s", "0.3", "--sync-saves")
        job.uri = f"{s3_bucket.uri}/job"
        job.supervisor_options = ["--s3-endpoint-url", proxy.url]
        job.drop_env = ("AWS_ENDPOINT_URL",)
        job.start(0)
        job.start(1, grace_period_s=GRACE_PERIOD_S)
        # step 20's save to storage (synchronous, SLOW_UPLOAD_S long) measured, and node 1's
        # fast-tier steps copied to node 0 since
        give_up = time.monotonic() + WAIT_S
        while True:
            rows = read_log(job.log_file) if job.log_file.exists() else []
            held = replicated_on(job.memory_dir(0))
            if rows and rows[-1]["step"] >= 23 and held and held[-1] >= 22:
                break
            assert all(p.poll() is None for p in job.nodes), "a node exited early" + job.outputs()
            assert time.monotonic() < give_up, "the job never got past step 22" + job.outputs()
            time.sleep(0.05)
        sigterm(job.nodes[1])
        proxy.set_latency(0.0)  # the decision is taken: node 0's write to storage need not wait
        assert job.wait() == [PREEMPTED_SAVED] * NODES, job.outputs()

    node_1, node_0 = job.log_text(1), job.log_text(0)
    decision = re.search(
        r"emergency checkpoint to the fast tier, copied to node\(s\) \S+: a save to storage would take "
        r"(\d+\.\d) s, more than the (\d+\.\d) s left; the fast tier takes (\d+\.\d) s",
        node_1,
    )
    assert decision, job.outputs()
    storage_s, left_s, memory_s = map(float, decision.groups())
    assert storage_s >= SLOW_UPLOAD_S > left_s >= memory_s
    held = re.search(r"the emergency checkpoint of step (\d+) is held by node\(s\) (\S+), which write it", node_1)
    assert held, job.outputs()
    step = int(held.group(1))
    assert 23 <= step < STEPS
    assert re.search(rf"the fast tier's step {step} is complete on storage", node_0), job.outputs()
    on_storage = {s.step: (s.status, s.reason) for s in catalog.list_steps(open_storage(job.ck))}
    assert on_storage[SAVE_INTERVAL] == ("complete", "periodic")
    assert on_storage[step] == ("complete", "emergency"), on_storage
    assert max(on_storage) == step

    # both nodes again, straight to the store: the job resumes from the emergency step, read from storage
    job.supervisor_options, job.drop_env = [], ()
    job.start(0, "node0-again.log")
    job.start(1, "node1-again.log")
    assert job.wait() == [0] * NODES, job.outputs()
    steps = [row["step"] for row in read_log(job.log_file)]
    assert steps == list(range(1, STEPS + 1)), steps  # on from the emergency step: none lost, none done twice
    assert f"resuming from step {step}" in job.log_text(0), job.outputs()
    assert_same_as_reference(reference, job)
    for node in range(NODES):
        assert list(job.memory_dir(node).iterdir()) == []


PREEMPTED_NOT_SAVED = 142


def test_a_short_notice_to_every_node_commits_nothing_and_says_the_copies_die_with_them(s3_bucket, tmp_path, processes):
    """Both nodes get the short notice: each node's emergency step reaches the other's tier, but that
    node is being preempted too, so no copy survives: each supervisor says so and exits 142 (not
    saved), and storage's newest step is still the periodic one."""
    with FaultProxy(s3_bucket.endpoint_url) as proxy:
        proxy.set_latency(SLOW_UPLOAD_S, upload_of(".safetensors"))
        job = Job(tmp_path, processes, "--step-sleep-s", "0.3", "--sync-saves")
        job.uri = f"{s3_bucket.uri}/job"
        job.supervisor_options = ["--s3-endpoint-url", proxy.url]
        job.drop_env = ("AWS_ENDPOINT_URL",)
        job.start(0, grace_period_s=GRACE_PERIOD_S)
        job.start(1, grace_period_s=GRACE_PERIOD_S)
        give_up = time.monotonic() + WAIT_S
        while True:
            rows = read_log(job.log_file) if job.log_file.exists() else []
            held = [replicated_on(job.memory_dir(n)) for n in range(NODES)]
            if rows and rows[-1]["step"] >= 23 and all(h and h[-1] >= 22 for h in held):
                break
            assert all(p.poll() is None for p in job.nodes), "a node exited early" + job.outputs()
            assert time.monotonic() < give_up, "the job never got past step 22" + job.outputs()
            time.sleep(0.05)
        for node in job.nodes:
            sigterm(node)
        assert job.wait() == [PREEMPTED_NOT_SAVED] * NODES, job.outputs()

    for node in range(NODES):
        assert re.search(
            r"the emergency checkpoint of step \d+ is held only by node\(s\) \S+, which are being preempted too: "
            r"it is lost with them",
            job.log_text(node),
        ), job.outputs()
    on_storage = {s.step: s.status for s in catalog.list_steps(open_storage(job.ck))}
    assert max(s for s, status in on_storage.items() if status == "complete") == SAVE_INTERVAL, on_storage
