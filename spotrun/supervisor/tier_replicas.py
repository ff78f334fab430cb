"""The fast tier across nodes, on the supervisor's side: it serves this node's tier to the job's
other nodes (:class:`~spotrun.storage.tier_server.TierServer`) and copies each step its ranks
committed here to the next R nodes in the background, at a rate cap, so that a lost node's
parts are still held elsewhere.

The workers tell it who the other nodes are: their local rank 0 writes :data:`PEERS_FILE` into
the tier (the nodes in rank order, each with its server's address and secret, and R), gathered
over the job's own process group (:mod:`spotrun.train.fast_tier`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import socket
import stat
import threading
import time
from typing import Any

from spotrun.control import env as spotrun_env
from spotrun.errors import ConfigError, SpotrunError
from spotrun.storage.base import Storage
from spotrun.storage.tier_dir import PEERS_FILE, TierOwner
from spotrun.storage.tier_holdings import NodeHoldings
from spotrun.storage.tier_peers import JobTier, Peer, PeerClient, RateLimit, job_tier_of
from spotrun.storage.tier_protocol import new_secret
from spotrun.storage.tier_server import TierServer
from spotrun.supervisor.config import SupervisorConfig
from spotrun.supervisor.torchrun_command import TorchrunLaunch

log = logging.getLogger("spotrun.supervisor.tier")

#: The secret this node's server proves, in the tier directory (mode 0600).
SECRET_FILE = "secret"
#: Seconds between two looks for a step to replicate.
POLL_S = 0.2
#: A step whose copy failed this many times is given up (said): the next step is copied instead.
ATTEMPTS_PER_STEP = 3
#: Bytes per second assumed for a replica's copy without a rate cap or a measurement.
UNCAPPED_RATE_BYTES_S = 1 << 30


def listen_host(given: str | None, launch: TorchrunLaunch | None) -> str:
    """Where the tier server listens: ``given``; else 127.0.0.1 for a rendezvous on loopback (or
    none); else the address this node reaches the rendezvous host from."""
    if given:
        return given
    host = launch.rendezvous_host if launch is not None else None
    if not host or host == "localhost" or _loopback(host):
        return "127.0.0.1"
    try:  # no packet is sent: connecting a UDP socket only picks the route
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError as exc:
        log.warning("cannot tell which address reaches %s (%s): the fast tier is served on 127.0.0.1", host, exc)
        return "127.0.0.1"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TierService:
    """This node's tier server and replicator, for the supervisor's lifetime."""

    def __init__(self, config: SupervisorConfig, tier: TierOwner, launch: TorchrunLaunch | None) -> None:
        self.tier = tier
        self.node = os.path.basename(tier.path)
        self._config = config
        secret = read_secret(config.memory_replica_secret_file) if config.memory_replica_secret_file else new_secret()
        self.secret_file = os.path.join(tier.path, SECRET_FILE)
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secret.hex())
        host = listen_host(config.memory_replica_address, launch)
        # an idle connection of a peer is kept a while: its next request needs no new handshake
        idle_s = max(30.0, 3 * config.memory_peer_timeout_s)
        self.server = TierServer(tier.path, secret, host, 0, timeout_s=idle_s).start()
        self._holdings = NodeHoldings(tier.path)
        self._rate = RateLimit(config.memory_replica_rate_bytes_s)
        self._closed = threading.Event()
        self._replicated: dict[int, set[str]] = {}  # step -> nodes holding its replica
        self._failures: dict[int, int] = {}
        self._copied = threading.Condition()  # told of every replica made or given up
        self._measured_bytes_s: float | None = None  # of the newest replica copied
        self._clients: dict[str, PeerClient] = {}
        self._thread = threading.Thread(target=self._replicate_forever, name="spotrun-tier-replicas", daemon=True)
        self._thread.start()
        host, port = self.server.address
        log.info("fast tier served to the job's other nodes on %s:%d", host, port)

    def env(self) -> dict[str, str]:
        """What the workers need to find this server and prove the secret."""
        host, port = self.server.address
        env = {
            spotrun_env.MEMORY_NODE: self.node,
            spotrun_env.MEMORY_PEER_ADDRESS: f"{host}:{port}",
            spotrun_env.MEMORY_SECRET_FILE: self.secret_file,
            spotrun_env.MEMORY_PEER_TIMEOUT_S: str(self._config.memory_peer_timeout_s),
        }
        if self._config.memory_replicas is not None:
            env[spotrun_env.MEMORY_REPLICAS] = str(self._config.memory_replicas)
        if self._config.memory_failure_domain:
            env[spotrun_env.MEMORY_FAILURE_DOMAIN] = self._config.memory_failure_domain
        return env

    def view(self) -> JobTier:
        """The job's fast tier as this supervisor can see it for its resume decision: this node's
        own and replicated files, and the nodes its workers last named (none after a fresh start on
        a new node: then its workers' restore may still find more than it does)."""
        try:
            return job_tier_of(self.tier.path, self._config.memory_peer_timeout_s)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("cannot read the fast tier's peers file (%s): deciding from this node's tier", exc)
            return JobTier(self.tier.path, [], self.node, self._config.memory_peer_timeout_s)

    def target_nodes(self) -> list[str]:
        """The nodes this node's steps are copied to (none on one node, or before the workers said)."""
        try:
            nodes, replicas = _read_peers(self.tier.path)
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return [peer.node for peer in replica_targets(self.node, nodes, replicas)]

    def copy_rate_bytes_s(self) -> float:
        """Bytes per second a replica copies at: as the newest one did, else the rate cap."""
        cap = self._config.memory_replica_rate_bytes_s or UNCAPPED_RATE_BYTES_S
        return min(cap, self._measured_bytes_s or cap)

    @property
    def own_steps(self) -> Storage:
        """This node's own steps (its ranks' files and the manifests), without replicas or peers."""
        return self._holdings.own

    def mark_leaving(self) -> None:
        """This node got a preemption notice: its server says so to the nodes that ask, so that none
        of them counts on a replica held here."""
        self.server.leaving = True

    def staying(self, nodes: set[str]) -> set[str]:
        """Those of ``nodes`` that answer and are not being preempted themselves (each asked once,
        within the peer timeout)."""
        staying = set()
        for node in sorted(nodes):
            client = self._clients.get(node)
            try:
                if client is not None and not client.leaving():
                    staying.add(node)
            except (SpotrunError, OSError) as exc:
                log.warning("fast tier: node %s did not say whether it stays (%s): not counted on", node, exc)
        return staying

    def wait_replicated(self, step: int, timeout_s: float) -> set[str]:
        """Wait up to ``timeout_s`` seconds until every target holds ``step`` (or its copy was given
        up); the nodes that hold it."""
        give_up = time.monotonic() + max(0.0, timeout_s)
        wanted = set(self.target_nodes())  # read once: the job's nodes do not change while it stops
        with self._copied:
            while True:
                held = set(self._replicated.get(step, set()))
                left_s = give_up - time.monotonic()
                if (wanted and held >= wanted) or self._failures.get(step, 0) >= ATTEMPTS_PER_STEP or left_s <= 0:
                    return held
                self._copied.wait(min(left_s, 1.0))

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=10)
        for client in self._clients.values():
            client.close()
        self.server.close()

    def _replicate_forever(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                self._replicate_newest()
            except (SpotrunError, OSError, ValueError, KeyError, TypeError) as exc:  # said; tried again
                log.warning("fast tier: replication failed: %s", exc)
                self._closed.wait(1.0)

    def _targets(self) -> list[PeerClient]:
        """The next R nodes after this one, in rank order, from the workers' peers file."""
        try:
            nodes, replicas = _read_peers(self.tier.path)
        except FileNotFoundError:
            return []
        targets = replica_targets(self.node, nodes, replicas)
        for peer in targets:
            known = self._clients.get(peer.node)
            if known is None or known.peer != peer:
                self._clients[peer.node] = PeerClient(peer, self.node, self._config.memory_peer_timeout_s)
        return [self._clients[p.node] for p in targets]

    def _replicate_newest(self) -> None:
        targets = self._targets()
        if not targets:
            return
        by_step: dict[int, list[Any]] = {}
        for info in self._holdings.own.list(""):
            top, _, name = info.key.partition("/")
            if top.startswith("step-") and top[5:].isdigit() and info.refused is None:
                by_step.setdefault(int(top[5:]), []).append(info)
        complete = [s for s, infos in by_step.items() if any(_is_manifest(i.key) for i in infos)]
        if not complete:
            return
        step = max(complete)
        for client in targets:
            done = client.peer.node in self._replicated.get(step, set())
            if done or self._failures.get(step, 0) >= ATTEMPTS_PER_STEP:
                continue
            started = time.monotonic()
            # the manifest last: a replica with its manifest is a whole copy
            files = sorted(by_step[step], key=lambda i: (_is_manifest(i.key), i.key))
            try:
                root = self._holdings.own.uri
                sent = sum(
                    client.put_file(self.node, i.key, os.path.join(root, *i.key.split("/")), self._rate)
                    for i in files
                    if not self._closed.is_set()
                )
                client.replica_done(self.node)
            except (SpotrunError, OSError) as exc:
                with self._copied:
                    self._failures[step] = self._failures.get(step, 0) + 1
                    self._copied.notify_all()
                given_up = self._failures[step] >= ATTEMPTS_PER_STEP
                log.warning(
                    "fast tier: step %d not replicated to %s: %s%s", step, client, exc, " (given up)" * given_up
                )
                continue
            if self._closed.is_set():
                return
            elapsed_s = time.monotonic() - started
            with self._copied:
                self._replicated.setdefault(step, set()).add(client.peer.node)
                self._measured_bytes_s = sent / elapsed_s if sent and elapsed_s > 0 else self._measured_bytes_s
                self._copied.notify_all()
            log.info(
                "fast tier: step %d replicated to %s (%d files, %d bytes, %.2f s)",
                step,
                client,
                len(files),
                sent,
                elapsed_s,
            )
        with self._copied:
            for table in (self._replicated, self._failures):
                for old in [s for s in table if s < step]:
                    del table[old]


def _read_peers(tier_path: str) -> tuple[list[Peer], int]:
    """The job's nodes and the replica count, as the workers last wrote them."""
    with open(os.path.join(tier_path, PEERS_FILE)) as file:
        doc = json.load(file)
    return [Peer.from_json(n) for n in doc["nodes"]], int(doc.get("replicas", 1))


def replica_targets(node: str, nodes: list[Peer], replicas: int) -> list[Peer]:
    """The ``replicas`` nodes that hold ``node``'s steps (none when ``node`` is not among ``nodes``).

    The nodes form a ring: rank order, or, with failure domains, the domains taken in turn (each in
    rank order), so that a node's successor is in another domain where the domains are even; a
    node's targets are the next ones in the ring, those of another domain first. Each step is then on
    ``replicas`` + 1 distinct nodes (any ``replicas`` lost nodes leave a copy), a lost domain leaves
    a copy while another domain holds one, and with even domains every node holds ``replicas``
    replicas.
    """
    ring = _ring(nodes)
    names = [n.node for n in ring]
    if node not in names:
        return []
    at = names.index(node)
    after = [ring[(at + k) % len(ring)] for k in range(1, len(ring))]
    domain = ring[at].domain
    if domain is not None:
        after = [n for n in after if n.domain != domain] + [n for n in after if n.domain == domain]
    return after[: max(0, replicas)]


def _ring(nodes: list[Peer]) -> list[Peer]:
    """The nodes with the domains taken in turn (a node without a domain is a domain of its own)."""
    groups: dict[object, list[Peer]] = {}
    for index, peer in enumerate(nodes):
        groups.setdefault(peer.domain if peer.domain is not None else ("no domain", index), []).append(peer)
    columns = list(groups.values())
    return [column[row] for row in range(max(map(len, columns), default=0)) for column in columns if row < len(column)]


def _is_manifest(key: str) -> bool:
    name = key.rpartition("/")[2]
    return name.startswith("manifest") and name.endswith(".json")


def read_secret(path: str) -> bytes:
    """The job's secret from ``path``, a regular file of at least 16 bytes (never waits: a FIFO
    without a writer is refused, not read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise ConfigError(f"the fast tier's secret file {path} is not a regular file")
            data = file.read(4096).strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the fast tier's secret file {path}: {exc}") from exc
    if len(data) < 16:
        raise ConfigError(f"the fast tier's secret file {path} holds {len(data)} bytes: at least 16 are needed")
    return data


def start_tier_service(
    config: SupervisorConfig, tier: TierOwner | None, launch: TorchrunLaunch | None, stack: contextlib.ExitStack
) -> TierService | None:
    """This node's :class:`TierService` when the fast tier is on, closed with ``stack``; ``None``
    when it cannot start (said: the tier then stays on this node alone)."""
    if tier is None:
        return None
    try:
        service = TierService(config, tier, launch)
    except (OSError, ConfigError) as exc:
        if isinstance(exc, ConfigError) and config.memory_replica_secret_file:
            raise
        log.error("cannot serve the fast tier to other nodes (%s): it stays on this node", exc)
        return None
    stack.callback(service.close)
    return service
