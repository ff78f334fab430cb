"""A real Azurite (Microsoft's Azure Blob Storage emulator) on 127.0.0.1 for tests.

Fixtures (tests/conftest.py registers them: a test asks for them by name)::

    def test_something(azure_container):
        storage = open_storage(azure_container.uri)   # AZURE_STORAGE_CONNECTION_STRING points at Azurite

* ``azurite_endpoint`` (session scope): makes sure Azurite is installed (``npm install azurite@3``
  into :data:`CACHE_DIR`, reused by later sessions; skips only where npm is missing), starts
  ``azurite-blob`` on a free loopback port with its data in a temporary directory, waits until
  it answers, yields an :class:`AzuriteServer`, and stops it at the end of the session. It
  dies with the test process (``PR_SET_PDEATHSIG``) if that is killed.
* ``azure_container`` (function scope): a fresh, uniquely named container, with
  ``AZURE_STORAGE_CONNECTION_STRING`` set in the environment (restored after the test);
  yields an :class:`AzureContainer`. Deleted afterwards, with its blobs.

Azurite differs from Azure in ways the tests meet: a wrong key is ``403 AuthorizationFailure``
(Azure: ``AuthenticationFailed``); a Put Blob with ``If-None-Match: *`` onto a name that has only
uncommitted blocks is refused as ``409 BlobAlreadyExists`` (Azure stores it); a Put Blob does
not discard a blob's uncommitted blocks (Azure does); a range starting at the end answers with
no bytes (Azure: ``416``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.s3_server import answers as _answers
from tests.support.s3_server import free_loopback_port
from tests.support.s3_server import stop as _stop

#: Where Azurite is installed, once per machine and user.
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spotrun-tests" / "azurite"
AZURITE_PACKAGE = "azurite@3"
#: Bounds, in seconds: the npm installation, the server's start, its exit after SIGTERM.
INSTALL_TIMEOUT_S = 300.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0

#: Azurite's well-known development account and key (public: in Microsoft's documentation).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: Settings that could point the backend at a real account; removed while a test runs.
_UNSET = ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_BLOB_ENDPOINT")

_PR_SET_PDEATHSIG = 1


def connection_string(endpoint_url: str, *, account_key: str = ACCOUNT_KEY) -> str:
    """A connection string for Azurite's development account at ``endpoint_url``."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={account_key};"
        f"BlobEndpoint={endpoint_url}/{ACCOUNT};"
    )


@dataclass(frozen=True)
class AzuriteServer:
    """A running Azurite.

    Attributes:
        endpoint_url: ``http://127.0.0.1:PORT`` (the account's blob endpoint is ``.../devstoreaccount1``).
        connection_string: for the development account.
    """

    endpoint_url: str
    connection_string: str


@dataclass(frozen=True)
class AzureContainer:
    """A container on the test server.

    Attributes:
        name: container name.
        connection_string: the development account's.
        endpoint_url: the Azurite server's URL.
        uri: ``az://name``, ready for ``open_storage``.
    """

    name: str
    connection_string: str
    endpoint_url: str

    @property
    def uri(self) -> str:
        return f"az://{self.name}"


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _program() -> Path:
    return CACHE_DIR / "node_modules" / ".bin" / "azurite-blob"


def install_azurite() -> Path:
    """``azurite-blob`` from the cache, installed there first if need be (one installer at a
    time: test processes running side by side wait on a lock).

    Raises:
        RuntimeError: npm failed or took longer than :data:`INSTALL_TIMEOUT_S`.
    """
    program = _program()
    if program.exists():
        return program
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("Azurite not available: npm is missing (install Node.js and npm)")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if program.exists():  # another test process installed it meanwhile
            return program
        command = [npm, "install", "--prefix", str(CACHE_DIR), "--no-audit", "--no-fund", AZURITE_PACKAGE]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{' '.join(command)} took more than {INSTALL_TIMEOUT_S:.0f} s") from exc
        if done.returncode != 0 or not program.exists():
            tail = (done.stdout + done.stderr)[-2000:]
            raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}):\n{tail}")
    return program


@contextlib.contextmanager
def azurite_server(workdir: str, attempts: int = 3) -> Iterator[AzuriteServer]:
    """Run ``azurite-blob`` on a free loopback port with its data under ``workdir``.

    ``--skipApiVersionCheck``: the SDK may speak a newer service version than this Azurite
    knows; ``--loose``: Azurite ignores headers it does not implement instead of refusing.

    Raises:
        RuntimeError: it did not answer within :data:`START_TIMEOUT_S` in any of ``attempts``
            tries (each on a new port, in case another process took it).
    """
    program = install_azurite()
    log_path = os.path.join(workdir, "azurite.log")
    for _ in range(attempts):
        port = free_loopback_port()
        url = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                [
                    str(program),
                    "--blobHost",
                    "127.0.0.1",
                    "--blobPort",
                    str(port),
                    "--location",
                    os.path.join(workdir, "data"),
                    "--skipApiVersionCheck",
                    "--loose",
                    "--silent",
                    "--disableTelemetry",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            pause_s = 0.05
            while proc.poll() is None and time.monotonic() < deadline and not _answers(f"{url}/{ACCOUNT}"):
                time.sleep(pause_s)  # polling a condition, not synchronising on time
                pause_s = min(pause_s * 2, 0.5)
            if proc.poll() is None and _answers(f"{url}/{ACCOUNT}"):
                yield AzuriteServer(endpoint_url=url, connection_string=connection_string(url))
                return
        finally:
            _stop(proc)
    with open(log_path, errors="replace") as log_file:
        tail = log_file.read()[-2000:]
    raise RuntimeError(f"Azurite did not start in {attempts} tries:\n{tail}")


@pytest.fixture(scope="session")
def azurite_endpoint() -> Iterator[AzuriteServer]:
    """An Azurite blob server shared by the whole session (installed first if need be)."""
    workdir = tempfile.mkdtemp(prefix="spotrun-azurite-")
    try:
        with azurite_server(workdir) as server:
            yield server
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@functools.cache
def admin_service(connection_string_: str) -> Any:
    """One SDK client per server for creating and removing test containers."""
    from azure.storage.blob import BlobServiceClient

    return BlobServiceClient.from_connection_string(connection_string_, retry_total=0)


@pytest.fixture
def azure_container(azurite_endpoint: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[AzureContainer]:
    """A fresh container on Azurite; ``AZURE_STORAGE_CONNECTION_STRING`` points at it."""
    for name in _UNSET:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_endpoint.connection_string)
    service = admin_service(azurite_endpoint.connection_string)
    name = f"spotrun-test-{uuid.uuid4().hex[:12]}"
    service.create_container(name)
    yield AzureContainer(
        name=name, connection_string=azurite_endpoint.connection_string, endpoint_url=azurite_endpoint.endpoint_url
    )
    with contextlib.suppress(Exception):  # a test may have deleted it
        service.delete_container(name)


def _send_azure_error(handler: Any, status: int, code: str) -> None:
    """Answer with an Azure error: the status, ``x-ms-error-code`` and the XML body Azure sends."""
    body = (
        b'<?xml version="1.0" encoding="utf-8"?><Error><Code>'
        + code.encode()
        + b"</Code><Message>injected</Message></Error>"
    )
    handler.send_response(status)
    handler.send_header("x-ms-error-code", code)
    handler.send_header("x-ms-request-id", str(uuid.uuid4()))
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", "0" if handler.command == "HEAD" else str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


@dataclass(frozen=True)
class Relayed:
    """One answer a proxy forwarded: the request's ``method``, ``path`` (with its query) and
    ``range`` (its ``x-ms-range``, else ``Range``, header; ``""`` if none), the answer's
    ``status`` and its body's size in bytes."""

    method: str
    path: str
    range: str
    status: int
    body_bytes: int


@contextlib.contextmanager
def counting_proxy(upstream_url: str) -> Iterator[tuple[str, list[Relayed]]]:
    """A loopback proxy in front of Azurite that forwards everything and records each answer;
    yields ``(endpoint_url, relayed)``."""
    relayed: list[Relayed] = []
    with throttling_proxy(upstream_url, fail_first=0, relayed=relayed) as (url, _requests):
        yield url, relayed


@contextlib.contextmanager
def throttling_proxy(
    upstream_url: str | None,
    *,
    fail_first: int | None,
    status: int = 503,
    code: str = "ServerBusy",
    relayed: list[Relayed] | None = None,
) -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP proxy in front of Azurite that answers the first ``fail_first`` requests
    (every request when ``None``, or when there is no ``upstream_url``) with an Azure error, and
    forwards the others.

    Yields ``(endpoint_url, requests)``: ``requests`` collects ``"METHOD /path?query"`` of each
    request received, so a test can count what actually reached the wire; ``relayed``, when
    given, gets a :class:`Relayed` for each answer forwarded from Azurite.
    """
    import http.client
    import http.server
    import threading
    import urllib.parse

    received: list[str] = []
    lock = threading.Lock()
    upstream = urllib.parse.urlsplit(upstream_url) if upstream_url else None

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            with lock:
                received.append(f"{self.command} {self.path}")
                failing = upstream is None or fail_first is None or len(received) <= fail_first
            if failing:
                _send_azure_error(self, status, code)
                return
            connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                connection.request(self.command, self.path, body=body, headers=headers)
                answer = connection.getresponse()
                content = answer.read()
            finally:
                connection.close()
            if relayed is not None:
                ranged = self.headers.get("x-ms-range") or self.headers.get("Range") or ""
                seen = Relayed(self.command, self.path, ranged, answer.status, len(content))
                with lock:
                    relayed.append(seen)
            self.send_response(answer.status, answer.reason)
            dropped = ("transfer-encoding", "connection", "keep-alive") + (
                () if self.command == "HEAD" else ("content-length",)
            )
            for name, value in answer.getheaders():
                if name.lower() not in dropped:
                    self.send_header(name, value)
            if self.command != "HEAD":  # a HEAD's Content-Length is the blob's size: kept as sent
                self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(content)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        def log_message(self, *args: Any) -> None:  # keep test output clean
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
