"""A tiny, bounded HTTP client for metadata servers (standard library only).

Metadata servers are plain HTTP on a link-local address or a loopback fake, so
:mod:`http.client` is used directly: unlike :mod:`urllib.request` it never goes through an
``http_proxy`` from the environment (a proxy cannot reach 169.254.169.254), and it lets every
read be bounded. Every failure to get a complete answer (refused, unreachable, a name that
does not resolve, a timeout, a broken or oversized response) becomes a
:class:`~spotrun.notices.base.PollProblem` whose ``key`` names the kind of failure, so a
poller can log each kind once.
"""

from __future__ import annotations

import http.client
import socket
import time
from dataclasses import dataclass
from email.message import Message
from urllib.parse import urlsplit

from spotrun.errors import ConfigError
from spotrun.notices.base import PollProblem

#: Largest response body read from a metadata server, in bytes; longer ones are refused.
MAX_BODY_BYTES = 64 * 1024
_CHUNK_BYTES = 16 * 1024


@dataclass(frozen=True)
class HttpResponse:
    """A complete response.

    Attributes:
        status: the HTTP status code.
        headers: the response headers (case-insensitive lookup with ``.get``).
        body: the whole body, at most ``max_body_bytes`` long.
    """

    status: int
    headers: Message
    body: bytes

    def text(self) -> str:
        """The body decoded as UTF-8 (invalid bytes replaced)."""
        return self.body.decode("utf-8", errors="replace")


def check_base_url(url: str, what: str) -> str:
    """Return ``url`` without a trailing slash after checking it is ``http://host[:port]``.

    Raises:
        ConfigError: not an ``http`` URL with a host, or with a path, query or bad port.
    """
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as exc:
        raise ConfigError(f"{what}: bad URL {url!r}: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"{what}: expected http://HOST[:PORT], got {url!r}")
    return url.rstrip("/")


def request(
    url: str,
    *,
    timeout_s: float,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> HttpResponse:
    """Send one request and read the whole response within about ``timeout_s`` seconds.

    Args:
        url: ``http://host[:port]/path?query``.
        timeout_s: bound on connecting and on the whole body read, in seconds.
        method, headers, body: the request.
        max_body_bytes: longer bodies are refused.

    Returns:
        The response, whatever its status code.

    Raises:
        PollProblem: no complete response (keys ``"refused"``, ``"unreachable"``,
            ``"timeout"``, ``"bad response"``, ``"body too large"``).
    """
    parts = urlsplit(url)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    deadline = time.monotonic() + timeout_s
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        _set_timeout(conn, deadline)
        response = conn.getresponse()
        data = _read_body(conn, response, deadline, max_body_bytes, url)
        return HttpResponse(status=response.status, headers=response.msg, body=data)
    except PollProblem:
        raise
    except TimeoutError as exc:
        raise PollProblem("timeout", f"no answer from {url} within {timeout_s:g} s") from exc
    except ConnectionRefusedError as exc:
        raise PollProblem("refused", f"connection to {url} refused") from exc
    except socket.gaierror as exc:
        raise PollProblem("unreachable", f"cannot resolve the host of {url}: {exc.strerror or exc}") from exc
    except (http.client.HTTPException, ConnectionError) as exc:
        raise PollProblem("bad response", f"broken HTTP response from {url}: {exc!r}") from exc
    except OSError as exc:
        raise PollProblem("unreachable", f"cannot reach {url}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # e.g. a header value with a newline (a hostile token)
        raise PollProblem("bad request", f"cannot send the request to {url}: {exc}") from exc
    finally:
        conn.close()


def _set_timeout(conn: http.client.HTTPConnection, deadline: float) -> None:
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise TimeoutError("deadline passed")
    if conn.sock is not None:
        conn.sock.settimeout(remaining_s)


def _read_body(conn, response, deadline: float, max_body_bytes: int, url: str) -> bytes:
    chunks: list[bytes] = []
    size_bytes = 0
    while True:
        _set_timeout(conn, deadline)
        chunk = response.read1(_CHUNK_BYTES)
        if not chunk:
            return b"".join(chunks)
        size_bytes += len(chunk)
        if size_bytes > max_body_bytes:
            raise PollProblem("body too large", f"response from {url} is longer than {max_body_bytes} bytes")
        chunks.append(chunk)
