"""Storage preflight: before training starts, a misconfigured storage fails in seconds
with a message naming the cause; ``--s3-endpoint-url`` reaches the supervisor and workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from spotrun.errors import ConfigError, ObjectNotFoundError, StorageError, StoragePermissionError
from spotrun.storage import open_storage, parse_location
from spotrun.storage.s3_location import S3_ENDPOINT_URL
from spotrun.supervisor.config import SupervisorConfig
from spotrun.supervisor.launch import plan_launch
from spotrun.supervisor.preflight import PROBE_PREFIX, check_storage
from tests.support.s3_server import free_loopback_port, make_client

#: A check that hung would take the default retry deadline (120 s) instead.
QUICK_S = 30.0


def spotrun(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spotrun", *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("spotrun: error: ")]


# --- local directories ---------------------------------------------------------------


def test_local_directory_passes_and_keeps_no_probe(tmp_path):
    result = check_storage(parse_location(str(tmp_path / "ck")))
    assert result.uri == str(tmp_path / "ck")
    assert os.listdir(tmp_path / "ck") == []


def test_local_path_that_cannot_be_written_names_the_cause(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(StorageError) as caught:
        check_storage(parse_location(str(tmp_path / "a-file" / "ck")))
    message = caught.value.strerror
    assert "preflight" in message and "cannot write a probe object" in message
    assert "Not a directory" in message and str(tmp_path / "a-file" / "ck") in message


# --- S3 ------------------------------------------------------------------------------


def test_s3_prefix_passes_and_keeps_no_probe(s3_bucket):
    check_storage(parse_location(f"{s3_bucket.uri}/job"))
    assert make_client(s3_bucket.endpoint_url).list_objects_v2(Bucket=s3_bucket.name).get("KeyCount") == 0


def test_missing_bucket(s3_bucket):
    with pytest.raises(ObjectNotFoundError, match=f"bucket '{s3_bucket.name}-gone' does not exist"):
        check_storage(parse_location(f"{s3_bucket.uri}-gone/job"))


def test_missing_credentials(s3_bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StoragePermissionError, match="no AWS credentials found"):
        check_storage(parse_location(f"{s3_bucket.uri}/job"))


def test_access_denied(s3_bucket, moto_endpoint_enforcing_auth):
    with pytest.raises(StoragePermissionError, match=r"access denied \(InvalidAccessKeyId\)"):
        check_storage(parse_location(f"{s3_bucket.uri}/job", endpoint_url=moto_endpoint_enforcing_auth))


def test_endpoint_not_listening(s3_bucket):
    dead = f"http://127.0.0.1:{free_loopback_port()}"
    started_s = time.monotonic()
    with pytest.raises(StorageError, match=f"cannot connect to endpoint {dead}"):
        check_storage(parse_location(f"{s3_bucket.uri}/job", endpoint_url=dead), timeout_s=2.0)
    assert time.monotonic() - started_s < QUICK_S


def test_probe_is_not_a_checkpoint_step(s3_bucket):
    storage = open_storage(f"{s3_bucket.uri}/job")
    storage.put(f"{PROBE_PREFIX}left-by-a-killed-check", b"probe")
    done = spotrun("ls", f"{s3_bucket.uri}/job", "--json")
    assert (done.returncode, done.stdout.strip()) == (0, "[]")


# --- command line --------------------------------------------------------------------


def test_run_fails_before_launching_anything(s3_bucket, tmp_path):
    marker = tmp_path / "launched"
    done = spotrun(
        "run",
        "--checkpoint-uri",
        f"{s3_bucket.uri}-gone/job",
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
    )
    assert done.returncode == 2
    [line] = error_lines(done.stderr)
    assert "preflight" in line and f"bucket '{s3_bucket.name}-gone' does not exist" in line
    assert "Traceback" not in done.stderr
    assert not marker.exists(), "the command must not start when the storage is unusable"


def test_preflight_command_uses_the_endpoint_option(s3_bucket):
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    done = spotrun("preflight", f"{s3_bucket.uri}/job", "--s3-endpoint-url", s3_bucket.endpoint_url, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ok: {s3_bucket.uri}/job can be written, read, listed and deleted")


def test_preflight_command_reports_a_local_failure(tmp_path):
    (tmp_path / "a-file").write_text("")
    done = spotrun("preflight", str(tmp_path / "a-file" / "ck"))
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("spotrun: error: ") and "Not a directory" in line


@pytest.mark.parametrize("url", ["minio:9000", "ftp://host", "http://"])
def test_malformed_endpoint_is_a_config_error(url):
    with pytest.raises(ConfigError, match="--s3-endpoint-url"):
        SupervisorConfig(command=("true",), checkpoint_uri="s3://bucket/job", s3_endpoint_url=url)
    done = spotrun("ls", "s3://bucket/job", "--s3-endpoint-url", url)
    assert done.returncode == 2 and len(error_lines(done.stderr)) == 1


def test_workers_get_the_endpoint_for_s3_only(s3_bucket, tmp_path):
    s3_root = parse_location(f"{s3_bucket.uri}/job", endpoint_url="http://minio:9000")
    s3 = plan_launch(
        open_storage(f"{s3_bucket.uri}/job"), s3_root, control_dir=str(tmp_path), grace_period_s=30, base_env={}
    )
    assert s3.env[S3_ENDPOINT_URL] == "http://minio:9000"
    local_root = parse_location(str(tmp_path / "ck"), endpoint_url="http://minio:9000")
    local = plan_launch(
        open_storage(str(tmp_path / "ck")), local_root, control_dir=str(tmp_path), grace_period_s=30, base_env={}
    )
    assert S3_ENDPOINT_URL not in local.env
