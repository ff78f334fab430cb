"""A real moto S3 server on 127.0.0.1 for tests and benchmarks.

Fixtures (tests/conftest.py registers them: a test asks for them by name)::

    def test_something(s3_bucket):
        storage = open_storage(s3_bucket.uri)   # AWS_ENDPOINT_URL points at moto

* ``moto_endpoint`` (session scope): starts ``python -m moto.server`` on a free loopback
  port, waits until it answers HTTP, yields its URL (``http://127.0.0.1:PORT``), and
  stops it at the end of the session.
* ``moto_endpoint_enforcing_auth`` (session scope): a second server that authenticates
  requests, so fake credentials get a real ``403 InvalidAccessKeyId``.
* ``s3_bucket`` (function scope): a fresh, uniquely named bucket on the ``moto_endpoint``
  server, with fake credentials, region and ``AWS_ENDPOINT_URL`` set in the environment
  (restored after the test); yields an :class:`S3Bucket`. The bucket and its objects
  are removed afterwards so the server's memory does not grow across tests.

The server is a separate process, so it exercises the real HTTP path (signing,
retries, connection errors) that an in-process mock would skip.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

#: How long the server may take to answer after it is started (slow, loaded CI machines).
SERVER_START_TIMEOUT_S = 60.0
#: How long it may take to exit after SIGTERM before it is killed.
SERVER_STOP_TIMEOUT_S = 10.0

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
#: Settings that could point boto3 at a real account; removed while a test runs.
_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3")


@dataclass(frozen=True)
class S3Bucket:
    """A bucket on the test server.

    Attributes:
        name: bucket name.
        endpoint_url: the moto server's URL.
        uri: ``s3://name``, ready for ``open_storage``.
    """

    name: str
    endpoint_url: str

    @property
    def uri(self) -> str:
        return f"s3://{self.name}"


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (any status counts)."""
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:  # any HTTP status means the server is up
        return True
    except OSError:
        return False


def _wait_until_answering(proc: subprocess.Popen, url: str, timeout_s: float) -> bool:
    """Poll ``url`` until it answers (True) or the process exits or time runs out (False)."""
    deadline = time.monotonic() + timeout_s
    pause_s = 0.02
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if answers(url):
            return True
        time.sleep(pause_s)  # polling a condition, not synchronising on time
        pause_s = min(pause_s * 2, 0.5)
    return False


def stop(proc: subprocess.Popen, timeout_s: float = SERVER_STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; a process already gone is left as is."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def moto_server(attempts: int = 3, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``python -m moto.server`` on a free loopback port; yields its endpoint URL.

    The server's log goes to a temporary file (a pipe would fill up and block it).
    ``env`` adds environment variables for the server process (moto settings).

    Raises:
        RuntimeError: the server did not answer within ``SERVER_START_TIMEOUT_S`` in any
            of ``attempts`` tries (each on a new port, in case another process took it).
    """
    with tempfile.TemporaryFile() as log_file:
        for _ in range(attempts):
            port = free_loopback_port()
            url = f"http://127.0.0.1:{port}"
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
            )
            try:
                if _wait_until_answering(proc, f"{url}/moto-api/", SERVER_START_TIMEOUT_S):
                    yield url
                    return
            finally:
                stop(proc)
        log_file.seek(0)
        tail = log_file.read()[-2000:].decode(errors="replace")
    raise RuntimeError(f"moto server did not start after {attempts} tries; log tail:\n{tail}")


def make_client(endpoint_url: str):
    """A plain boto3 S3 client for the test server, with the fake credentials."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=FAKE_CREDENTIALS["AWS_DEFAULT_REGION"],
        aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )


def set_fake_aws_env(monkeypatch: pytest.MonkeyPatch, endpoint_url: str) -> None:
    """Point boto3 at the test server with fake credentials, away from any real config."""
    for name in _UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint_url)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def empty_and_delete_bucket(client, bucket: str) -> None:
    """Abort open uploads, delete every object, then the bucket (best effort)."""
    with contextlib.suppress(Exception):
        uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        for upload in uploads:
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:  # a page holds at most 1,000 keys, as many as one DeleteObjects takes
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a moto S3 server process shared by the whole test session."""
    with moto_server() as url:
        yield url


@functools.cache
def _admin_client(endpoint_url: str) -> Any:
    """One boto3 client per server for creating and removing test buckets (slow to build)."""
    return make_client(endpoint_url)


@pytest.fixture
def s3_bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket on the moto server; the AWS environment points at the server."""
    set_fake_aws_env(monkeypatch, moto_endpoint)
    client = _admin_client(moto_endpoint)
    name = f"spotrun-test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    yield S3Bucket(name=name, endpoint_url=moto_endpoint)
    empty_and_delete_bucket(client, name)


@pytest.fixture(scope="session")
def moto_endpoint_enforcing_auth() -> Iterator[str]:
    """URL of a second moto server that checks credentials (any fake key gets a 403)."""
    with moto_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as url:
        yield url


@contextlib.contextmanager
def failing_http_server(status: int, error_code: str) -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP server that answers every request with an S3 error.

    Yields ``(endpoint_url, requests)``; ``requests`` collects ``"METHOD /path"`` of each
    request received, so a test can count what actually reached the wire.
    """
    import http.server
    import threading

    from tests.support.fault_proxy import send_s3_error

    received: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # answers "Expect: 100-continue" at once

        def _fail(self) -> None:
            received.append(f"{self.command} {self.path}")
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            send_s3_error(self, status, error_code, "injected", request_id="0")

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _fail

        def log_message(self, *args) -> None:  # keep test output clean
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
