"""A fault-injecting HTTP proxy between an S3 client and the moto server, for tests.

    with FaultProxy(moto_url, seed=7) as proxy:
        proxy.set_rule(FaultRule(fraction=0.1))                 # 10 % of requests fail
        proxy.set_rule(FaultRule(count=6, kinds=(SLOW_DOWN,),   # the first 6 uploads of
                                 match=upload_of("rank-00001.safetensors")))  # rank 1's shard
        env = {"AWS_ENDPOINT_URL": proxy.url}                   # point clients at the proxy
        proxy.set_latency(5.0, upload_of("rank-"))              # a slow link for shard uploads
        proxy.seen(upload_of("step-000000020/"))                # requests that arrived so far
        proxy.relayed()                                         # answers relayed, with body sizes
        proxy.sent_bytes                                        # bytes sent to clients, headers included

It listens on 127.0.0.1 (one thread per client connection, HTTP/1.1 keep-alive), reads
each request whole, and either forwards it to the upstream server and relays the answer,
or -- when the rule picks it -- injects a fault instead of forwarding:

* ``SLOW_DOWN``: ``503`` with S3's ``SlowDown`` error document (throttling);
* ``INTERNAL``: ``500`` with ``InternalError``;
* ``DROP``: closes the connection without answering;
* ``LOST_RESPONSE``: forwards the request, then closes the connection instead of relaying
  the answer: the server did the work, the client cannot know (not in :data:`ALL_KINDS`).
* ``NOT_IMPLEMENTED``: ``501`` with ``NotImplemented``, as a store that lacks a feature the
  request uses answers (not in :data:`ALL_KINDS`);
* ``IGNORE_CONDITION``: forwards the request without its ``If-None-Match``/``If-Match``
  headers, as a store that silently ignores conditional writes (not in :data:`ALL_KINDS`).
* ``CUT_REQUEST``: reads half of the request's body, then closes the connection: the link
  broke while the client was still sending (an upload cut mid-stream; not in :data:`ALL_KINDS`).
* ``TRUNCATED_BODY``: forwards the request, then relays the answer's status, headers and
  full ``Content-Length`` but only half of its body before closing the connection: a
  download cut mid-stream (not in :data:`ALL_KINDS`).

A ``fraction`` is kept exactly, spread evenly with a seeded phase: of the matching
requests, in the order they arrive, request ``n`` fails when ``floor((n + phase) *
fraction)`` steps up, ``phase`` drawn from ``random.Random(seed)``. So every run with the
same seed and the same requests injects the same number of faults at the same arrival
positions (which request is at a position may differ when clients race). Injected faults
take the rule's kinds in turn.

Byte counts: every answer the proxy relays is recorded (:class:`Relayed`: the request,
the status and the body's bytes), and ``sent_bytes`` counts every byte written to the
clients' sockets (status lines, headers and bodies, injected errors included): what a
client received over the wire, counted apart from anything the client itself reports.
Both are counted before the bytes are written, so once a client has read an answer, its
bytes are in the counts.

A latency (``set_latency``) holds each matching request that is forwarded for that many
seconds before it goes upstream: a slow or congested link to the store.

Times in listings (``backdate``): moto answers ``ListMultipartUploads`` with the same
``Initiated`` for every upload (2010-11-10T20:48:33Z), and its objects' ``LastModified``
is the real time of their write. The proxy records when it relayed each
``CreateMultipartUpload`` and answers every upload's ``Initiated`` with that time, as S3
does; ``backdate(age_s, match)`` makes the objects and uploads whose key ``match`` accepts
look ``age_s`` older in ``ListObjectsV2`` and ``ListMultipartUploads`` answers (written
long ago), without waiting.
"""

from __future__ import annotations

import datetime
import http.client
import http.server
import math
import random
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

SLOW_DOWN = "slowdown"
INTERNAL = "internal"
DROP = "drop"
LOST_RESPONSE = "lost-response"
NOT_IMPLEMENTED = "not-implemented"
IGNORE_CONDITION = "ignore-condition"
CUT_REQUEST = "cut-request"
TRUNCATED_BODY = "truncated-body"
#: The kinds a rule mixes by default: failures that happen before the server acts.
ALL_KINDS = (SLOW_DOWN, INTERNAL, DROP)
_KNOWN_KINDS = (*ALL_KINDS, LOST_RESPONSE, NOT_IMPLEMENTED, IGNORE_CONDITION, CUT_REQUEST, TRUNCATED_BODY)

_ERRORS = {
    SLOW_DOWN: (503, "SlowDown", "Please reduce your request rate."),
    INTERNAL: (500, "InternalError", "We encountered an internal error. Please try again."),
    NOT_IMPLEMENTED: (501, "NotImplemented", "A header you provided implies functionality that is not implemented."),
}
#: Request headers that make a write conditional; ``IGNORE_CONDITION`` drops them.
_CONDITION_HEADERS = frozenset({"if-none-match", "if-match"})
#: Headers that belong to one connection and are never relayed.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
#: Seconds the proxy waits for the upstream server's answer to one request.
UPSTREAM_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Request:
    """What a rule's predicate sees of one request.

    Attributes:
        method: ``GET``, ``PUT``, ...
        path: the request target, query string included (``/bucket/key?uploadId=...``).
        headers: the request's headers, names in lower case.
    """

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict, compare=False, repr=False)


def everything(request: Request) -> bool:
    """Predicate that matches every request."""
    return True


def upload_of(name: str) -> Callable[[Request], bool]:
    """Predicate: a ``PUT``/``POST`` (single put, multipart part or completion) whose
    object path contains ``name`` (e.g. ``"rank-00001.safetensors"``)."""

    def match(request: Request) -> bool:
        return request.method in ("PUT", "POST") and name in urllib.parse.urlsplit(request.path).path

    return match


def conditional_put(request: Request) -> bool:
    """Predicate: a single ``PUT`` of an object carrying ``If-None-Match`` (a conditional
    write; multipart parts and copies excluded)."""
    query = urllib.parse.urlsplit(request.path).query
    return request.method == "PUT" and "if-none-match" in request.headers and "uploadId" not in query


@dataclass(frozen=True)
class FaultRule:
    """Which requests fail, and how.

    Attributes:
        fraction: share of the matching requests that fail (0..1), spread evenly.
        count: when set, the first ``count`` matching requests fail (after which they
            pass), whatever ``fraction`` says.
        kinds: fault kinds, used in turn.
        match: predicate on :class:`Request`; requests it rejects always pass.
    """

    fraction: float = 0.0
    count: int | None = None
    kinds: tuple[str, ...] = ALL_KINDS
    match: Callable[[Request], bool] = field(default=everything)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be within [0, 1], got {self.fraction}")
        if not self.kinds or any(k not in _KNOWN_KINDS for k in self.kinds):
            raise ValueError(f"kinds must be a non-empty subset of {_KNOWN_KINDS}, got {self.kinds}")


@dataclass(frozen=True)
class Relayed:
    """One answer relayed from the upstream server: the request, the status, and the
    bytes of the body sent to the client (status line and headers not included)."""

    method: str
    path: str
    status: int
    body_bytes: int


@dataclass(frozen=True)
class Injected:
    """One injected fault: its kind and the request it replaced."""

    kind: str
    method: str
    path: str


class FaultProxy:
    """The proxy; a context manager that serves in a background thread.

    Args:
        upstream_url: the real server, ``http://127.0.0.1:PORT``.
        seed: seed of the fault decisions.

    Attributes:
        url: where clients connect (``http://127.0.0.1:PORT``).
    """

    def __init__(self, upstream_url: str, *, seed: int = 0) -> None:
        parts = urllib.parse.urlsplit(upstream_url)
        self._upstream = (parts.hostname, parts.port or 80)
        self._seed = seed
        self._lock = threading.Lock()
        self._rule = FaultRule()
        self._phase = 0.0
        self._matched = 0
        self._injected: list[Injected] = []
        self._latency: tuple[float, Callable[[Request], bool]] = (0.0, everything)
        self._seen: list[Request] = []
        self._relayed: list[Relayed] = []
        self._initiated: dict[str, float] = {}  # UploadId -> when its CreateMultipartUpload was relayed
        self._backdate: tuple[float, Callable[[str], bool]] = (0.0, lambda key: False)
        self.forwarded = 0
        #: Bytes written to the clients' sockets so far: status lines, headers and bodies.
        self.sent_bytes = 0
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def set_rule(self, rule: FaultRule) -> None:
        """Use ``rule`` from the next request on; resets the counts of the previous rule."""
        with self._lock:
            self._rule = rule
            self._phase = random.Random(self._seed).random() / rule.fraction if rule.fraction else 0.0
            self._matched = 0

    def set_latency(self, delay_s: float, match: Callable[[Request], bool] = everything) -> None:
        """Hold each forwarded request that ``match`` accepts for ``delay_s`` seconds first."""
        with self._lock:
            self._latency = (delay_s, match)

    def backdate(self, age_s: float, match: Callable[[str], bool]) -> None:
        """From now on, listings show the objects and uploads whose key (as the store names
        it: the bucket-relative key) ``match`` accepts as ``age_s`` seconds older."""
        with self._lock:
            self._backdate = (age_s, match)

    def rewrite_answer(self, request: Request, payload: bytes) -> bytes:
        """The answer's body as relayed: upload times recorded and listing times rewritten."""
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.path).query, keep_blank_values=True)
        if request.method == "POST" and "uploads" in query:  # CreateMultipartUpload
            found = re.search(rb"<UploadId>([^<]+)</UploadId>", payload)
            if found:
                with self._lock:
                    self._initiated[found.group(1).decode()] = time.time()
            return payload
        if request.method != "GET" or not ("uploads" in query or query.get("list-type") == ["2"]):
            return payload
        with self._lock:
            age_s, match = self._backdate
            initiated = dict(self._initiated)

        def entry(block: re.Match) -> bytes:
            text = block.group(0).decode()
            key = urllib.parse.unquote(re.search(r"<Key>([^<]*)</Key>", text).group(1))
            shift_s = age_s if match(key) else 0.0
            if block.group(1) == b"Upload":
                upload_id = re.search(r"<UploadId>([^<]*)</UploadId>", text).group(1)
                at = initiated.get(upload_id)
                if at is not None:
                    text = re.sub(
                        r"<Initiated>[^<]*</Initiated>", f"<Initiated>{_s3_time(at - shift_s)}</Initiated>", text
                    )
            elif shift_s:
                text = re.sub(
                    r"<LastModified>([^<]*)</LastModified>",
                    lambda m: f"<LastModified>{_s3_time(_parse_s3_time(m.group(1)) - shift_s)}</LastModified>",
                    text,
                )
            return text.encode()

        return re.sub(rb"<(Upload|Contents)>.*?</\1>", entry, payload, flags=re.DOTALL)

    def latency_for(self, request: Request) -> float:
        """Seconds to hold ``request`` before forwarding it."""
        with self._lock:
            delay_s, match = self._latency
        return delay_s if delay_s > 0 and match(request) else 0.0

    def seen(self, match: Callable[[Request], bool] = everything) -> list[Request]:
        """Every request that arrived so far (faulted or not) that ``match`` accepts, in order."""
        with self._lock:
            return [r for r in self._seen if match(r)]

    def relayed(self, match: Callable[[Request], bool] = everything) -> list[Relayed]:
        """Every answer relayed to a client so far whose request ``match`` accepts, in order."""
        with self._lock:
            return [r for r in self._relayed if match(Request(r.method, r.path))]

    def count_sent(self, size_bytes: int, relayed: Relayed | None = None) -> None:
        """Add ``size_bytes`` to :attr:`sent_bytes` (and record ``relayed``)."""
        with self._lock:
            self.sent_bytes += size_bytes
            if relayed is not None:
                self._relayed.append(relayed)

    @property
    def injected(self) -> list[Injected]:
        """Every fault injected so far, in order."""
        with self._lock:
            return list(self._injected)

    def decide(self, request: Request) -> str | None:
        """The fault kind to inject for ``request``, or ``None`` to forward it."""
        with self._lock:
            self._seen.append(request)
            rule = self._rule
            if not rule.match(request):
                return None
            self._matched += 1
            n = self._matched
            if rule.count is not None:
                fail = n <= rule.count
            else:
                fail = math.floor((n + self._phase) * rule.fraction) > math.floor((n - 1 + self._phase) * rule.fraction)
            if not fail:
                return None
            kind = rule.kinds[len(self._injected) % len(rule.kinds)]
            self._injected.append(Injected(kind, request.method, request.path))
            return kind

    def upstream(self) -> http.client.HTTPConnection:
        """A new connection to the upstream server."""
        host, port = self._upstream
        return http.client.HTTPConnection(host, port, timeout=UPSTREAM_TIMEOUT_S)


def _s3_time(unix_s: float) -> str:
    """``2026-12-01T05:15:22.123Z``, as S3 writes times in its XML answers."""
    at = datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc)
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def _parse_s3_time(text: str) -> float:
    return datetime.datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def send_s3_error(
    handler: http.server.BaseHTTPRequestHandler, status: int, code: str, message: str, *, request_id: str
) -> None:
    """Answer the request ``handler`` serves with S3's XML error document (no body for HEAD)."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


class _CountingWriter:
    """A handler's ``wfile`` that adds what it writes to the proxy's :attr:`FaultProxy.sent_bytes`
    (before writing: a client that read the bytes finds them counted)."""

    def __init__(self, inner, proxy: FaultProxy) -> None:
        self._inner = inner
        self._proxy = proxy

    def write(self, data) -> int:
        self._proxy.count_sent(memoryview(data).nbytes)
        return self._inner.write(data)

    def __getattr__(self, name: str):  # flush, close, closed, ...
        return getattr(self._inner, name)


def _handler_class(proxy: FaultProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive; answers "Expect: 100-continue"
        _conn: http.client.HTTPConnection | None = None

        def setup(self) -> None:
            super().setup()
            self.wfile = _CountingWriter(self.wfile, proxy)

        def _handle(self) -> None:
            headers = {name.lower(): value for name, value in self.headers.items()}
            request = Request(self.command, self.path, headers)
            kind = proxy.decide(request)
            if kind == CUT_REQUEST:
                self.rfile.read(int(self.headers.get("Content-Length") or 0) // 2)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            body = self._read_body()
            if kind == IGNORE_CONDITION:
                self._forward(body, drop_headers=_CONDITION_HEADERS)
            elif kind == TRUNCATED_BODY:
                self._forward(body, truncate=True)
            elif kind in (DROP, LOST_RESPONSE):
                if kind == LOST_RESPONSE:
                    self._relay(body)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            elif kind is not None:
                send_s3_error(self, *_ERRORS[kind], request_id="fault-proxy")
            else:
                time.sleep(proxy.latency_for(request))
                self._forward(body)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        def _read_body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline().strip():  # trailers, up to the empty line
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()  # CRLF after each chunk
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _forward(self, body: bytes, drop_headers: frozenset[str] = frozenset(), truncate: bool = False) -> None:
            response, payload = self._relay(body, drop_headers)
            payload = proxy.rewrite_answer(Request(self.command, self.path), payload)
            self.send_response_only(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() in _HOP_BY_HOP or name.lower() == "content-length":
                    continue
                self.send_header(name, value)
            length = response.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(payload)))
            sent = 0 if self.command == "HEAD" else len(payload) // 2 if truncate else len(payload)
            proxy.count_sent(0, Relayed(self.command, self.path, response.status, sent))
            self.end_headers()
            if truncate:
                self.wfile.write(payload[: len(payload) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            elif self.command != "HEAD":
                self.wfile.write(payload)

        def _relay(
            self, body: bytes, drop_headers: frozenset[str] = frozenset()
        ) -> tuple[http.client.HTTPResponse, bytes]:
            """Send the request upstream (less ``drop_headers``); its response and body."""
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() not in drop_headers
            }
            headers["Content-Length"] = str(len(body))
            for attempt in (1, 2):  # a kept-alive upstream connection may have been closed
                if self._conn is None:
                    self._conn = proxy.upstream()
                try:
                    self._conn.request(self.command, self.path, body=body, headers=headers)
                    response = self._conn.getresponse()
                    payload = response.read()
                    break
                except (http.client.HTTPException, OSError):
                    self._conn.close()
                    self._conn = None
                    if attempt == 2:
                        raise
            with proxy._lock:
                proxy.forwarded += 1
            return response, payload

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                if self._conn is not None:
                    self._conn.close()

        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

    return Handler
