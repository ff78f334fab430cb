"""Incarnation records: a newer start of the job fences every older writer.

Every start claims the next incarnation number with ``put_if_absent``
(``incarnations/incarnation-<N>.json``, naming the step it resumed from). A manifest committed
by incarnation ``k`` for step ``S`` is valid only if ``S`` is at most the resumed step of every
newer incarnation: a zombie's later commits are ``fenced``, never resumed from, and writers check
before committing (:class:`~spotrun.errors.FencedError`). The rule and the records:
``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from spotrun.checkpoint import strict_json
from spotrun.checkpoint.layout import INCARNATIONS_DIR, incarnation_key, parse_incarnation_key
from spotrun.errors import FencedError, ObjectExistsError, ObjectNotFoundError, StorageError, UnsafeObjectError
from spotrun.storage.base import ObjectInfo, Storage

log = logging.getLogger(__name__)

RECORD_FORMAT = "spotrun-incarnation"
_MAX_CLAIM_ATTEMPTS = 50


@dataclass(frozen=True)
class Fences:
    """Which incarnations exist and the step each resumed from.

    Attributes:
        resumed: incarnation -> the step it resumed from (``None``: a fresh start).
    """

    resumed: dict[int, int | None] = field(default_factory=dict)

    @property
    def newest(self) -> int | None:
        """The highest incarnation number claimed, or ``None`` when there is none."""
        return max(self.resumed) if self.resumed else None

    def fenced_by(self, incarnation: int | None, step: int) -> int | None:
        """The first newer incarnation that fences a manifest of ``incarnation`` for
        ``step``, or ``None`` when that manifest is valid.

        ``incarnation`` ``None`` (a version-1 manifest without one) counts as -1.
        """
        writer = -1 if incarnation is None else incarnation
        for newer in sorted(j for j in self.resumed if j > writer):
            resumed = self.resumed[newer]
            if resumed is None or step > resumed:
                return newer
        return None


def _record_infos(objects: list[ObjectInfo]) -> dict[int, str]:
    found = {}
    for info in objects:
        number = parse_incarnation_key(info.key)
        if number is not None:
            found[number] = info.key
    return found


def _parse(data: bytes, where: str) -> dict:
    doc = strict_json.loads(data, max_bytes=strict_json.RECORD_MAX_BYTES, what="incarnation record")
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
        raise ValueError(f"{where} is not a spotrun incarnation record")
    resumed = doc["resumed"]
    if not isinstance(resumed, dict):
        raise ValueError(f"{where}: 'resumed' must be an object")
    return {int(k): (None if v is None else int(v)) for k, v in resumed.items()}


def read_fences(storage: Storage, objects: list[ObjectInfo] | None = None) -> Fences:
    """The incarnation table of a root.

    Args:
        storage: the checkpoint root.
        objects: a listing of the root (or of ``incarnations/``) already made; listed here
            when ``None``.

    A record that cannot be read or parsed is skipped with a warning (the others still
    fence); a broken newest record makes every record be read one by one.

    Raises:
        StorageError: listing or reading failed.
    """
    if objects is None:
        objects = storage.list(f"{INCARNATIONS_DIR}/")
    keys = _record_infos(objects)
    resumed: dict[int, int | None] = {}
    for number in sorted(keys, reverse=True):
        if number in resumed:
            continue
        try:
            table = _parse(storage.get(keys[number]), f"{storage.uri}/{keys[number]}")
        except ObjectNotFoundError:
            continue
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, UnsafeObjectError) as exc:
            log.warning("incarnation record %s/%s is unreadable (%s); skipped", storage.uri, keys[number], exc)
            continue
        for k, v in table.items():
            resumed.setdefault(k, v)
        if all(k in resumed for k in keys):
            break
    return Fences(resumed)


@dataclass(frozen=True)
class IncarnationRecord:
    """The record one start of the job writes.

    Attributes:
        incarnation: the number claimed.
        resumed_step: the step this start resumed from; ``None`` for a fresh start.
        run_id: the job's identifier.
        started_unix_s: when the claim was made (seconds since the epoch, UTC).
        resumed: the whole table (every earlier incarnation's resumed step, and this one's).
        supervisor_pid: the process id of the ``spotrun run`` of the claiming node, if any.
    """

    incarnation: int
    resumed_step: int | None
    run_id: str
    started_unix_s: float
    resumed: dict[int, int | None]
    supervisor_pid: int | None = None

    def to_json(self) -> bytes:
        doc = {
            "format": RECORD_FORMAT,
            "format_version": 1,
            "incarnation": self.incarnation,
            "resumed_step": self.resumed_step,
            "run_id": self.run_id,
            "started_unix_s": self.started_unix_s,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "supervisor_pid": self.supervisor_pid,
            "resumed": {str(k): v for k, v in sorted(self.resumed.items())},
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8")


def claim(
    storage: Storage, *, resumed_step: int | None, run_id: str, at_least: int = 0, supervisor_pid: int | None = None
) -> IncarnationRecord:
    """Claim the next incarnation number on ``storage`` (never one claimed before).

    Args:
        resumed_step: the step this start resumed from; ``None`` for a fresh start.
        run_id: the job's identifier, recorded.
        at_least: the smallest acceptable number (the supervisor's ``$SPOTRUN_INCARNATION``,
            or one more than the incarnation of the manifest resumed from).
        supervisor_pid: recorded (``$SPOTRUN_SUPERVISOR_PID`` under ``spotrun run``).

    Raises:
        StorageError: the store failed, or kept losing the race for a number.
    """
    for _ in range(_MAX_CLAIM_ATTEMPTS):
        fences = read_fences(storage)
        newest = fences.newest
        number = max(at_least, 0 if newest is None else newest + 1)
        table = {**fences.resumed, number: resumed_step}
        record = IncarnationRecord(number, resumed_step, run_id, time.time(), table, supervisor_pid)
        try:
            storage.put_if_absent(incarnation_key(number), record.to_json())
        except ObjectExistsError:
            continue  # another start claimed this number first: look again
        log.info(
            "incarnation %d claimed on %s (resumed from %s)",
            number,
            storage.uri,
            "nothing: fresh start" if resumed_step is None else f"step {resumed_step}",
        )
        return record
    raise StorageError(
        5, f"could not claim an incarnation under {storage.uri}: {_MAX_CLAIM_ATTEMPTS} other starts claimed first"
    )


def check_not_fenced(storage: Storage, incarnation: int, fences: Fences | None = None) -> None:
    """Raise :class:`FencedError` when a newer incarnation than ``incarnation`` has started.

    Args:
        fences: the table if already read; else the records are listed (no reads).

    Raises:
        FencedError: a newer incarnation exists; this one must not commit.
        StorageError: listing failed.
    """
    numbers = fences.resumed if fences is not None else _record_infos(storage.list(f"{INCARNATIONS_DIR}/"))
    newer = sorted(n for n in numbers if n > incarnation)
    if newer:
        raise FencedError(
            f"incarnation {newer[-1]} of this job started on {storage.uri} after this incarnation "
            f"({incarnation}); an older incarnation may no longer write or commit (is an orphaned "
            "copy of the job still running?) - nothing was committed"
        )


@dataclass(frozen=True)
class Claim:
    """Who claimed an incarnation, as its record says (``None``: not recorded, or unreadable).

    Attributes:
        incarnation: the number.
        host: the claiming host.
        pid: the claiming process (rank 0 of that start).
        supervisor_pid: that node's ``spotrun run``; ``None`` without one (or an older record).
        run_id: the job's identifier the workers recorded.
    """

    incarnation: int
    host: str | None = None
    pid: int | None = None
    supervisor_pid: int | None = None
    run_id: str | None = None

    def describe(self) -> str:
        """``incarnation 3 (host h, pid 12, spotrun run pid 10)``, with what is known."""
        where = [f"host {self.host}"] if self.host else []
        where += [f"pid {self.pid}"] if self.pid is not None else []
        where += [f"spotrun run pid {self.supervisor_pid}"] if self.supervisor_pid is not None else []
        return f"incarnation {self.incarnation}" + (f" ({', '.join(where)})" if where else "")


def newest_claim(storage: Storage) -> Claim | None:
    """The newest incarnation claimed on the root and where it runs; ``None`` when none is.

    A record that cannot be read gives a :class:`Claim` with the number only.

    Raises:
        StorageError: listing failed.
    """
    keys = _record_infos(storage.list(f"{INCARNATIONS_DIR}/"))
    if not keys:
        return None
    number = max(keys)
    try:
        doc = strict_json.loads(
            storage.get(keys[number]), max_bytes=strict_json.RECORD_MAX_BYTES, what="incarnation record"
        )
    except (StorageError, ValueError, UnicodeDecodeError) as exc:
        log.warning("incarnation record %s/%s is unreadable (%s)", storage.uri, keys[number], exc)
        return Claim(number)
    doc = doc if isinstance(doc, dict) else {}

    def known(name: str, kind: type):
        value = doc.get(name)
        return value if type(value) is kind else None

    return Claim(number, known("hostname", str), known("pid", int), known("supervisor_pid", int), known("run_id", str))
