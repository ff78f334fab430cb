"""The fast tier of a job on several nodes, seen from one node: its own tier directory (where its
ranks write) and the tiers of the other nodes, read over :mod:`spotrun.storage.tier_protocol`
from their supervisors' :mod:`~spotrun.storage.tier_server`.

:class:`JobTier` is a :class:`~spotrun.storage.base.Storage`: a listing is every node's keys,
a read takes a key from this node when it holds a copy, else from the first peer that answers,
so the read planner, the block digests, the fall-through and resharding work on it unchanged. A
peer that does not answer within the timeout is skipped (and said), never waited on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from spotrun.errors import ObjectNotFoundError, ObjectTooShortError, StorageError
from spotrun.storage import tier_protocol as wire
from spotrun.storage.base import ByteSource, ChunkCallback, ObjectInfo, Storage
from spotrun.storage.tier_dir import PEERS_FILE
from spotrun.storage.tier_holdings import NodeHoldings

log = logging.getLogger("spotrun.checkpointer")

#: Default bound of one request to a peer, in seconds.
DEFAULT_PEER_TIMEOUT_S = 10.0
#: Seconds a peer that failed is left out before it is asked again.
PEER_DOWN_S = 60.0
#: Largest range asked of a peer at once (a read of more is split).
READ_PIECE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Peer:
    """Another node's tier server.

    Attributes:
        node: the node's name (its tier directory's name).
        host, port: where its supervisor serves it.
        secret: the job's secret as that node holds it.
        domain: the node's failure domain (``--memory-failure-domain``), if it was given one.
    """

    node: str
    host: str
    port: int
    secret: bytes
    domain: str | None = None

    def to_json(self) -> dict:
        doc = {"node": self.node, "host": self.host, "port": self.port, "secret": self.secret.hex()}
        return doc if self.domain is None else {**doc, "domain": self.domain}

    @staticmethod
    def from_json(value: dict) -> Peer:
        domain = value.get("domain")
        return Peer(
            str(value["node"]),
            str(value["host"]),
            int(value["port"]),
            bytes.fromhex(value["secret"]),
            None if domain is None else str(domain),
        )


class PeerError(StorageError):
    """A peer did not answer in time, broke the protocol, or refused."""


class RateLimit:
    """At most ``bytes_per_s`` on average (``None``: no limit), shared by the threads that take from it."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self._next_s = time.monotonic()
        self._lock = threading.Lock()

    def take(self, size_bytes: int) -> None:
        if not self.bytes_per_s:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_s)
            self._next_s = start + size_bytes / self.bytes_per_s
        if start > now:
            time.sleep(start - now)


class PeerClient:
    """Requests to one peer, over a few kept connections (each authenticated once)."""

    def __init__(self, peer: Peer, own_node: str, timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> None:
        self.peer = peer
        self._own_node = own_node
        self.timeout_s = timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"node {self.peer.node} ({self.peer.host}:{self.peer.port})"

    @contextlib.contextmanager
    def _connection(self) -> Iterator[socket.socket]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        try:
            if conn is None:
                conn = socket.create_connection((self.peer.host, self.peer.port), timeout=self.timeout_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                wire.client_handshake(conn, self.peer.secret, self._own_node)
            yield conn
        except (OSError, wire.ProtocolError) as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, StorageError):
                raise
            raise PeerError(errno.EIO, f"fast tier of {self}: {type(exc).__name__}: {exc}") from exc
        else:
            with self._lock:
                self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _call(self, header: dict, receive: Callable[[socket.socket, dict], object] | None = None) -> object:
        """Send ``header``; the answer's payload is read by ``receive`` (else it must be empty)."""
        with self._connection() as conn:
            wire.send_frame(conn, header)
            answer = wire.recv_header(conn)
            if not answer.get("ok"):
                wire.recv_payload(conn, answer, 0)
                _raise_answer(self, header, answer)
            if receive is None:
                wire.recv_payload(conn, answer, 0)
                return answer
            return receive(conn, answer)

    def list(self, prefix: str) -> list[ObjectInfo]:
        def receive(conn: socket.socket, answer: dict) -> list[ObjectInfo]:
            rows = json.loads(wire.recv_payload(conn, answer))
            return [ObjectInfo(str(k), int(s), float(m)) for k, s, m in rows]

        return self._call({"op": "list", "prefix": prefix}, receive)  # type: ignore[return-value]

    def stat(self, key: str) -> ObjectInfo:
        answer = self._call({"op": "stat", "key": key})
        assert isinstance(answer, dict)
        return ObjectInfo(key, int(answer["size_bytes"]), float(answer["mtime_s"]))

    def read_into(self, key: str, offset: int, view: memoryview) -> None:
        for start in range(0, len(view), READ_PIECE_BYTES):
            piece = view[start : start + READ_PIECE_BYTES]

            def receive(conn: socket.socket, answer: dict, piece: memoryview = piece) -> None:
                if answer.get("payload_bytes") != len(piece):
                    raise wire.ProtocolError(f"{answer.get('payload_bytes')} bytes answered for {len(piece)}")
                wire.recv_exactly_into(conn, piece)

            self._call({"op": "read", "key": key, "offset": offset + start, "length": len(piece)}, receive)

    def delete(self, key: str) -> None:
        self._call({"op": "delete", "key": key})

    def put_file(self, source_node: str, key: str, path: str, rate: RateLimit | None = None) -> int:
        """Send the file at ``path`` as ``source_node``'s replica of ``key``; returns its size."""
        with open(path, "rb") as file, self._connection() as conn:
            size = os.fstat(file.fileno()).st_size
            header = {"op": "put", "source": source_node, "key": key, "payload_bytes": size}
            body = json.dumps(header, separators=(",", ":")).encode()
            conn.sendall(len(body).to_bytes(4, "big") + body)
            sent = 0
            while sent < size:
                piece = file.read(min(1024 * 1024, size - sent))
                if not piece:
                    raise wire.ProtocolError(f"{path} ended at {sent} of {size} bytes while sent")
                if rate is not None:
                    rate.take(len(piece))
                conn.sendall(piece)
                sent += len(piece)
            answer = wire.recv_header(conn)
            wire.recv_payload(conn, answer, 0)
            if not answer.get("ok"):
                _raise_answer(self, header, answer)
            return size

    def replica_done(self, source_node: str) -> None:
        self._call({"op": "replica_done", "source": source_node})

    def leaving(self) -> bool:
        """Whether the node is being preempted itself (its supervisor got a notice)."""
        answer = self._call({"op": "status"})
        return bool(answer.get("leaving"))  # type: ignore[union-attr]


def _raise_answer(client: PeerClient, header: dict, answer: dict) -> None:
    what = f"{header.get('op')} {header.get('key', header.get('prefix', ''))} on {client}: {answer.get('error')}"
    if answer.get("kind") == "not_found":
        raise ObjectNotFoundError(errno.ENOENT, what)
    if answer.get("kind") == "too_short":
        raise ObjectTooShortError(errno.EIO, what)
    raise PeerError(errno.EIO, what)


class JobTier(Storage):
    """The job's fast tier as one store: writes go to this node's tier; reads and listings cover
    every node's (see the module's docstring).

    Args:
        tier_path: this node's tier directory.
        peers: the other nodes' tier servers.
        own_node: this node's name, told to the peers.
        timeout_s: bound of each request to a peer.
    """

    #: A committed step's manifest is copied into every node's tier (:func:`spotrun.checkpoint.save.commit_save`),
    #: so that each node holds whole steps: its replicator copies a step once its manifest is here.
    manifest_on_every_node = True

    def __init__(self, tier_path: str, peers: Sequence[Peer], own_node: str, timeout_s: float) -> None:
        self.holdings = NodeHoldings(tier_path)
        self.own_node = own_node
        self.local = self.holdings.own
        self.peers = [PeerClient(p, own_node, timeout_s) for p in peers]
        self._holders: dict[str, list[PeerClient]] = {}
        self._lock = threading.Lock()
        self._down: dict[str, float] = {}  # node -> until when it is left out (it failed)
        #: bytes this process read from peers (``restore`` reports it)
        self.peer_bytes_read = 0
        self.read_from: set[str] = set()

    @property
    def uri(self) -> str:
        return self.local.uri

    @property
    def commit_primitive(self) -> str | None:
        return self.local.commit_primitive

    @property
    def read_concurrency(self) -> int:
        return self.local.read_concurrency

    def step_holders(self, step_dir: str) -> list[str]:
        """The nodes that held files of the step directory ``step_dir`` at the last listing (this node first)."""
        nodes = [self.own_node] if self.holdings.list(step_dir + "/") else []
        with self._lock:
            found = {p.peer.node for k, peers in self._holders.items() if k.startswith(step_dir + "/") for p in peers}
        return nodes + sorted(found)

    def holders(self, key: str) -> int:
        """How many nodes held ``key`` at the last listing (this one counted)."""
        local = 1 if self.holdings.holder(key) is not None else 0
        with self._lock:
            return local + len(self._holders.get(key, []))

    def close(self) -> None:
        for peer in self.peers:
            peer.close()

    # writes: this node's tier
    def _put(self, key: str, data: memoryview) -> None:
        self.local._put(key, data)

    def _put_if_absent(self, key: str, data: memoryview) -> None:
        self.local._put_if_absent(key, data)

    def _put_stream(self, key: str, source: ByteSource, chunk_bytes: int, on_chunk: ChunkCallback | None) -> None:
        self.local._put_stream(key, source, chunk_bytes, on_chunk)

    def _unfinished_uploads(self, prefix: str):
        return self.local._unfinished_uploads(prefix)

    def _abort_upload(self, upload) -> None:
        self.local._abort_upload(upload)

    # reads: this node, else the peers
    def _list(self, prefix: str) -> list[ObjectInfo]:
        found = {info.key: info for info in self.holdings.list(prefix)}
        holders: dict[str, list[PeerClient]] = {}
        for peer in self._up():
            try:
                listed = peer.list(prefix)
            except StorageError as exc:
                self._skip(peer, exc)
                continue
            for info in listed:
                found.setdefault(info.key, info)
                holders.setdefault(info.key, []).append(peer)
        with self._lock:
            for key in [k for k in self._holders if k.startswith(prefix)]:
                del self._holders[key]
            self._holders.update(holders)
        return list(found.values())

    def _candidates(self, key: str) -> list[PeerClient]:
        with self._lock:
            listed = list(self._holders.get(key, []))
        up = self._up()
        return [p for p in listed if p in up] + [p for p in up if p not in listed]

    def _up(self) -> list[PeerClient]:
        now = time.monotonic()
        with self._lock:
            return [p for p in self.peers if self._down.get(p.peer.node, 0.0) <= now]

    def _from_peers(self, key: str, action: Callable[[PeerClient], object]) -> object:
        missing = None
        for peer in self._candidates(key):
            try:
                return action(peer)
            except ObjectNotFoundError as exc:
                missing = exc
            except StorageError as exc:  # silent, refused, or broke off: the next holder
                self._skip(peer, exc)
        raise missing or ObjectNotFoundError(errno.ENOENT, f"{key}: held by no node of the fast tier")

    def _stat(self, key: str) -> ObjectInfo:
        root = self.holdings.holder(key)
        if root is not None:
            return root.stat(key)
        return self._from_peers(key, lambda peer: peer.stat(key))  # type: ignore[return-value]

    def _get(self, key: str) -> bytes:
        info = self._stat(key)
        data = bytearray(info.size_bytes)
        self._read_into(key, 0, [memoryview(data)])
        return bytes(data)

    def _read_into(self, key: str, offset: int, views: list[memoryview]) -> None:
        root = self.holdings.holder(key)
        if root is not None:
            root.read_into(key, offset, views)
            return
        total = sum(len(v) for v in views)
        buffer = bytearray(total)  # one request per range; the views are filled after it arrived whole

        def read(peer: PeerClient) -> None:
            peer.read_into(key, offset, memoryview(buffer))
            with self._lock:
                self.peer_bytes_read += total
                self.read_from.add(peer.peer.node)

        self._from_peers(key, read)
        at = 0
        for view in views:
            view[:] = buffer[at : at + len(view)]
            at += len(view)

    def _delete(self, key: str) -> None:
        self.holdings.delete(key)
        for peer in self._up():
            try:
                peer.delete(key)
            except StorageError as exc:
                self._skip(peer, exc)

    def _skip(self, peer: PeerClient, exc: Exception) -> None:
        """Leave ``peer`` out for :data:`PEER_DOWN_S` (a silent peer costs one timeout, not one per read)."""
        with self._lock:
            self._down[peer.peer.node] = time.monotonic() + PEER_DOWN_S
        log.warning("the fast tier of %s is left out for %.0f s: %s", peer, PEER_DOWN_S, exc)


def job_tier_of(tier_path: str, timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> JobTier:
    """The job's fast tier seen from the tier directory ``tier_path``: its own files and replicas,
    and the nodes its workers last named (:data:`~spotrun.storage.tier_dir.PEERS_FILE`; none: this
    node alone).

    Raises:
        OSError, ValueError, KeyError: the peers file is there but cannot be read.
    """
    own = os.path.basename(os.path.normpath(tier_path))
    try:
        with open(os.path.join(tier_path, PEERS_FILE)) as file:
            doc = json.load(file)
    except FileNotFoundError:
        doc = {"nodes": []}
    peers = [p for p in (Peer.from_json(n) for n in doc["nodes"]) if p.node != own]
    return JobTier(tier_path, peers, own, timeout_s)
