"""A GCS emulator on 127.0.0.1 for tests and benchmarks, behind a proxy that adds what it lacks.

Fixtures (tests/conftest.py registers them: a test asks for them by name)::

    def test_something(gcs_bucket):
        storage = open_storage(gcs_bucket.uri)   # STORAGE_EMULATOR_HOST points at the proxy

* ``gcs_endpoint`` (session scope): starts ``gcp-storage-emulator`` (PyPI; in memory) on a free
  loopback port and a :class:`GcsProxy` in front of it; yields the :class:`GcsServer`.
* ``gcs_bucket`` (function scope): a fresh, uniquely named bucket, with ``STORAGE_EMULATOR_HOST``
  set to the proxy and ``GOOGLE_CLOUD_PROJECT`` set, Google credentials unset (restored after the
  test); yields a :class:`GcsBucket`. The proxy's faults and records are reset for the test, the
  bucket emptied and deleted afterwards.

What the emulator lacks, and the proxy adds: the emulator (2026.7.19) ignores ``ifGenerationMatch``
everywhere: a second create-only upload (``ifGenerationMatch=0``, spotrun's commit) overwrites the
object, and a read pinned to a generation reads whatever is there. The proxy enforces the
precondition as GCS does (412 ``conditionNotMet``), on uploads, composes, downloads, deletes and
metadata requests: it looks the object's generation up on the emulator and forwards the request
only when it matches, with every mutating request serialised through one lock, so that a check
and the write it guards are never interleaved with another write (a resumable upload is checked
when it starts, not at its last chunk). ``enforce_preconditions = False`` turns that off, giving
a store that ignores them as the emulator does. The proxy also records every answer it relays
(:class:`Seen`: the request, its status and the body's bytes) and injects faults
(:meth:`GcsProxy.fail`: answer the next matching requests with a status, 503 or 429, without
forwarding them).
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import http.server
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.support.s3_server import free_loopback_port, stop

#: How long the emulator may take to answer after it is started (slow, loaded CI machines).
SERVER_START_TIMEOUT_S = 60.0
SERVER_STOP_TIMEOUT_S = 10.0
#: The project the fixtures set; the emulator accepts any.
PROJECT = "spotrun-test"
#: Google settings that could point a test at a real account; removed while a test runs.
_UNSET = ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GOOGLE_CLOUD_QUOTA_PROJECT")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Seen:
    """One request the proxy answered.

    Attributes:
        method, path, query: the request (``query`` decoded, one value per name).
        range: its ``Range`` header, ``""`` if none.
        status: the status it was answered with.
        body_bytes: the answer's body size in bytes.
        injected: True when the proxy answered it itself (a fault) without forwarding.
        object_name: the object it names (in its path, its ``name`` parameter or an upload's
            metadata); ``""`` if none.
    """

    method: str
    path: str
    query: dict[str, str]
    range: str
    status: int
    body_bytes: int
    injected: bool = False
    object_name: str = ""


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up: not news
            super().handle_error(request, client_address)


@dataclass
class _Fault:
    count: int
    status: int
    match: Callable[[Seen], bool]


class GcsProxy:
    """A threaded HTTP proxy on 127.0.0.1 in front of the emulator (module docstring)."""

    def __init__(self, upstream_url: str, *, port: int = 0) -> None:
        parts = urllib.parse.urlsplit(upstream_url)
        self._upstream = (parts.hostname, parts.port)
        self.enforce_preconditions = True
        #: Called with each request before it is forwarded or answered, outside the proxy's locks
        #: (a test that changes the store in the middle of a read).
        self.on_request: Callable[[Seen], None] | None = None
        self._faults: list[_Fault] = []
        self._seen: list[Seen] = []
        self._lock = threading.Lock()  # the records and faults
        self._writes = threading.Lock()  # mutating requests, one at a time
        self._server = _QuietServer(("127.0.0.1", port), _handler_class(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="gcs-proxy", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> GcsProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        """Forget faults and records; enforce preconditions again."""
        with self._lock:
            self._faults.clear()
            self._seen.clear()
        self.enforce_preconditions = True
        self.on_request = None

    def fail(self, count: int, status: int = 503, match: Callable[[Seen], bool] = lambda seen: True) -> None:
        """Answer the next ``count`` requests that ``match`` accepts with ``status`` (JSON error)."""
        with self._lock:
            self._faults.append(_Fault(count, status, match))

    def seen(self, match: Callable[[Seen], bool] = lambda seen: True) -> list[Seen]:
        with self._lock:
            return [s for s in self._seen if match(s)]

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    def _fault_for(self, probe: Seen) -> int | None:
        with self._lock:
            for fault in self._faults:
                if fault.count > 0 and fault.match(probe):
                    fault.count -= 1
                    return fault.status
        return None

    def upstream(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(*self._upstream, timeout=60)

    def generation_of(self, bucket: str, name: str) -> int:
        """The object's generation on the emulator; 0 when there is none."""
        connection = self.upstream()
        try:
            connection.request("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")
            answer = connection.getresponse()
            body = answer.read()
        finally:
            connection.close()
        if answer.status == 404:
            return 0
        return int(json.loads(body)["generation"])


def _target(method: str, path: str, query: dict[str, str], headers, body: bytes) -> tuple[str, str]:
    """``(bucket, object)`` a request names; ``("", "")`` if none."""
    upload = re.match(r"^/upload/storage/v1/b/([^/]+)/o$", path)
    if upload:
        if method == "POST":
            return upload.group(1), query.get("name") or _metadata_name(headers.get("Content-Type", ""), body)
        return upload.group(1), query.get("name", "")
    named = re.match(r"^(?:/download)?/storage/v1/b/([^/]+)/o/([^/]+)(?:/compose)?$", path)
    if named:
        return named.group(1), urllib.parse.unquote(named.group(2))
    return "", ""


def _metadata_name(content_type: str, body: bytes) -> str:
    """The object name in an upload's JSON metadata (a multipart body's first part, or the body)."""
    boundary = re.search(r'boundary="?([^";]+)"?', content_type)
    if boundary:
        first = body.split(b"--" + boundary.group(1).encode())[1]
        body = first.split(b"\r\n\r\n", 1)[1].rsplit(b"\r\n", 1)[0]
    return json.loads(body or b"{}").get("name", "")


def _handler_class(proxy: GcsProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._handle()

        do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            parts = urllib.parse.urlsplit(self.path)
            query = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items()}
            bucket, name = _target(self.command, parts.path, query, self.headers, body)
            probe = Seen(self.command, parts.path, query, self.headers.get("Range", ""), 0, 0, object_name=name)
            if proxy.on_request is not None:
                proxy.on_request(probe)
            status = proxy._fault_for(probe)
            if status is not None:
                self._answer_error(probe, status, "injected by the test's proxy", injected=True)
                return
            mutating = self.command in ("POST", "PUT", "DELETE", "PATCH")
            with proxy._writes if mutating else contextlib.nullcontext():
                if "ifGenerationMatch" in query and name and proxy.enforce_preconditions:
                    if proxy.generation_of(bucket, name) != int(query["ifGenerationMatch"]):
                        self._answer_error(probe, 412, "At least one of the pre-conditions you specified did not hold.")
                        return
                self._forward(probe, body)

        def _forward(self, probe: Seen, body: bytes) -> None:
            connection = proxy.upstream()
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                connection.request(self.command, self.path, body=body, headers=headers)
                answer = connection.getresponse()
                payload = answer.read()
            finally:
                connection.close()
            proxy._record(Seen(**{**probe.__dict__, "status": answer.status, "body_bytes": len(payload)}))
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _answer_error(self, probe: Seen, status: int, message: str, *, injected: bool = False) -> None:
            reason = {412: "conditionNotMet", 429: "rateLimitExceeded", 503: "backendError"}.get(status, "error")
            payload = json.dumps(
                {"error": {"code": status, "message": message, "errors": [{"reason": reason, "message": message}]}}
            ).encode()
            proxy._record(
                Seen(**{**probe.__dict__, "status": status, "body_bytes": len(payload), "injected": injected})
            )
            self.send_response(status)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

    return Handler


@dataclass(frozen=True)
class GcsServer:
    """The emulator and the proxy in front of it.

    Attributes:
        url: the proxy's URL, what ``STORAGE_EMULATOR_HOST`` is set to.
        emulator_url: the emulator's own URL (no preconditions enforced there).
        proxy: the :class:`GcsProxy`.
    """

    url: str
    emulator_url: str
    proxy: GcsProxy


@dataclass(frozen=True)
class GcsBucket:
    """A bucket on the test emulator: ``name``, the :class:`GcsServer`, and ``uri`` (``gs://name``)."""

    name: str
    server: GcsServer

    @property
    def uri(self) -> str:
        return f"gs://{self.name}"

    @property
    def proxy(self) -> GcsProxy:
        return self.server.proxy


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _request(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def _answers(url: str) -> bool:
    try:
        _request(url, "GET", f"/storage/v1/b?project={PROJECT}")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def gcs_emulator() -> Iterator[str]:
    """Run ``gcp-storage-emulator`` in memory on a free loopback port; yields its URL."""
    with tempfile.TemporaryFile() as log_file:
        port = free_loopback_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port)]
            + ["--in-memory"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            pause_s = 0.02
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log_file.seek(0)
                    raise RuntimeError(f"gcp-storage-emulator did not start: {log_file.read().decode()[-2000:]}")
                time.sleep(pause_s)  # polling a condition, not synchronising on time
                pause_s = min(pause_s * 2, 0.5)
            yield url
        finally:
            stop(proc, SERVER_STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[GcsServer]:
    with gcs_emulator() as emulator_url, GcsProxy(emulator_url) as proxy:
        yield GcsServer(url=proxy.url, emulator_url=emulator_url, proxy=proxy)


def create_bucket(server: GcsServer, name: str) -> None:
    status, body = _request(server.emulator_url, "POST", f"/storage/v1/b?project={PROJECT}", {"name": name})
    if status != 200:
        raise RuntimeError(f"creating bucket {name} on the emulator: {status} {body[:200]!r}")


def empty_and_delete_bucket(server: GcsServer, name: str) -> None:
    def delete(item: dict) -> None:
        _request(server.emulator_url, "DELETE", f"/storage/v1/b/{name}/o/{urllib.parse.quote(item['name'], safe='')}")

    while True:
        status, body = _request(server.emulator_url, "GET", f"/storage/v1/b/{name}/o")
        items = json.loads(body).get("items", []) if status == 200 else []
        if not items:
            break
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(delete, items))
    _request(server.emulator_url, "DELETE", f"/storage/v1/b/{name}")


@pytest.fixture
def gcs_bucket(gcs_endpoint: GcsServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[GcsBucket]:
    name = f"spotrun-test-{uuid.uuid4().hex[:12]}"
    gcs_endpoint.proxy.reset()
    create_bucket(gcs_endpoint, name)
    for variable in _UNSET:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint.url)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", PROJECT)
    try:
        yield GcsBucket(name=name, server=gcs_endpoint)
    finally:
        gcs_endpoint.proxy.reset()
        empty_and_delete_bucket(gcs_endpoint, name)


def main() -> None:
    """``python -m tests.support.gcs_server [--port P]``: the emulator and the proxy for a try by
    hand (docs/guide/cloud-storage.md), until Ctrl-C; prints the ``STORAGE_EMULATOR_HOST`` to set."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, default=0, help="the proxy's port (default: a free one)")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    args = parser.parse_args()
    with gcs_emulator() as emulator_url, GcsProxy(emulator_url, port=args.port) as proxy:
        server = GcsServer(url=proxy.url, emulator_url=emulator_url, proxy=proxy)
        for bucket in args.bucket:
            create_bucket(server, bucket)
        print(f"export STORAGE_EMULATOR_HOST={proxy.url}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
