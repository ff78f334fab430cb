"""The control channel between the supervisor and the workers of one node.

torchrun treats SIGTERM, SIGINT, SIGHUP and SIGQUIT as fatal, so the supervisor never signals
the launcher to ask for a save. Instead it writes small JSON files, atomically, into a
node-local directory (``$SPOTRUN_CONTROL_DIR``) that every worker checks at each step boundary
(one ``stat``), and the workers answer there. The files and their fields:
``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from spotrun.errors import ConfigError

SAVE_REQUEST_FILE = "save-request.json"
EMERGENCY_COMMIT_FILE = "emergency-commit.json"
CHECKPOINT_REQUEST_FILE = "checkpoint-request.json"
SAVES_FILE = "saves.json"
STOP_REPORT_FILE = "stopped-without-save.json"
FENCE_REPORT_FILE = "fenced.json"
#: How many committed saves ``saves.json`` remembers.
RECENT_SAVES = 5


@dataclass(frozen=True)
class SaveRequest:
    """A request for an emergency checkpoint.

    Attributes:
        reason: what triggered it (``"SIGTERM"``, ``"aws spot instance-action"``, ...).
        requested_unix_s: when the supervisor wrote it (seconds since the epoch).
        deadline_unix_s: when the checkpoint must be committed; ``None`` = no known deadline.
        save: True: save the step at the next boundary, then stop. False: stop there
            without saving (no time for a save; the newest complete checkpoint stays the
            resume point).
        tier: where the emergency checkpoint goes: ``"storage"``, or ``"memory"`` (the fast
            tier, copied to another node, when a save to storage cannot commit in time).
    """

    reason: str
    requested_unix_s: float
    deadline_unix_s: float | None
    save: bool = True
    tier: str = "storage"


@dataclass(frozen=True)
class CommitReport:
    """Workers' report that an emergency checkpoint committed.

    Attributes:
        step: the committed step.
        committed_unix_s: when rank 0's manifest write returned.
        tier: where it committed: ``"storage"`` or ``"memory"`` (the fast tier).
    """

    step: int
    committed_unix_s: float
    tier: str = "storage"


def write_json_atomically(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` by rename: a reader sees the old file or the new one, whole (the
    temporary name is the writer's own: ranks and their threads may write one report at once)."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> dict | None:
    """The JSON object at ``path``; ``None`` when the file is missing or holds no object.

    Raises:
        ConfigError: the file cannot be read or parsed.
    """
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
    write_json_atomically(os.path.join(control_dir, SAVE_REQUEST_FILE), asdict(request))


def save_requested(control_dir: str) -> bool:
    """Worker side, called every step: is there a pending request? (one ``stat``)."""
    return os.path.exists(os.path.join(control_dir, SAVE_REQUEST_FILE))


def read_save_request(control_dir: str) -> SaveRequest | None:
    """The pending request, or ``None``."""
    doc = read_json(os.path.join(control_dir, SAVE_REQUEST_FILE))
    if doc is None:
        return None
    return SaveRequest(
        reason=str(doc.get("reason", "")),
        requested_unix_s=float(doc.get("requested_unix_s", 0.0)),
        deadline_unix_s=None if doc.get("deadline_unix_s") is None else float(doc["deadline_unix_s"]),
        save=doc.get("save", True) is not False,
        tier="memory" if doc.get("tier") == "memory" else "storage",
    )


def write_commit_report(control_dir: str, step: int, tier: str = "storage") -> None:
    """Worker side: report that the emergency checkpoint of ``step`` committed (to ``tier``)."""
    write_json_atomically(
        os.path.join(control_dir, EMERGENCY_COMMIT_FILE),
        asdict(CommitReport(step=step, committed_unix_s=time.time(), tier=tier)),
    )


def read_commit_report(control_dir: str) -> CommitReport | None:
    """Supervisor side: the workers' commit report, or ``None`` if none was written."""
    doc = read_json(os.path.join(control_dir, EMERGENCY_COMMIT_FILE))
    if doc is None or type(doc.get("step")) is not int:
        return None
    return CommitReport(
        step=doc["step"],
        committed_unix_s=float(doc.get("committed_unix_s", 0.0)),
        tier="memory" if doc.get("tier") == "memory" else "storage",
    )


def write_stop_report(control_dir: str, step: int) -> None:
    """Worker side: report that the workers stopped after ``step`` without saving."""
    write_json_atomically(os.path.join(control_dir, STOP_REPORT_FILE), {"step": step, "stopped_unix_s": time.time()})


def read_stop_report(control_dir: str) -> int | None:
    """Supervisor side: the step after which the workers stopped without saving, or ``None``.

    Raises:
        ConfigError: the file exists but is not JSON.
    """
    doc = read_json(os.path.join(control_dir, STOP_REPORT_FILE))
    if doc is None or type(doc.get("step")) is not int:
        return None
    return doc["step"]


@dataclass(frozen=True)
class FenceReport:
    """Workers' report that a newer start of the job fenced them (they may no longer commit).

    Attributes:
        incarnation: the incarnation these workers claimed (``None``: none yet).
        newer_incarnation: the newest incarnation on the root when they were fenced (``None``:
            the root could not be listed then).
        newer_host, newer_pid, newer_supervisor_pid: where that one runs, as its record says.
        message: the ``FencedError``'s text.
        fenced_unix_s: when it was raised (seconds since the epoch).
    """

    incarnation: int | None
    newer_incarnation: int | None
    newer_host: str | None
    newer_pid: int | None
    newer_supervisor_pid: int | None
    message: str
    fenced_unix_s: float


def write_fence_report(control_dir: str, report: FenceReport) -> None:
    """Worker side: report that this launch's workers were fenced."""
    write_json_atomically(os.path.join(control_dir, FENCE_REPORT_FILE), asdict(report))


def read_fence_report(control_dir: str) -> FenceReport | None:
    """The workers' fence report, or ``None`` if none was written.

    Raises:
        ConfigError: the file exists but is not JSON (a JSON object of other fields reads as a
            report with those fields unknown: being fenced is what counts).
    """
    doc = read_json(os.path.join(control_dir, FENCE_REPORT_FILE))
    if doc is None:
        return None

    def known(name: str, kind: type):
        value = doc.get(name)
        return value if type(value) is kind else None

    return FenceReport(
        incarnation=known("incarnation", int),
        newer_incarnation=known("newer_incarnation", int),
        newer_host=known("newer_host", str),
        newer_pid=known("newer_pid", int),
        newer_supervisor_pid=known("newer_supervisor_pid", int),
        message=str(doc.get("message", "")),
        fenced_unix_s=float(doc["fenced_unix_s"]) if type(doc.get("fenced_unix_s")) in (int, float) else 0.0,
    )


def write_checkpoint_request(control_dir: str, reason: str) -> int:
    """Supervisor side: ask for an ordinary checkpoint (training goes on); returns its ``seq``."""
    path = os.path.join(control_dir, CHECKPOINT_REQUEST_FILE)
    previous = read_json(path) or {}
    seq = int(previous.get("seq", 0)) + 1 if isinstance(previous.get("seq"), int) else 1
    write_json_atomically(path, {"seq": seq, "reason": reason, "requested_unix_s": time.time()})
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
                doc = read_json(self._path) or {}
            except ConfigError:
                doc = {}
            if type(doc.get("seq")) is int:
                self._pending_seq = max(self._pending_seq, doc["seq"])
        return self._pending_seq > self._handled_seq

    def handled(self) -> None:
        """Mark every request seen so far as served."""
        self._handled_seq = self._pending_seq


# --- save measurements (workers -> supervisor) ---------------------------------------


@dataclass(frozen=True)
class SaveRecord:
    """One committed save, as measured by local rank 0 of a node.

    Attributes:
        step: the saved step.
        reason: ``periodic``, ``requested``, ``emergency``, ``final``, ...
        size_bytes: bytes of all shard files of the step (every rank's; manifest excluded).
        duration_s: seconds from the start of the save to its commit on this node (staging,
            every collective, the slowest rank's write and the manifest write): a full save,
            also for a background one.
        committed_unix_s: when the commit returned (seconds since the epoch).
        stall_s: seconds training was blocked by the save: ``duration_s`` for a synchronous
            save; for a background one, the staging copy plus any wait for the save before it.
        background: whether the write and commit ran in the background.
    """

    step: int
    reason: str
    size_bytes: int
    duration_s: float
    committed_unix_s: float
    stall_s: float | None = None
    background: bool = False


@dataclass(frozen=True)
class SaveInProgress:
    """A save that started and has not committed (or failed) yet.

    Attributes:
        step: the step being saved.
        reason: why (``periodic``, ...).
        started_unix_s: when it started (seconds since the epoch).
        background: the save runs in the background while training goes on (the workers
            reach their next step boundary without waiting for it).
        bytes_total: bytes this node's publishing rank writes (0 until known).
        bytes_done: of those, bytes written so far.
        remaining_s: seconds the rest of that rank's write should take at the rate seen so
            far, as of ``progress_unix_s``; ``None`` before any byte was written.
        progress_unix_s: when the progress figures were taken (seconds since the epoch);
            ``None`` when none were published.
    """

    step: int
    reason: str
    started_unix_s: float
    background: bool = False
    bytes_total: int = 0
    bytes_done: int = 0
    remaining_s: float | None = None
    progress_unix_s: float | None = None


@dataclass(frozen=True)
class RestoreRecord:
    """The restore of this launch, as measured by local rank 0 of a node.

    Attributes:
        step: the restored step.
        duration_s: seconds :meth:`spotrun.Checkpointer.restore` took (listing, reading,
            verifying, applying, fallbacks to older steps included).
        bytes_read: bytes this rank read from storage (0 for steps written before format 4).
        restored_unix_s: when the restore ended (seconds since the epoch).
    """

    step: int
    duration_s: float
    bytes_read: int
    restored_unix_s: float


@dataclass(frozen=True)
class SaveStats:
    """Contents of ``saves.json``.

    Attributes:
        in_progress: the save running now, if any.
        recent: the last committed saves of this launch, oldest first (at most
            :data:`RECENT_SAVES`).
        step_time_s: seconds one training step takes (the slowest of the recent steps,
            saves excluded); ``None`` before two steps ran.
        check_interval_steps: steps between two looks at the save request.
        restore: this launch's restore of a step; ``None`` before it ended or on a fresh start.
    """

    in_progress: SaveInProgress | None
    recent: tuple[SaveRecord, ...]
    step_time_s: float | None
    check_interval_steps: int = 1
    restore: RestoreRecord | None = None


def full_save_estimate(recent: Sequence[SaveRecord]) -> tuple[int, float, float] | None:
    """``(size_bytes, throughput_bytes_per_s, save_s)`` of the next full save: the last save's
    bytes at the *slowest* throughput (bytes per second, start of a save to its commit) of
    ``recent``; ``None`` when nothing was measured. Stalls are never used: a save's duration
    is the whole save, also for a background one."""
    if not recent:
        return None
    size_bytes = recent[-1].size_bytes
    throughput = min(max(r.size_bytes, 1) / max(r.duration_s, 1e-6) for r in recent)
    return size_bytes, throughput, max(size_bytes, 1) / throughput


def write_save_stats(control_dir: str, stats: SaveStats) -> None:
    """Worker side (local rank 0): publish the save measurements of this node."""
    doc = {
        "in_progress": None if stats.in_progress is None else asdict(stats.in_progress),
        "recent": [asdict(r) for r in stats.recent],
        "step_time_s": stats.step_time_s,
        "check_interval_steps": stats.check_interval_steps,
        "restore": None if stats.restore is None else asdict(stats.restore),
    }
    write_json_atomically(os.path.join(control_dir, SAVES_FILE), doc)


def read_save_stats(control_dir: str) -> SaveStats | None:
    """Supervisor side: this node's save measurements; ``None`` when there are none yet.

    Raises:
        ConfigError: the file exists but is not JSON or has fields of the wrong type.
    """
    path = os.path.join(control_dir, SAVES_FILE)
    doc = read_json(path)
    if doc is None:
        return None
    try:
        raw = doc.get("in_progress")
        in_progress = (
            None
            if raw is None
            else SaveInProgress(
                step=_number(raw["step"], int),
                reason=str(raw["reason"]),
                started_unix_s=_number(raw["started_unix_s"], float),
                background=raw.get("background", False) is True,
                bytes_total=_number(raw.get("bytes_total", 0), int),
                bytes_done=_number(raw.get("bytes_done", 0), int),
                remaining_s=_optional(raw.get("remaining_s")),
                progress_unix_s=_optional(raw.get("progress_unix_s")),
            )
        )
        recent = tuple(
            SaveRecord(
                step=_number(r["step"], int),
                reason=str(r["reason"]),
                size_bytes=_number(r["size_bytes"], int),
                duration_s=_number(r["duration_s"], float),
                committed_unix_s=_number(r["committed_unix_s"], float),
                stall_s=_optional(r.get("stall_s")),
                background=r.get("background", False) is True,
            )
            for r in doc.get("recent", [])
        )
        step_time_s = doc.get("step_time_s")
        raw = doc.get("restore")
        restore = (
            None
            if raw is None
            else RestoreRecord(
                step=_number(raw["step"], int),
                duration_s=_number(raw["duration_s"], float),
                bytes_read=_number(raw["bytes_read"], int),
                restored_unix_s=_number(raw["restored_unix_s"], float),
            )
        )
        return SaveStats(
            in_progress=in_progress,
            recent=recent,
            step_time_s=None if step_time_s is None else _number(step_time_s, float),
            check_interval_steps=_number(doc.get("check_interval_steps", 1), int),
            restore=restore,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"control file {path} is malformed: {exc!r}") from exc


def _optional(value: object) -> float | None:
    """``None``, or a finite float >= 0 (ValueError otherwise)."""
    return None if value is None else _number(value, float)


def _number(value: object, kind: type) -> int | float:
    """A non-negative int (``kind=int``) or finite float; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    if kind is int and type(value) is not int:
        raise ValueError(f"expected an integer, got {value!r}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"expected a finite number >= 0, got {value!r}")
    return kind(value)
