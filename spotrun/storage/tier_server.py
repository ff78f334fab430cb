"""Serves one node's fast tier to the other nodes of its job (run by the supervisor): listings,
byte ranges, deletes, and replicas of their files written here (:mod:`spotrun.storage.tier_protocol`).

Only a peer that proves the job's secret is served; a frame that breaks the protocol, a key
outside the tier, or a connection that stays silent past the timeout is logged and dropped. A
bounded number of connections is served at once; the others are closed at once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
from typing import Any

from spotrun.errors import ConfigError, ObjectTooShortError, SpotrunError
from spotrun.storage import tier_protocol as wire
from spotrun.storage.base import _check_key as check_key
from spotrun.storage.tier_holdings import NodeHoldings, check_node

log = logging.getLogger("spotrun.supervisor.tier")

#: Connections served at once (a node's ranks reading, its peers replicating into it).
MAX_CONNECTIONS = 64
#: Seconds a connection has to complete the handshake, however it sends (a byte at a time too).
HANDSHAKE_TIMEOUT_S = 5.0
#: Handshakes under way at once from one address: a stranger cannot take every connection.
MAX_HANDSHAKES_PER_ADDRESS = 8
#: Replicated steps kept per source node (as the tier keeps: the newest and the one before).
KEPT_REPLICA_STEPS = 2
_RECV_PIECE_BYTES = 1024 * 1024
#: A step's directory, the first part of its keys (as :mod:`spotrun.checkpoint.layout` names it).
_STEP_DIR_RE = re.compile(r"^step-\d{9,}(?=/)")


class TierServer:
    """A TCP server of one tier directory.

    Args:
        tier_path: the tier directory (``steps/``, ``replicas/``).
        secret: the job's secret (:func:`~spotrun.storage.tier_protocol.new_secret`).
        host, port: where to listen (port 0: a free one; :attr:`address` says which).
        timeout_s: most seconds a connection may stay silent mid-request or idle.
        replica_limit_bytes: most bytes of one replicated file (``None``: no limit but the memory's).
    """

    def __init__(
        self,
        tier_path: str,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_s: float = 30.0,
        replica_limit_bytes: int | None = None,
    ) -> None:
        self.holdings = NodeHoldings(tier_path)
        self._secret = secret
        self._timeout_s = timeout_s
        self._replica_limit_bytes = replica_limit_bytes
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(MAX_CONNECTIONS)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._handshakes: dict[str, int] = {}  # address -> handshakes under way
        self._handshakes_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="spotrun-tier-server", daemon=True)
        #: refused connections so far (a bad secret, a malformed frame), for tests and the log
        self.refused = 0
        #: this node is being preempted: a replica held here dies with it (answered to ``status``)
        self.leaving = False

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> TierServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                log.warning("fast tier server: %s refused: %d connections already served", peer, MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="spotrun-tier-peer", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = self._handshake(conn, peer)
            if hello is None:
                return
            conn.settimeout(self._timeout_s)
            node = hello.get("node")
            while not self._closed.is_set():
                try:
                    request = wire.recv_header(conn)
                except ConnectionError:
                    return  # the peer is done
                self._answer(conn, request, node)
        except (wire.ProtocolError, ConfigError) as exc:  # a frame, a key or a name no peer of the job sends
            self.refused += 1
            log.warning("fast tier server: connection from %s dropped: %s", _peer(peer), exc)
        except (OSError, TimeoutError) as exc:  # a silent or vanished peer: its connection only
            if not self._closed.is_set() and not isinstance(exc, ConnectionError):
                log.info("fast tier server: connection from %s ended: %s", _peer(peer), exc)
        finally:
            conn.close()
            self._slots.release()

    def _handshake(self, conn: socket.socket, peer: Any) -> dict[str, Any] | None:
        """The client's hello once it proved the job's secret within :data:`HANDSHAKE_TIMEOUT_S`;
        ``None`` (logged) for a stranger, a slow one, or one address with too many handshakes at once."""
        address = peer[0] if isinstance(peer, tuple) else str(peer)
        with self._handshakes_lock:
            busy = self._handshakes.get(address, 0)
            if busy < MAX_HANDSHAKES_PER_ADDRESS:
                self._handshakes[address] = busy + 1
        if busy >= MAX_HANDSHAKES_PER_ADDRESS:
            self.refused += 1
            log.warning("fast tier server: %s refused: %d handshakes from it under way", _peer(peer), busy)
            return None
        timeout_s = min(HANDSHAKE_TIMEOUT_S, self._timeout_s)
        try:
            return wire.server_handshake(conn, self._secret, timeout_s)
        except TimeoutError:
            self.refused += 1
            log.warning(
                "fast tier server: connection from %s refused: no handshake within %.1f s", _peer(peer), timeout_s
            )
            return None
        except (wire.ProtocolError, ConfigError) as exc:
            self.refused += 1
            log.warning("fast tier server: connection from %s refused: %s", _peer(peer), exc)
            try:
                conn.settimeout(1.0)
                wire.send_frame(conn, {"ok": False, "error": "refused"})
            except OSError:
                pass
            return None
        finally:
            with self._handshakes_lock:
                self._handshakes[address] -= 1
                if not self._handshakes[address]:
                    del self._handshakes[address]

    def _answer(self, conn: socket.socket, request: dict[str, Any], node: Any) -> None:
        op = request.get("op")
        if op == "put":  # its payload is the file: read here, into the replica, never whole in memory
            self._put(conn, request)
            return
        wire.recv_payload(conn, request, 0)  # the other requests carry none
        try:
            if op == "list":
                infos = self.holdings.list(_text(request, "prefix", empty=True))
                listing = [[i.key, i.size_bytes, i.mtime_s] for i in infos]
                wire.send_frame(conn, {"ok": True}, _json(listing))
            elif op == "read":
                key, offset, length = _text(request, "key"), _count(request, "offset"), _count(request, "length")
                if length > wire.MAX_PAYLOAD_BYTES:
                    raise wire.ProtocolError(f"a read of {length} bytes is over {wire.MAX_PAYLOAD_BYTES}")
                data = bytearray(length)
                self.holdings.read_into(key, offset, [memoryview(data)])
                wire.send_frame(conn, {"ok": True}, data)
            elif op == "stat":
                info = self.holdings.stat(_text(request, "key"))
                wire.send_frame(conn, {"ok": True, "size_bytes": info.size_bytes, "mtime_s": info.mtime_s})
            elif op == "delete":
                self.holdings.delete(_text(request, "key"))
                wire.send_frame(conn, {"ok": True})
            elif op == "status":
                wire.send_frame(conn, {"ok": True, "leaving": self.leaving})
            elif op == "replica_done":
                self._prune_replicas(check_node(_text(request, "source")))
                wire.send_frame(conn, {"ok": True})
            else:
                raise wire.ProtocolError(f"an unknown op {op!r}")
        except (SpotrunError, OSError) as exc:  # the tier's own answer (a missing key): the connection stays
            wire.send_frame(conn, _error(exc))

    def _put(self, conn: socket.socket, request: dict[str, Any]) -> None:
        size = request.get("payload_bytes", 0)
        source, key = check_node(_text(request, "source")), check_key(_text(request, "key"))
        if not _STEP_DIR_RE.match(key):
            raise wire.ProtocolError(f"a replica outside a step: {key!r}")
        if self._replica_limit_bytes is not None and size > self._replica_limit_bytes:
            raise wire.ProtocolError(f"a replica of {size} bytes is over the limit of {self._replica_limit_bytes}")
        received = [0]

        def write(fd: int) -> None:
            buffer = bytearray(min(size, _RECV_PIECE_BYTES) or 1)
            view = memoryview(buffer)
            while received[0] < size:
                piece = view[: min(len(view), size - received[0])]
                wire.recv_exactly_into(conn, piece)
                received[0] += len(piece)
                os.write(fd, piece)

        try:
            self.holdings.replica_root(source)._put_written(key, write)
        except (SpotrunError, OSError) as exc:
            if received[0] < size:  # the rest of the payload must not be read as frames
                raise wire.ProtocolError(f"replica {key} of {source} not stored: {exc}") from None
            wire.send_frame(conn, _error(exc))
            return
        wire.send_frame(conn, {"ok": True})

    def _prune_replicas(self, source: str) -> None:
        root = self.holdings.replica_root(source)
        step_dirs = sorted({m.group(0) for m in (_STEP_DIR_RE.match(i.key) for i in root.list("")) if m})
        for step_dir in sorted(step_dirs, key=lambda d: int(d[5:]))[:-KEPT_REPLICA_STEPS]:
            root.delete_prefix(step_dir + "/")


def _peer(peer: Any) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _error(exc: BaseException) -> dict[str, Any]:
    kind = "error"
    if isinstance(exc, FileNotFoundError):
        kind = "not_found"
    elif isinstance(exc, ObjectTooShortError):
        kind = "too_short"
    return {"ok": False, "kind": kind, "error": f"{type(exc).__name__}: {exc}"}


def _text(request: dict[str, Any], name: str, *, empty: bool = False) -> str:
    value = request.get(name)
    if not isinstance(value, str) or (not value and not empty):
        raise wire.ProtocolError(f"{name!r} is not a string")
    return value


def _count(request: dict[str, Any], name: str) -> int:
    value = request.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise wire.ProtocolError(f"{name!r} is not a count")
    return value
