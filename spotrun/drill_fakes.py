"""Fake cloud metadata servers: real HTTP servers on 127.0.0.1 speaking each protocol.

``spotrun drill`` serves its rehearsal notice from one of these, and the tests use them to
play the clouds. Each fake follows the protocol facts the notice sources rely on (AWS
IMDSv2, GCP metadata, Azure Scheduled Events), checks the headers a real server requires,
and has methods to announce a notice. All of them record every request
(:attr:`FakeServer.requests`) and can be told to answer one path with anything
(:meth:`FakeServer.misbehave`: a status, a body, a delay, a dropped connection) to play a
broken or hostile server.

Use them as context managers; :attr:`FakeServer.url` is ``http://127.0.0.1:PORT`` and
:attr:`FakeServer.host_port` is ``127.0.0.1:PORT``. Standard library only.
"""

from __future__ import annotations

import email.utils
import hashlib
import http.server
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Request:
    """One request the fake received: method, path (no query), query, headers (lower-case names),
    body, and when its body had been read (``received_unix_s``, seconds since the epoch)."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    received_unix_s: float


@dataclass
class Misbehaviour:
    """What to answer on a path instead of the protocol (see :meth:`FakeServer.misbehave`)."""

    status: int = 200
    body: bytes = b""
    delay_s: float = 0.0
    drop: bool = False
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Reply:
    """An answer to send: HTTP status, body and extra headers."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


class FakeServer:
    """A ThreadingHTTPServer on an ephemeral loopback port; subclasses implement :meth:`reply`."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._misbehaviour: dict[str, Misbehaviour] = {}
        self._changed = threading.Condition()  # guards all state; notified on every change
        self._closing = threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                fake._serve(self)

            do_GET = do_PUT = do_POST = _handle

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:  # clients that hang up: normal here
                pass

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.host_port = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Release blocked requests (long polls, delays) and stop the server."""
        self._closing.set()
        with self._changed:
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- for tests ---------------------------------------------------------------

    def misbehave(self, path: str, *, status: int = 200, body: bytes | str = b"", delay_s: float = 0.0,
                  drop: bool = False, headers: dict[str, str] | None = None) -> None:
        """Answer every request to ``path`` (any method) with this, after ``delay_s`` seconds;
        ``drop`` closes the connection without an answer."""
        with self._changed:
            self._misbehaviour[path] = Misbehaviour(
                status, body.encode() if isinstance(body, str) else body, delay_s, drop, dict(headers or {})
            )

    def behave(self, path: str) -> None:
        """Speak the protocol again on ``path``."""
        with self._changed:
            self._misbehaviour.pop(path, None)

    def requests_to(self, path: str, method: str | None = None) -> list[Request]:
        """The requests received for ``path`` so far."""
        with self._changed:
            return [r for r in self.requests if r.path == path and (method is None or r.method == method)]

    def wait_for(self, condition, timeout_s: float = 30.0) -> bool:
        """Wait until ``condition()`` (called under the lock) holds after some request; its result."""
        with self._changed:
            return self._changed.wait_for(condition, timeout_s)

    # --- protocol ------------------------------------------------------------------

    def reply(self, request: Request) -> Reply:
        """The protocol's answer to ``request`` (subclasses implement it)."""
        raise NotImplementedError

    def _serve(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        request = Request(
            method=handler.command, path=parts.path,
            query={k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()},
            headers={k.lower(): v for k, v in handler.headers.items()},
            body=handler.rfile.read(length) if length else b"",
            received_unix_s=time.time(),
        )
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()
            bad = self._misbehaviour.get(request.path)
        if bad is not None:
            if bad.delay_s:
                self._closing.wait(bad.delay_s)
            if bad.drop:
                handler.close_connection = True
                return
            reply = Reply(bad.status, bad.body, bad.headers)
        else:
            reply = self.reply(request)
        try:
            handler.send_response(reply.status)
            for name, value in reply.headers.items():
                handler.send_header(name, value)
            handler.send_header("Content-Length", str(len(reply.body)))
            handler.end_headers()
            handler.wfile.write(reply.body)
        except ConnectionError:
            pass  # the client gave up (timeout, body too large)


def rfc3339(unix_s: float) -> str:
    """``2017-09-18T08:22:00Z``, as AWS writes times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


def rfc1123(unix_s: float) -> str:
    """``Tue, 09 Aug 2022 17:07:32 GMT``, as Azure writes NotBefore."""
    return email.utils.formatdate(unix_s, usegmt=True)


class FakeAws(FakeServer):
    """IMDSv2: token PUT, token-checked GETs, 404 until a notice is set.

    Args:
        token_life_s: how long issued tokens really last, in seconds (``None``: the TTL the
            client asked for); a short life plays tokens that expire under the client.
        disabled: answer 403 everywhere (IMDS turned off).
    """

    TOKEN_PATH = "/latest/api/token"
    INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"

    def __init__(self, *, token_life_s: float | None = None, disabled: bool = False) -> None:
        self.token_life_s = token_life_s
        self.disabled = disabled
        self.tokens: dict[str, float] = {}  # token -> expiry (time.monotonic())
        self.documents: dict[str, bytes] = {}
        super().__init__()

    def set_instance_action(self, action: str, time_unix_s: float) -> bytes:
        """Announce a spot interruption; returns the body served."""
        return self._set(self.INSTANCE_ACTION_PATH, {"action": action, "time": rfc3339(time_unix_s)})

    def set_rebalance(self, notice_unix_s: float) -> bytes:
        """Announce a rebalance recommendation; returns the body served."""
        return self._set(self.REBALANCE_PATH, {"noticeTime": rfc3339(notice_unix_s)})

    def expire_tokens(self) -> None:
        """Every token issued so far stops working (401 from now on)."""
        with self._changed:
            self.tokens.clear()

    def _set(self, path: str, doc: dict) -> bytes:
        body = json.dumps(doc).encode()
        with self._changed:
            self.documents[path] = body
        return body

    def reply(self, request: Request) -> Reply:
        if self.disabled:
            return Reply(403)
        if request.path == self.TOKEN_PATH:
            return self._token(request)
        if request.method != "GET":
            return Reply(405)
        with self._changed:
            expiry = self.tokens.get(request.headers.get("x-aws-ec2-metadata-token", ""))
            if expiry is None or time.monotonic() >= expiry:
                return Reply(401)
            body = self.documents.get(request.path)
        return Reply(404) if body is None else Reply(200, body, {"Content-Type": "text/plain"})

    def _token(self, request: Request) -> Reply:
        if request.method != "PUT" or "x-forwarded-for" in request.headers:
            return Reply(403 if request.method == "PUT" else 405)
        try:
            ttl_s = int(request.headers["x-aws-ec2-metadata-token-ttl-seconds"])
        except (KeyError, ValueError):
            return Reply(400)
        if not 1 <= ttl_s <= 21600:
            return Reply(400)
        token = secrets.token_urlsafe(32)
        life_s = ttl_s if self.token_life_s is None else self.token_life_s
        with self._changed:
            self.tokens[token] = time.monotonic() + life_s
        return Reply(200, token.encode(), {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl_s)})


class FakeGcp(FakeServer):
    """GCP metadata: ``Metadata-Flavor: Google`` required, values with ETags, long polls."""

    PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
    MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
    #: Longest a long poll blocks when the client gives no timeout_sec, in seconds.
    MAX_WAIT_S = 60.0

    def __init__(self) -> None:
        self.values = {self.PREEMPTED_PATH: "FALSE", self.MAINTENANCE_PATH: "NONE"}
        super().__init__()

    def set_preempted(self, preempted: bool = True) -> None:
        """``instance/preempted`` becomes ``TRUE`` (or ``FALSE``); long polls waiting on it answer."""
        self._set(self.PREEMPTED_PATH, "TRUE" if preempted else "FALSE")

    def set_maintenance_event(self, value: str) -> None:
        """``instance/maintenance-event`` becomes ``value``; long polls waiting on it answer."""
        self._set(self.MAINTENANCE_PATH, value)

    def _set(self, path: str, value: str) -> None:
        with self._changed:
            self.values[path] = value
            self._changed.notify_all()

    @staticmethod
    def etag(value: str) -> str:
        """The ETag served with ``value`` (16 hex digits of its SHA-256)."""
        return hashlib.sha256(value.encode()).hexdigest()[:16]

    def reply(self, request: Request) -> Reply:
        if request.headers.get("metadata-flavor") != "Google":
            return Reply(403, b"Missing Metadata-Flavor:Google header.")
        if request.method != "GET" or request.path not in self.values:
            return Reply(404)
        with self._changed:
            value = self.values[request.path]
            if request.query.get("wait_for_change") == "true":
                last_etag = request.query.get("last_etag")
                try:
                    wait_s = float(request.query.get("timeout_sec", self.MAX_WAIT_S))
                except ValueError:
                    return Reply(400)
                start_etag = last_etag if last_etag is not None else self.etag(value)
                self._changed.wait_for(
                    lambda: self.etag(self.values[request.path]) != start_etag or self._closing.is_set(),
                    min(wait_s, self.MAX_WAIT_S),
                )
                value = self.values[request.path]
        return Reply(200, value.encode(),
                     {"ETag": self.etag(value), "Metadata-Flavor": "Google", "Content-Type": "application/text"})


class FakeAzure(FakeServer):
    """Azure IMDS: Scheduled Events (``Metadata: true`` required) and the VM's name.

    Args:
        vm_name: answered by ``compute/name``; ``None`` makes that endpoint 404.
    """

    EVENTS_PATH = "/metadata/scheduledevents"
    NAME_PATH = "/metadata/instance/compute/name"

    def __init__(self, vm_name: str | None = "vm-1") -> None:
        self.vm_name = vm_name
        self.incarnation = 1
        self.events: list[dict] = []
        self.start_requests: list[dict] = []  # parsed bodies of valid acknowledgement POSTs
        super().__init__()

    def add_event(self, event_type: str = "Preempt", resources: list[str] | None = None,
                  not_before_unix_s: float | None = None, **fields: object) -> dict:
        """Schedule an event (for this VM unless ``resources`` says otherwise); returns it."""
        event = {
            "EventId": str(uuid.uuid4()).upper(), "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": [self.vm_name] if resources is None else resources, "EventStatus": "Scheduled",
            "NotBefore": "" if not_before_unix_s is None else rfc1123(not_before_unix_s),
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1, **fields,
        }
        with self._changed:
            self.events.append(event)
            self.incarnation += 1
        return event

    def remove_event(self, event_id: str) -> None:
        """The event vanishes (cancelled or done)."""
        with self._changed:
            self.events = [e for e in self.events if e["EventId"] != event_id]
            self.incarnation += 1

    def reply(self, request: Request) -> Reply:
        if request.headers.get("metadata") != "true" or "api-version" not in request.query:
            return Reply(400, b'{"error": "Bad request"}')
        if request.path == self.NAME_PATH and request.method == "GET" and self.vm_name is not None:
            return Reply(200, self.vm_name.encode(), {"Content-Type": "text/plain"})
        if request.path != self.EVENTS_PATH:
            return Reply(404)
        with self._changed:
            if request.method == "GET":
                doc = {"DocumentIncarnation": self.incarnation, "Events": list(self.events)}
                return Reply(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})
            if request.method == "POST":
                if not _valid_start_requests(request.body):
                    return Reply(400)
                self.start_requests.append(json.loads(request.body))
                return Reply(200)
        return Reply(405)


def _valid_start_requests(body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    starts = doc.get("StartRequests") if isinstance(doc, dict) else None
    return (isinstance(starts, list) and bool(starts)
            and all(isinstance(s, dict) and isinstance(s.get("EventId"), str) for s in starts))
