"""End to end on S3: everything that works on a local directory works on ``s3://``.

* `spotrun run --checkpoint-uri s3://... -- torchrun --nproc-per-node 2 ... train_gpt`
  against the real moto server, preempted by SIGTERM, restarted: the per-step losses and
  the final model and optimizer tensors are bit-identical to an uninterrupted run. The
  endpoint reaches the supervisor and the workers only through ``--s3-endpoint-url``.
* `spotrun ls` prints the same for the S3 checkpoints as for a local copy of them.
* A corrupted shard on S3 makes the restart fall back to the previous complete step.
* Newest-complete discovery, restore and fallback give the same results on both backends.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import data_file_key, shard_name, step_dir
from spotrun.storage import open_storage
from tests.support import trainrun
from tests.support.ckpt_files import shard_key
from tests.support.s3_server import make_client
from tests.support.trainrun import (
    assert_same_as_reference,
    read_log,
    sigterm,
    start_supervised,
    torchrun_command,
    wait_for_step,
)

STEPS = trainrun.REFERENCE_STEPS  # the shared reference run (conftest.py)
SAVE_INTERVAL = trainrun.REFERENCE_SAVE_INTERVAL
PREEMPTED = 143
WAIT_S = 600
SHA256 = re.compile(r"\b[0-9a-f]{64}\b")


def spotrun_ls(uri: str, *options: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "ls", uri, *options], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def mirror_to_directory(client, bucket: str, prefix: str, directory: pathlib.Path) -> None:
    """Copy every object under ``s3://bucket/prefix/`` into ``directory``, keys as paths."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            target = directory / obj["Key"][len(prefix) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())


def flip_last_byte(client, bucket: str, key: str) -> None:
    """Corrupt an object in place: same size, one byte changed."""
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


@pytest.mark.slow
def test_preempted_training_on_s3_resumes_exactly(reference, s3_bucket, tmp_path):
    prefix = "team/run-1"
    uri = f"{s3_bucket.uri}/{prefix}"
    endpoint = ["--s3-endpoint-url", s3_bucket.endpoint_url]
    # Only --s3-endpoint-url tells spotrun and the workers where the server is.
    env_without_endpoint = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    log_file = tmp_path / "train.jsonl"

    def launch(name: str, *extra: str, options: tuple[str, ...] = ()):
        return start_supervised(
            uri,
            torchrun_command(STEPS, SAVE_INTERVAL, log_file, *extra),
            extra_options=[*endpoint, *options],
            drop_env=("AWS_ENDPOINT_URL",),
            log_path=tmp_path / f"{name}.log",
        )

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

    proc = launch("second")
    assert proc.wait(timeout=WAIT_S) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert_same_as_reference(reference, uri, log_file)

    # `spotrun ls` on S3 shows exactly what it shows for the same objects on a disk.
    client = make_client(s3_bucket.endpoint_url)
    local_copy = tmp_path / "copy"
    mirror_to_directory(client, s3_bucket.name, prefix, local_copy)
    for options in (["--json"], []):
        on_s3 = spotrun_ls(uri, *options, *endpoint, env=env_without_endpoint)
        assert on_s3 == spotrun_ls(str(local_copy), *options)
        if options:
            complete = {row["step"] for row in json.loads(on_s3) if row["status"] == "complete"}
            assert complete >= {10, 20, 30}

    # A corrupted shard of the newest step: the next start falls back to the step before.
    steps_before = [s.step for s in catalog.list_steps(open_storage(uri)) if s.status == catalog.COMPLETE]
    flip_last_byte(client, s3_bucket.name, f"{prefix}/{shard_key(open_storage(uri), STEPS, 1)}")
    fallback_step = steps_before[-2]
    ran_before = len(read_log(log_file))
    proc = launch("third", options=("--rerun-finished",))  # the same command finished: the skip reads no checksums
    assert proc.wait(timeout=WAIT_S) == 0
    log_text = (tmp_path / "third.log").read_text()
    assert f"checkpoint step {STEPS} failed verification" in log_text
    assert f"falling back to step {fallback_step}" in log_text
    rerun = [row["step"] for row in read_log(log_file)[ran_before:]]
    assert rerun == list(range(fallback_step + 1, STEPS + 1))
    assert_same_as_reference(reference, uri, log_file)


# --- the same behaviour on both backends, in one process ------------------------------


def scenario(uri: str, caplog: pytest.LogCaptureFixture) -> dict:
    """Save steps 1-3, leave an uncommitted step 4, corrupt step 3, restore; what a user sees."""
    weights = {"w": torch.zeros(64), "note": "x"}
    ckpt = spotrun.Checkpointer(state={"weights": weights}, uri=uri, handle_signals=False)
    saved = {}
    for step in (1, 2, 3):
        weights["w"] = torch.full((64,), float(step))
        ckpt.save(step, reason="periodic")
        saved[step] = weights["w"].clone()
    storage = ckpt.storage
    storage.put(data_file_key(4, 0, shard_name(0, ckpt.incarnation), None), b"a shard whose save never committed")
    newest_before = catalog.newest_complete(storage).step
    shard = shard_key(storage, 3, 0)
    data = bytearray(storage.get(shard))
    data[-1] ^= 0xFF
    storage.put(shard, bytes(data))

    restored_weights = {"w": torch.zeros(64), "note": ""}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        restored = spotrun.Checkpointer(state={"weights": restored_weights}, uri=uri, handle_signals=False).restore()
    rows = json.loads(spotrun_ls(uri, "--json"))
    return {
        "newest_before": newest_before,
        "restored": restored,
        "restored_matches_save": torch.equal(restored_weights["w"], saved[restored]),
        "warnings": [SHA256.sub("<sha256>", r.getMessage().replace(storage.uri, "ROOT")) for r in caplog.records],
        # Sizes and times differ between two runs (manifests hold times), so each listing
        # is checked against its own storage and the rest compared across backends.
        "ls": [{k: v for k, v in row.items() if k not in ("created_unix_s", "size_bytes")} for row in rows],
        "ls_sizes_are_stored_sizes": all(
            row["size_bytes"] == sum(o.size_bytes for o in storage.list(f"{step_dir(row['step'])}/")) for row in rows
        ),
        "newest_after": catalog.newest_complete(storage).step,
    }


def test_discovery_restore_and_fallback_are_the_same_on_local_and_s3(s3_bucket, tmp_path, caplog):
    local = scenario(str(tmp_path / "ck"), caplog)
    on_s3 = scenario(f"{s3_bucket.uri}/job", caplog)
    assert local == on_s3
    assert (local["newest_before"], local["restored"], local["newest_after"]) == (3, 2, 2)
    assert local["restored_matches_save"] and local["ls_sizes_are_stored_sizes"]
    assert any("step 3 failed verification" in w and "falling back to step 2" in w for w in local["warnings"])
    assert [(row["step"], row["status"]) for row in local["ls"]] == [
        (1, "complete"),
        (2, "complete"),
        (3, "corrupt"),
        (4, "incomplete"),
    ]
