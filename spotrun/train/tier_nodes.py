"""The job's nodes as the fast tier across nodes sees them: every node's tier server, gathered once
over the process group, and the file that tells this node's supervisor where to replicate."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from spotrun.control.env import DEFAULT_RESTORE_TIMEOUT_S, WorkerEnv
from spotrun.storage.tier_dir import PEERS_FILE
from spotrun.storage.tier_peers import DEFAULT_PEER_TIMEOUT_S, Peer
from spotrun.tools import dist

log = logging.getLogger("spotrun.checkpointer")


def multi_node() -> bool:
    """Whether this job's ranks span more than one node (torchrun's ``LOCAL_WORLD_SIZE``)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return local.isdigit() and int(local) != dist.world_size()


@dataclass(frozen=True)
class JobNodes:
    """The job's nodes as the fast tier sees them (gathered once over the process group).

    Attributes:
        nodes: each node's tier server, in rank order (the node of rank 0 first).
        node_of_rank: the node name of each rank.
        own: this rank's node.
        replicas: how many other nodes hold each node's step.
        timeout_s: bound of one request to a peer.
    """

    nodes: list[Peer]
    node_of_rank: list[str]
    own: str
    replicas: int
    timeout_s: float

    @property
    def copies(self) -> int:
        """Nodes that hold each file once the replicas are made."""
        return 1 + self.replicas


def job_nodes(
    env: WorkerEnv, *, wanted: bool, interval_steps: int, timeout_s: float = DEFAULT_RESTORE_TIMEOUT_S
) -> JobNodes | None:
    """Gather every rank's tier server (collective: every rank calls it, ``wanted`` or not);
    ``None`` when no rank wants a tier, and (said once) when a rank has none or the ranks
    disagree on the interval: the tier's saves are collectives, so it is on everywhere or nowhere."""
    mine: dict | None = None
    problem = ""
    if not wanted:
        problem = "no fast tier on its node (--memory-interval-steps unset)"
    elif env.memory_node and env.memory_peer_address and env.memory_secret_file:
        host, _, port = env.memory_peer_address.rpartition(":")
        try:
            with open(env.memory_secret_file) as file:
                secret = bytes.fromhex(file.read().strip())
            mine = Peer(env.memory_node, host.strip("[]"), int(port), secret, env.memory_failure_domain).to_json()
        except (OSError, ValueError) as exc:
            problem = f"cannot read the fast tier's secret: {exc}"
    else:
        problem = "no fast-tier server on this node (the tier across nodes needs spotrun run on each node)"
    mine_doc = {"wanted": wanted, "interval": interval_steps, "peer": mine, "problem": problem}
    gathered = dist.all_gather_json(mine_doc, timeout_s=timeout_s, what="the gather of the fast tier's nodes")
    if not any(g["wanted"] for g in gathered):
        return None
    missing = {r: g["problem"] for r, g in enumerate(gathered) if g["peer"] is None}
    intervals = sorted({g["interval"] for g in gathered})
    if missing or len(intervals) > 1:
        if dist.rank() == 0:
            why = (
                f"rank(s) {sorted(missing)} cannot share theirs ({next(iter(missing.values()))})"
                if missing
                else f"the nodes save it at different intervals ({', '.join(map(str, intervals))} steps)"
            )
            log.warning("the fast tier is off: it spans several nodes and %s; storage only", why)
        return None
    peers = [Peer.from_json(g["peer"]) for g in gathered]
    nodes: dict[str, Peer] = {}
    for peer in peers:
        nodes.setdefault(peer.node, peer)
    wanted = env.memory_replicas if env.memory_replicas is not None else 1
    job = JobNodes(
        nodes=list(nodes.values()),
        node_of_rank=[p.node for p in peers],
        own=env.memory_node or "",
        replicas=min(wanted, len(nodes) - 1),
        timeout_s=env.memory_peer_timeout_s or DEFAULT_PEER_TIMEOUT_S,
    )
    return job


def write_peers_file(tier_path: str, job: JobNodes) -> None:
    """Tell this node's supervisor the job's nodes (local rank 0): it replicates to the next ones."""
    doc = {"nodes": [p.to_json() for p in job.nodes], "replicas": job.replicas, "own": job.own}
    path = os.path.join(tier_path, PEERS_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(doc, file)
    os.replace(tmp, path)


def forget_peers(tier_path: str) -> None:
    """Tell this node's supervisor that the job is this node alone now (local rank 0): a peers file
    left by a start on several nodes would have it replicate to nodes that left."""
    try:
        os.remove(os.path.join(tier_path, PEERS_FILE))
    except FileNotFoundError:
        pass
