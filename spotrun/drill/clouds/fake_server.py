"""The part every fake cloud metadata server shares: :class:`FakeServer`, a real HTTP server
on 127.0.0.1 that records each :class:`Request` and answers it by its protocol
(:meth:`FakeServer.reply`, one subclass per cloud next to this module) or as told
(:meth:`FakeServer.misbehave`: a status, a body, a delay, a dropped connection) to play a
broken or hostile server.

``spotrun drill`` serves its notice from these fakes and the tests use them to play the clouds.
Use them as context managers; :attr:`FakeServer.url` is ``http://127.0.0.1:PORT`` and
:attr:`FakeServer.host_port` is ``127.0.0.1:PORT``. Standard library only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    import http.server


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
        import http.server  # here: the spotrun CLI imports this module to build its parser

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

    def misbehave(
        self,
        path: str,
        *,
        status: int = 200,
        body: bytes | str = b"",
        delay_s: float = 0.0,
        drop: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
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
            method=handler.command,
            path=parts.path,
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
