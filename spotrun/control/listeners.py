"""Who listens for notices: worker processes announce that they speak spotrun's protocol.

A worker process that reads the save request of :mod:`spotrun.control.files` itself (a
:class:`~spotrun.Checkpointer`, or a script that polls :func:`spotrun.preemption_notice`) writes
one small file into this launch's control directory::

    $SPOTRUN_CONTROL_DIR/listeners/<kind>-pid-<pid>.json
        {"kind": "checkpointer" | "poll", "pid": 1234, "rank": 0 | null,
         "local_rank": 0 | null, "announced_unix_s": 1700000000.0}

written atomically (a temporary file, then a rename), so a reader sees a whole file or none.
The supervisor reads them (:func:`read_listeners`) to decide how a notice reaches the
workers: through the save request alone when they listen, or also as a signal to the worker
processes when none announced itself (a job that checkpoints with its own framework).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from spotrun.control.env import CONTROL_DIR

log = logging.getLogger(__name__)

LISTENERS_DIR = "listeners"
#: The kinds of listener: a :class:`~spotrun.Checkpointer` (saves and commits on a notice), or
#: a script that polls :func:`spotrun.preemption_notice` (saves by its own means).
KINDS = ("checkpointer", "poll")

# One announcement per (process, control directory, kind): a process-wide fact, like the
# supervisor watch (spotrun/train/supervisor_watch.py). Keyed by pid, so a forked child announces anew.
_lock = threading.Lock()
_announced: dict[tuple[int, str, str], str] = {}


@dataclass(frozen=True)
class Listener:
    """One worker process's announcement.

    Attributes:
        kind: ``"checkpointer"`` or ``"poll"`` (:data:`KINDS`).
        pid: the announcing process's id (in the worker's PID namespace).
        rank: its global rank (``$RANK``), ``None`` when not set (a plain, non-torchrun process).
        local_rank: its rank on this node (``$LOCAL_RANK``), or ``None``.
        announced_unix_s: when it announced itself (seconds since the epoch).
    """

    kind: str
    pid: int
    rank: int | None
    local_rank: int | None
    announced_unix_s: float


def announce(kind: str, env: Mapping[str, str] = os.environ) -> str | None:
    """Worker side: say in the control directory that this process listens for notices.

    Idempotent per process and kind: the file is written at the first call only. Never
    raises for an unwritable control directory (a listener that could not announce itself
    still works; the supervisor then also signals it): logged as a warning, retried at the
    next call.

    Args:
        kind: ``"checkpointer"`` or ``"poll"``.
        env: where ``SPOTRUN_CONTROL_DIR``, ``RANK`` and ``LOCAL_RANK`` are read.

    Returns:
        The path of the announcement file, or ``None`` when not under ``spotrun run`` (no
        ``$SPOTRUN_CONTROL_DIR``) or when it could not be written.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown listener kind {kind!r}; expected one of {', '.join(KINDS)}")
    control_dir = env.get(CONTROL_DIR)
    if not control_dir:
        return None
    key = (os.getpid(), control_dir, kind)
    with _lock:
        path = _announced.get(key)
        if path is None:
            try:
                path = _write(control_dir, kind, env)
            except OSError as exc:
                log.warning(
                    "could not announce this process (pid %d) as a %s listener in %s: %s",
                    key[0],
                    kind,
                    control_dir,
                    exc,
                )
                return None
            _announced[key] = path
        return path


def read_listeners(control_dir: str) -> list[Listener]:
    """Supervisor side: every announcement in ``control_dir``, oldest first.

    A file that is not a whole, well-formed announcement (a stray or foreign file, a
    temporary file of a write in progress) is skipped and logged at debug level.

    Returns:
        The listeners, sorted by ``(announced_unix_s, pid)``; empty when none announced
        (or the directory does not exist).
    """
    folder = os.path.join(control_dir, LISTENERS_DIR)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        if not name.endswith(".json"):
            continue
        listener = _read(os.path.join(folder, name))
        if listener is not None:
            found.append(listener)
    return sorted(found, key=lambda x: (x.announced_unix_s, x.pid))


def _write(control_dir: str, kind: str, env: Mapping[str, str]) -> str:
    folder = os.path.join(control_dir, LISTENERS_DIR)
    os.makedirs(folder, exist_ok=True)
    pid = os.getpid()
    path = os.path.join(folder, f"{kind}-pid-{pid}.json")
    doc = {
        "kind": kind,
        "pid": pid,
        "rank": _rank(env, "RANK"),
        "local_rank": _rank(env, "LOCAL_RANK"),
        "announced_unix_s": time.time(),
    }
    # No fsync: the directory is node-local and lives only as long as this launch; a reader
    # needs a whole file (the rename), not one that survives a power cut.
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
    return path


def _rank(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def _read(path: str) -> Listener | None:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        kind, pid = doc["kind"], doc["pid"]
        rank, local_rank = doc.get("rank"), doc.get("local_rank")
        announced_unix_s = doc["announced_unix_s"]
        if (
            kind not in KINDS
            or not _is_int(pid)
            or pid <= 0
            or not all(r is None or _is_int(r) for r in (rank, local_rank))
            or isinstance(announced_unix_s, bool)
            or not isinstance(announced_unix_s, (int, float))
        ):
            raise ValueError(f"unexpected fields {doc!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("ignoring listener file %s: %s", path, exc)
        return None
    return Listener(kind=kind, pid=pid, rank=rank, local_rank=local_rank, announced_unix_s=float(announced_unix_s))


def _is_int(value: object) -> bool:
    return type(value) is int
