"""The fast tier's directory: one per job and node, in host memory (tmpfs), owned by the
``spotrun run`` that created it.

The supervisor creates it at start (:func:`create_tier`), passes it to the workers, and removes
it when it exits (:func:`release_tier`); a tier whose owner is gone (a SIGKILLed supervisor) is
stale: the next start in the same memory directory removes it (:func:`remove_stale_tiers`) and
never reads it. The steps inside are an ordinary checkpoint root (:data:`STEPS_DIR`), so the
local backend, restore and ``verify`` serve it unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The default parent of the tier directories: host memory on Linux.
DEFAULT_MEMORY_DIR = "/dev/shm/spotrun"
#: The file naming a tier's owner, inside the tier directory.
OWNER_FILE = "owner.json"
#: The checkpoint root inside a tier directory.
STEPS_DIR = "steps"
#: Written into a tier directory by the node's workers for its supervisor when the job spans
#: several nodes: the job's nodes, their tier servers and the replica count.
PEERS_FILE = "peers.json"
_PREFIX = "tier-"


@dataclass(frozen=True)
class TierOwner:
    """Who owns a tier directory.

    Attributes:
        path: the tier directory.
        pid: the owning supervisor's process id.
        pid_start_ticks: that process's start time (``/proc/PID/stat``), so a reused pid is not its owner.
        checkpoint_uri: the durable root of the job the tier belongs to, in one spelling (a local
            directory absolute: :attr:`spotrun.storage.StorageLocation.uri`).
        created_unix_s: when the tier was created.
    """

    path: str
    pid: int
    pid_start_ticks: int | None
    checkpoint_uri: str
    created_unix_s: float

    @property
    def steps_root(self) -> str:
        """The checkpoint root of the tier's steps."""
        return os.path.join(self.path, STEPS_DIR)

    def alive(self) -> bool:
        """Whether the owning process still runs (the same process, not a reuse of its pid)."""
        return _start_ticks(self.pid) is not None and _start_ticks(self.pid) == self.pid_start_ticks


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


def create_tier(memory_dir: str, checkpoint_uri: str) -> TierOwner:
    """Make a new, empty tier directory under ``memory_dir`` owned by this process.

    Raises:
        OSError: the directory cannot be created (the caller runs storage-only).
    """
    os.makedirs(memory_dir, mode=0o700, exist_ok=True)
    pid = os.getpid()
    path = os.path.join(memory_dir, f"{_PREFIX}{socket.gethostname()}-{pid}-{time.time_ns()}")
    os.mkdir(path, 0o700)
    os.mkdir(os.path.join(path, STEPS_DIR), 0o700)
    owner = TierOwner(path, pid, _start_ticks(pid), checkpoint_uri, time.time())
    doc = {k: getattr(owner, k) for k in ("pid", "pid_start_ticks", "checkpoint_uri", "created_unix_s")}
    with open(os.path.join(path, OWNER_FILE), "x") as file:
        json.dump(doc, file)
    return owner


def list_tiers(memory_dir: str) -> list[TierOwner]:
    """The tier directories under ``memory_dir`` whose owner file reads (oldest first); a missing
    ``memory_dir`` has none."""
    try:
        names = sorted(n for n in os.listdir(memory_dir) if n.startswith(_PREFIX))
    except OSError:
        return []
    tiers = []
    for name in names:
        path = os.path.join(memory_dir, name)
        try:
            with open(os.path.join(path, OWNER_FILE)) as file:
                doc = json.load(file)
            tiers.append(
                TierOwner(
                    path,
                    int(doc["pid"]),
                    None if doc.get("pid_start_ticks") is None else int(doc["pid_start_ticks"]),
                    str(doc["checkpoint_uri"]),
                    float(doc["created_unix_s"]),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            # no owner file yet (a tier being created) or a damaged one: an orphan if old
            tiers.append(TierOwner(path, -1, None, "", _mtime(path)))
    return tiers


def tiers_of(memory_dir: str, checkpoint_uri: str) -> tuple[list[TierOwner], list[TierOwner]]:
    """The tiers under ``memory_dir`` of the job whose root is ``checkpoint_uri`` (in the spelling
    the supervisor records: :attr:`spotrun.storage.StorageLocation.uri`), as ``(live, stale)``:
    a stale one's owner is gone, so it is never read."""
    mine = [t for t in list_tiers(memory_dir) if t.pid >= 0 and t.checkpoint_uri == checkpoint_uri]
    return [t for t in mine if t.alive()], [t for t in mine if not t.alive()]


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


#: A tier without a readable owner file is removed only once this old, in seconds (a supervisor
#: creating one right now writes the file within microseconds).
ORPHAN_AGE_S = 60.0


def remove_stale_tiers(memory_dir: str) -> list[str]:
    """Remove every tier under ``memory_dir`` whose owner is gone; returns their paths (each logged)."""
    removed = []
    for tier in list_tiers(memory_dir):
        if tier.pid < 0 and time.time() - tier.created_unix_s < ORPHAN_AGE_S:
            continue
        if tier.pid >= 0 and tier.alive():
            continue
        shutil.rmtree(tier.path, ignore_errors=True)
        log.warning(
            "removed the stale fast tier %s (its spotrun run, pid %d, is gone; never read)", tier.path, tier.pid
        )
        removed.append(tier.path)
    return removed


def release_tier(owner: TierOwner) -> None:
    """Remove the tier at the end of its job (nothing is left in host memory)."""
    shutil.rmtree(owner.path, ignore_errors=True)


def free_bytes(path: str) -> int:
    """Bytes that unprivileged writers may still put on the file system of ``path`` (of its nearest
    existing parent when it is not made yet)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


#: File systems whose files live in memory.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_type(path: str) -> str | None:
    """The type of the file system ``path`` is on (the longest mount point above it in
    ``/proc/self/mounts``); ``None`` when it cannot be told."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind
