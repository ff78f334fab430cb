"""Issue 8, section 9: one preemption-and-resume cycle on a real Ceph RADOS Gateway.

`spotrun run --checkpoint-uri s3://... -- torchrun --nproc-per-node 2 ... train_gpt` against
RGW (``tests/support/rgw_server.py``, installed and started by the test session), SIGTERM at a
random step: exit 143 with a complete emergency checkpoint; the restart resumes from it
and finishes with per-step losses and final tensors bit-identical to an uninterrupted
run. Unlike moto, RGW checks the credentials the supervisor and the workers send (they
come from the environment); the endpoint reaches them only through ``--s3-endpoint-url``.
"""

from __future__ import annotations

import pytest

from tests.support.trainrun import preempt_and_resume_exactly


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_9_preempted_training_on_rgw_resumes_exactly(reference, rgw_bucket, tmp_path, processes):
    preempt_and_resume_exactly(
        reference,
        f"{rgw_bucket.uri}/team/run-1",
        tmp_path,
        processes,
        extra_options=["--s3-endpoint-url", rgw_bucket.endpoint_url],
        drop_env=("AWS_ENDPOINT_URL",),
    )
