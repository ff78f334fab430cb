"""The wire format between the fast tiers of a job's nodes (:mod:`spotrun.storage.tier_server`,
:mod:`spotrun.storage.tier_peers`): frames of a bounded JSON header and a declared payload, on a
TCP connection that both ends authenticate with the job's secret before anything else.

A frame is a 4-byte big-endian header length, the header (UTF-8 JSON, at most
:data:`MAX_HEADER_BYTES`), then ``header["payload_bytes"]`` raw bytes. The handshake: the server
sends ``{"challenge": hex}``; the client answers ``{"mac": HMAC(secret, challenge), "challenge":
hex}``; the server checks it in constant time and answers ``{"ok": true, "mac": HMAC(secret,
client's challenge)}``, which the client checks in turn, so neither end talks to a stranger.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import time
from typing import Any

#: Largest header a peer may send (an op and its key; a listing is a payload).
MAX_HEADER_BYTES = 64 * 1024
#: Largest payload of one frame other than a replica's file (a listing, a range read).
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
#: Bytes of a challenge; the secret generated when the user gives none.
CHALLENGE_BYTES = 32
SECRET_BYTES = 32
#: Protocol version, in the handshake: peers of another spotrun version are refused, not misread.
VERSION = 1
_LENGTH = struct.Struct(">I")


class ProtocolError(Exception):
    """A peer broke the protocol (a malformed or oversized frame, a bad MAC): the connection is dropped."""


def new_secret() -> bytes:
    """A fresh per-job secret."""
    return secrets.token_bytes(SECRET_BYTES)


def mac(secret: bytes, challenge: bytes) -> str:
    """The hex HMAC-SHA256 of ``challenge`` under ``secret``."""
    return hmac.new(secret, b"spotrun-tier-v%d:" % VERSION + challenge, hashlib.sha256).hexdigest()


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Send one frame (``payload_bytes`` is set from ``payload``)."""
    body = json.dumps({**header, "payload_bytes": len(payload)}, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise ProtocolError(f"a header of {len(body)} bytes is over the limit of {MAX_HEADER_BYTES}")
    sock.sendall(_LENGTH.pack(len(body)) + body)
    if len(payload):
        sock.sendall(payload)


def recv_header(sock: socket.socket) -> dict[str, Any]:
    """Read one frame's header; its payload (``header["payload_bytes"]``) is read by the caller,
    which bounds it (:func:`recv_payload`, :func:`recv_exactly_into`)."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"a header of {length} bytes is over the limit of {MAX_HEADER_BYTES}")
    try:
        header = json.loads(_recv_exactly(sock, length))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a header that is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("a header that is not a JSON object")
    size = header.get("payload_bytes", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ProtocolError(f"a payload size that is not a count of bytes: {size!r}")
    return header


def recv_payload(sock: socket.socket, header: dict[str, Any], limit_bytes: int = MAX_PAYLOAD_BYTES) -> bytes:
    """The payload announced by ``header``, refused over ``limit_bytes``."""
    size = header.get("payload_bytes", 0)
    if size > limit_bytes:
        raise ProtocolError(f"a payload of {size} bytes is over the limit of {limit_bytes}")
    return _recv_exactly(sock, size)


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the connection."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-frame")
        got += n


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    recv_exactly_into(sock, memoryview(buffer))
    return bytes(buffer)


class _Deadline:
    """A socket whose reads and writes share one deadline: a peer that sends a byte at a time
    cannot stretch the handshake past it (each call's timeout is the time left)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self._sock, self._end = sock, time.monotonic() + timeout_s

    def _left(self) -> float:
        left_s = self._end - time.monotonic()
        if left_s <= 0:
            raise TimeoutError("the handshake took too long")
        return left_s

    def recv_into(self, view: memoryview) -> int:
        self._sock.settimeout(self._left())
        return self._sock.recv_into(view)

    def sendall(self, data: bytes | memoryview) -> None:
        self._sock.settimeout(self._left())
        self._sock.sendall(data)


def server_handshake(sock: socket.socket, secret: bytes, timeout_s: float | None = None) -> dict[str, Any]:
    """The server's side of the handshake, all of it within ``timeout_s`` seconds when given;
    returns the client's hello (its ``node``), or raises :class:`ProtocolError` (a wrong MAC,
    another version) or :class:`TimeoutError`."""
    if timeout_s is not None:
        sock = _Deadline(sock, timeout_s)  # type: ignore[assignment]
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    send_frame(sock, {"challenge": challenge.hex(), "version": VERSION})
    hello = recv_header(sock)
    recv_payload(sock, hello, 0)
    given, theirs = hello.get("mac"), hello.get("challenge")
    if hello.get("version") != VERSION:
        raise ProtocolError(f"protocol version {hello.get('version')!r}, not {VERSION}")
    if not isinstance(given, str) or not hmac.compare_digest(given, mac(secret, challenge)):
        raise ProtocolError("the job's secret was not proven")
    if not isinstance(theirs, str) or len(theirs) != 2 * CHALLENGE_BYTES:
        raise ProtocolError("no challenge for the server")
    try:
        answer = mac(secret, bytes.fromhex(theirs))
    except ValueError:
        raise ProtocolError("a challenge that is not hex") from None
    send_frame(sock, {"ok": True, "mac": answer})
    return hello


def client_handshake(sock: socket.socket, secret: bytes, node: str) -> None:
    """The client's side of the handshake; raises :class:`ProtocolError` when the server does not
    prove the same secret."""
    opening = recv_header(sock)
    recv_payload(sock, opening, 0)
    if opening.get("version") != VERSION:
        raise ProtocolError(f"the peer speaks protocol version {opening.get('version')!r}, not {VERSION}")
    try:
        challenge = bytes.fromhex(str(opening.get("challenge")))
    except ValueError:
        raise ProtocolError("the peer's challenge is not hex") from None
    ours = secrets.token_bytes(CHALLENGE_BYTES)
    send_frame(sock, {"mac": mac(secret, challenge), "challenge": ours.hex(), "version": VERSION, "node": node})
    answer = recv_header(sock)
    recv_payload(sock, answer, 0)
    given = answer.get("mac")
    if not answer.get("ok") or not isinstance(given, str) or not hmac.compare_digest(given, mac(secret, ours)):
        raise ProtocolError(f"the peer did not prove the job's secret ({answer.get('error', 'no answer')})")
