"""Issue 8, section 9: one preemption-and-resume cycle on a real Ceph RADOS Gateway.

`spotrun run --checkpoint-uri s3://... -- torchrun --nproc-per-node 2 ... train_gpt` against
RGW (``tests/rgw_server.py``, installed and started by the test session), SIGTERM at a
random step: exit 143 with a complete emergency checkpoint; the restart resumes from it
and finishes with per-step losses and final tensors bit-identical to an uninterrupted
run. Unlike moto, RGW checks the credentials the supervisor and the workers send (they
come from the environment) and overwrites on a conditional multipart completion, which
spotrun never uses.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from tests import trainrun
from tests.rgw_server import rgw_bucket, rgw_endpoint  # noqa: F401  (fixtures)
from tests.test_s3_end_to_end import spotrun_ls
from tests.trainrun import read_log, sigterm, start_supervised, torchrun_command, wait_for_step

STEPS = trainrun.REFERENCE_STEPS  # the shared reference run (conftest.py)
SAVE_INTERVAL = trainrun.REFERENCE_SAVE_INTERVAL
PREEMPTED = 143
WAIT_S = 600


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_9_preempted_training_on_rgw_resumes_exactly(reference, rgw_bucket, tmp_path, processes):
    uri = f"{rgw_bucket.uri}/team/run-1"
    endpoint = ["--s3-endpoint-url", rgw_bucket.endpoint_url]
    env_without_endpoint = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    log_file = tmp_path / "train.jsonl"

    def launch(name: str, *extra: str):
        proc = start_supervised(
            uri, torchrun_command(STEPS, SAVE_INTERVAL, log_file, *extra),
            extra_options=[*endpoint, "--notice", "none"], drop_env=("AWS_ENDPOINT_URL",),
            log_path=tmp_path / f"{name}.log",
        )
        processes.append(proc)
        return proc

    preempt_at = random.Random().randint(3, STEPS - 4)
    print(f"preempting at step {preempt_at}")
    proc = launch("first", "--step-sleep-s", "0.05")
    wait_for_step(log_file, preempt_at, proc)
    sigterm(proc)
    assert proc.wait(timeout=WAIT_S) == PREEMPTED, (tmp_path / "first.log").read_text()[-3000:]
    listed = json.loads(spotrun_ls(uri, "--json", *endpoint, env=env_without_endpoint))
    emergency = [row for row in listed if row["reason"] == "emergency"]
    assert [row["status"] for row in emergency] == ["complete"]
    assert emergency[0]["step"] >= preempt_at

    ran_before = len(read_log(log_file))
    proc = launch("second")
    assert proc.wait(timeout=WAIT_S) == 0, (tmp_path / "second.log").read_text()[-3000:]
    resumed = [row["step"] for row in read_log(log_file)[ran_before:]]
    assert resumed == list(range(emergency[0]["step"] + 1, STEPS + 1))
    trainrun.assert_same_as_reference(*reference[:2], uri, log_file, STEPS)
