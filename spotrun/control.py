"""The control channel between the supervisor and the workers of one node.

torchrun treats SIGTERM, SIGINT, SIGHUP and SIGQUIT as fatal (it forwards them and
SIGKILLs the workers after ``--shutdown-timeout``), so the supervisor never signals the
launcher to ask for a save. Instead it writes a small JSON file into a node-local
directory (``$SPOTRUN_CONTROL_DIR``) that every worker checks at each step boundary -
one ``stat`` call, no signal, nothing torchrun notices.

Files (all written atomically by rename):
    ``save-request.json``      supervisor -> workers: {"reason", "requested_unix_s", "deadline_unix_s"}
    ``emergency-commit.json``  workers -> supervisor: {"step", "committed_unix_s"}, written by
                               local rank 0 of each node after the emergency step committed.
    ``checkpoint-request.json`` supervisor -> workers: {"seq", "reason", "requested_unix_s"}:
                               take an ordinary checkpoint soon and keep training (e.g. an AWS
                               rebalance recommendation); each new ``seq`` asks once.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from spotrun.errors import ConfigError

SAVE_REQUEST_FILE = "save-request.json"
EMERGENCY_COMMIT_FILE = "emergency-commit.json"
CHECKPOINT_REQUEST_FILE = "checkpoint-request.json"


@dataclass(frozen=True)
class SaveRequest:
    """A request for an emergency checkpoint.

    Attributes:
        reason: what triggered it (``"SIGTERM"``, ``"aws spot instance-action"``, ...).
        requested_unix_s: when the supervisor wrote it (seconds since the epoch).
        deadline_unix_s: when the checkpoint must be committed; ``None`` = no known deadline.
    """

    reason: str
    requested_unix_s: float
    deadline_unix_s: float | None


@dataclass(frozen=True)
class CommitReport:
    """Workers' report that an emergency checkpoint committed.

    Attributes:
        step: the committed step.
        committed_unix_s: when rank 0's manifest write returned.
    """

    step: int
    committed_unix_s: float


def _write_json_atomically(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"control file {path} is unreadable: {exc}") from exc
    return doc if isinstance(doc, dict) else None


def write_save_request(control_dir: str, request: SaveRequest) -> None:
    """Supervisor side: ask this node's workers for an emergency checkpoint."""
    _write_json_atomically(os.path.join(control_dir, SAVE_REQUEST_FILE), asdict(request))


def save_requested(control_dir: str) -> bool:
    """Worker side, called every step: is there a pending request? (one ``stat``)."""
    return os.path.exists(os.path.join(control_dir, SAVE_REQUEST_FILE))


def read_save_request(control_dir: str) -> SaveRequest | None:
    """The pending request, or ``None``."""
    doc = _read_json(os.path.join(control_dir, SAVE_REQUEST_FILE))
    if doc is None:
        return None
    return SaveRequest(
        reason=str(doc.get("reason", "")),
        requested_unix_s=float(doc.get("requested_unix_s", 0.0)),
        deadline_unix_s=None if doc.get("deadline_unix_s") is None else float(doc["deadline_unix_s"]),
    )


def write_commit_report(control_dir: str, step: int) -> None:
    """Worker side: report that the emergency checkpoint of ``step`` committed."""
    _write_json_atomically(
        os.path.join(control_dir, EMERGENCY_COMMIT_FILE),
        asdict(CommitReport(step=step, committed_unix_s=time.time())),
    )


def read_commit_report(control_dir: str) -> CommitReport | None:
    """Supervisor side: the workers' commit report, or ``None`` if none was written."""
    doc = _read_json(os.path.join(control_dir, EMERGENCY_COMMIT_FILE))
    if doc is None or type(doc.get("step")) is not int:
        return None
    return CommitReport(step=doc["step"], committed_unix_s=float(doc.get("committed_unix_s", 0.0)))


def write_checkpoint_request(control_dir: str, reason: str) -> int:
    """Supervisor side: ask for an ordinary checkpoint (training goes on); returns its ``seq``."""
    path = os.path.join(control_dir, CHECKPOINT_REQUEST_FILE)
    previous = _read_json(path) or {}
    seq = int(previous.get("seq", 0)) + 1 if isinstance(previous.get("seq"), int) else 1
    _write_json_atomically(path, {"seq": seq, "reason": reason, "requested_unix_s": time.time()})
    return seq


class CheckpointRequestWatcher:
    """Worker side: notices each new ordinary-checkpoint request once.

    ``pending()`` costs one ``stat`` per call; the file is read only when it changed.
    """

    def __init__(self, control_dir: str) -> None:
        self._path = os.path.join(control_dir, CHECKPOINT_REQUEST_FILE)
        self._seen_stat: tuple[int, int] | None = None
        self._handled_seq = 0
        self._pending_seq = 0

    def pending(self) -> bool:
        """Whether a request newer than the last :meth:`handled` one exists."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return self._pending_seq > self._handled_seq
        if (st.st_mtime_ns, st.st_size) != self._seen_stat:
            self._seen_stat = (st.st_mtime_ns, st.st_size)
            try:
                doc = _read_json(self._path) or {}
            except ConfigError:
                doc = {}
            if type(doc.get("seq")) is int:
                self._pending_seq = max(self._pending_seq, doc["seq"])
        return self._pending_seq > self._handled_seq

    def handled(self) -> None:
        """Mark every request seen so far as served."""
        self._handled_seq = self._pending_seq
