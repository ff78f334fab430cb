"""End to end: cloud preemption notices from fake metadata servers on 127.0.0.1 reach a
2-rank `spotrun run --notice <cloud> -- torchrun ... train_gpt` run.

A stop notice (AWS spot instance-action, GCP instance/preempted, Azure Preempt event) makes
the job save and `spotrun run` exit 143; the restart on a "new VM" (a fresh fake with no
notice) resumes exactly: the same per-step losses and bit-identical final model and
optimizer tensors as one uninterrupted run. Azure's event is acknowledged only after the
commit. An AWS rebalance recommendation takes an ordinary checkpoint and training goes on.
Hostile metadata servers never stop training, and each problem is logged once.

The sources keep their default periods (AWS polls every 2 s, Azure every 1 s, GCP long
polls), so the runs sleep a little after every step to leave the notice time to arrive.
"""

from __future__ import annotations

import calendar
import collections
import json
import re
import time

import pytest

from spotrun.drill.clouds.aws import FakeAws
from spotrun.drill.clouds.azure import FakeAzure
from spotrun.drill.clouds.gcp import FakeGcp
from tests.support import trainrun
from tests.support.ckpt_files import manifest_path
from tests.support.trainrun import (
    assert_same_as_reference,
    ls_json,
    read_log,
    start_supervised,
    torchrun_command,
    wait_for_step,
)

pytestmark = pytest.mark.slow

STEPS = trainrun.REFERENCE_STEPS  # the shared reference run (conftest.py)
SAVE_INTERVAL = trainrun.REFERENCE_SAVE_INTERVAL
#: Pause after each step: 30 steps then last about 6 s, several AWS polls.
STEP_SLEEP_S = "0.2"
#: The notice is announced once the training log reaches this step.
NOTICE_AT_STEP = 3
PREEMPTED = 143
_COMMITTED = re.compile(r"emergency checkpoint of step (\d+) is complete")
_PROBLEM = re.compile(r" WARNING (\w+ notices: .*)$")


def where_to_look(cloud: str, fake) -> tuple[dict[str, str], list[str]]:
    """Environment and options pointing `spotrun run --notice CLOUD` at ``fake``: the
    variables the clouds' SDKs read for AWS and GCP, the option for Azure."""
    if cloud == "aws":
        return {"AWS_EC2_METADATA_SERVICE_ENDPOINT": fake.url}, []
    if cloud == "gcp":
        return {"GCE_METADATA_HOST": fake.host_port}, []
    return {}, ["--azure-metadata-endpoint", fake.url]  # the VM name is asked from the fake's IMDS


def start_run(ck: str, log_file, supervisor_log, cloud: str, fake, processes):
    env, options = where_to_look(cloud, fake)
    proc = start_supervised(
        ck,
        torchrun_command(STEPS, SAVE_INTERVAL, log_file, "--step-sleep-s", STEP_SLEEP_S),
        env=env,
        extra_options=["--notice", cloud, *options],
        log_path=supervisor_log,
        drop_env=tuple(name for name in ("AWS_EC2_METADATA_SERVICE_ENDPOINT", "GCE_METADATA_HOST") if name not in env),
    )
    processes.append(proc)
    return proc


def log_time_unix_s(text: str, message: str) -> float:
    """When the supervisor logged the line containing ``message`` (seconds since the epoch)."""
    line = next(line for line in text.splitlines() if message in line)
    stamp = re.match(r"spotrun: (\S+)Z ", line).group(1)  # 2026-11-30T07:33:41.902
    whole, millis = stamp.split(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + int(millis) / 1000


FAKES = {"aws": FakeAws, "gcp": FakeGcp, "azure": FakeAzure}


def announce(cloud: str, fake) -> str:
    """Serve a stop notice; returns the notice kind the supervisor logs."""
    if cloud == "aws":
        fake.set_instance_action("terminate", time.time() + 120)
        return "spot instance-action terminate"
    if cloud == "gcp":
        fake.set_preempted()
        return "instance/preempted TRUE"
    event = fake.add_event("Preempt", not_before_unix_s=time.time() + 60)
    return f"scheduled event Preempt {event['EventId']}"


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_cloud_notice_saves_exits_143_and_resumes_exactly(reference, tmp_path, processes, cloud):
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    first_log, restart_log = tmp_path / "supervisor-1.log", tmp_path / "supervisor-2.log"
    with FAKES[cloud]() as fake:
        proc = start_run(ck, log_file, first_log, cloud, fake, processes)
        wait_for_step(log_file, NOTICE_AT_STEP, proc)
        kind = announce(cloud, fake)
        assert proc.wait(timeout=300) == PREEMPTED
        posts = fake.requests_to(FakeAzure.EVENTS_PATH, "POST") if cloud == "azure" else []

    text = first_log.read_text(errors="replace")
    assert f"preemption notice: {kind} from {cloud}" in text
    committed = [int(s) for s in _COMMITTED.findall(text)]
    assert len(committed) == 1, text
    step = committed[0]
    assert NOTICE_AT_STEP <= step < STEPS
    assert read_log(log_file)[-1]["step"] == step  # training stopped at the saved step
    listed = {row["step"]: row for row in ls_json(ck)}
    assert listed[step]["status"] == "complete" and listed[step]["world_size"] == 2
    assert listed[step]["reason"] in ("emergency", "periodic")  # periodic if the notice came at step 10 or 20

    if cloud == "azure":
        event_id = kind.rsplit(" ", 1)[1]
        manifest_file = manifest_path(tmp_path / "ck", step)
        created_unix_s = json.loads(manifest_file.read_text())["created_unix_s"]
        assert len(posts) == 1, posts  # acknowledged exactly once
        assert json.loads(posts[0].body) == {"StartRequests": [{"EventId": event_id}]}
        assert posts[0].headers.get("metadata") == "true"
        # After the commit: after the manifest was written, and after the supervisor found the
        # step complete on storage (its log line, stamped to the millisecond, rounded down).
        assert posts[0].received_unix_s > created_unix_s
        assert posts[0].received_unix_s >= manifest_file.stat().st_mtime
        assert posts[0].received_unix_s >= log_time_unix_s(text, f"emergency checkpoint of step {step} is complete")

    rows_before = len(read_log(log_file))
    with FAKES[cloud]() as fresh:  # the restart runs on a new VM: no notice there
        proc = start_run(ck, log_file, restart_log, cloud, fresh, processes)
        assert proc.wait(timeout=600) == 0
        assert fresh.requests, "the restart never asked the metadata server"
    assert f"resuming from step {step} " in restart_log.read_text(errors="replace")
    assert read_log(log_file)[rows_before]["step"] == step + 1
    assert_same_as_reference(reference, ck, log_file)


def test_aws_rebalance_recommendation_takes_an_ordinary_checkpoint(reference, tmp_path, processes):
    ck, log_file, supervisor_log = str(tmp_path / "ck"), tmp_path / "train.jsonl", tmp_path / "supervisor.log"
    with FakeAws() as fake:
        proc = start_run(ck, log_file, supervisor_log, "aws", fake, processes)
        wait_for_step(log_file, NOTICE_AT_STEP, proc)
        fake.set_rebalance(time.time())
        assert proc.wait(timeout=300) == 0

    text = supervisor_log.read_text(errors="replace")
    assert "preemption notice:" not in text
    assert text.count("rebalance from aws: asking the workers for an ordinary checkpoint") == 1
    requested = [row for row in ls_json(ck) if row["reason"] == "requested"]
    assert len(requested) == 1 and requested[0]["status"] == "complete", requested
    assert NOTICE_AT_STEP <= requested[0]["step"] <= STEPS
    assert read_log(log_file)[-1]["step"] == STEPS  # training went on to the end
    assert_same_as_reference(reference, ck, log_file)


def test_hostile_metadata_servers_never_stop_training(reference, tmp_path, processes):
    """Bad JSON and wrong types (AWS), an unknown value (GCP), wrong types and an event for
    another VM (Azure), then every metadata server stopped mid-run: training runs to the end
    undisturbed, and each problem is logged once although every source polls again and again."""
    ck, log_file, supervisor_log = str(tmp_path / "ck"), tmp_path / "train.jsonl", tmp_path / "supervisor.log"
    aws, gcp, azure = FakeAws(), FakeGcp(), FakeAzure(vm_name="vm-1")
    try:
        aws.misbehave(FakeAws.INSTANCE_ACTION_PATH, body=b'{"action": "terminate", "time": ')
        aws.misbehave(FakeAws.REBALANCE_PATH, body=b'{"noticeTime": 1700000000}')
        gcp.misbehave(FakeGcp.PREEMPTED_PATH, body="MAYBE", headers={"Metadata-Flavor": "Google"})
        azure.add_event("Preempt", resources=["vm-2"], not_before_unix_s=time.time() + 60)
        azure.add_event("Preempt", resources="vm-1", not_before_unix_s=time.time() + 60)
        azure.add_event("Preempt", NotBefore=1700000000)
        proc = start_supervised(
            ck,
            torchrun_command(STEPS, SAVE_INTERVAL, log_file, "--step-sleep-s", STEP_SLEEP_S),
            env={"AWS_EC2_METADATA_SERVICE_ENDPOINT": aws.url, "GCE_METADATA_HOST": gcp.host_port},
            extra_options=[
                "--notice",
                "aws,gcp,azure",
                "--azure-metadata-endpoint",
                azure.url,
                "--azure-vm-name",
                "vm-1",
            ],
            log_path=supervisor_log,
        )
        processes.append(proc)
        # Every source answered its hostile document at least twice before the servers stop.
        for fake, path in (
            (aws, FakeAws.INSTANCE_ACTION_PATH),
            (gcp, FakeGcp.PREEMPTED_PATH),
            (azure, FakeAzure.EVENTS_PATH),
        ):
            assert fake.wait_for(lambda f=fake, p=path: len(f.requests_to(p, "GET")) >= 2, timeout_s=120)
        wait_for_step(log_file, 8, proc)
    finally:
        for fake in (aws, gcp, azure):
            fake.close()
    assert proc.wait(timeout=300) == 0

    text = supervisor_log.read_text(errors="replace")
    assert "preemption notice:" not in text
    assert read_log(log_file)[-1]["step"] == STEPS
    problems = collections.Counter(m.group(1) for line in text.splitlines() if (m := _PROBLEM.search(line)))
    repeated = {p: n for p, n in problems.items() if n > 1}
    assert not repeated, repeated

    def logged(source: str, *parts: str) -> int:
        return sum(n for p, n in problems.items() if p.startswith(f"{source} notices:") and all(s in p for s in parts))

    assert logged("aws", "spot/instance-action is not valid JSON") == 1
    assert logged("aws", "rebalance recommendation field 'noticeTime'", "not str") == 1
    assert logged("gcp", "unknown value 'MAYBE'") == 1
    assert logged("azure", "field 'Resources'", "not list") == 1
    assert logged("azure", "NotBefore is not a string") == 1
    # The servers stopped: each source says once that it cannot reach its server.
    assert logged("aws", "refused") == 1
    assert logged("azure", "refused") == 1
    assert logged("gcp", "refused", FakeGcp.PREEMPTED_PATH) == 1
    assert logged("gcp", "refused", FakeGcp.MAINTENANCE_PATH) == 1
    assert_same_as_reference(reference, ck, log_file)
