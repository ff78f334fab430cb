"""Preflight of the checkpoint storage: can this job write, read, list and delete there?

The supervisor runs it once before it launches the training command, so that a wrong bucket,
bad credentials or a dead endpoint fails within seconds, not at the first checkpoint hours
later; ``spotrun preflight URI`` runs it on its own. It also checks the commit primitive (a
no-overwrite write), failing with :class:`~spotrun.errors.CommitUnsupportedError` where the
store lacks or ignores it. Details: ``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from spotrun.errors import CommitUnsupportedError, ObjectExistsError, StorageError
from spotrun.storage import Storage, StorageLocation

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Default bound of the whole check, in seconds.
PREFLIGHT_TIMEOUT_S = 10.0
#: Prefix of the probe objects, relative to the checkpoint root.
PROBE_PREFIX = ".spotrun-preflight/"


@dataclass(frozen=True)
class PreflightResult:
    """A passed check.

    Attributes:
        uri: the storage root that was checked.
        elapsed_s: seconds the check took.
        commit_primitive: how the store commits without overwriting, in words
            (``"hard link"``, ``"conditional PutObject (If-None-Match: *)"``...).
    """

    uri: str
    elapsed_s: float
    commit_primitive: str = "no-overwrite write"


def check_storage(location: StorageLocation, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> PreflightResult:
    """Open the storage at ``location`` with short request timeouts and :func:`check` it.

    Args:
        location: the checkpoint root (:func:`~spotrun.storage.parse_location`).
        timeout_s: bound of the whole check, in seconds (> 0).

    Raises:
        ConfigError: a bad URI or timeout.
        StorageError: the check failed (subclasses as in :func:`check`).
    """
    return check(location.open(timeout_s=timeout_s), timeout_s=timeout_s)


def check(storage: Storage, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> PreflightResult:
    """Write, read back, list and delete a probe object; then check the commit primitive.

    Args:
        storage: the checkpoint storage.
        timeout_s: bound of the whole check (retries included), in seconds.

    Returns:
        What was checked, how long it took, and how the store commits.

    Raises:
        CommitUnsupportedError: the store cannot write without overwriting (no hard
            links and no no-replace rename; ``501 NotImplemented`` to a conditional put),
            or it ignored the condition (a second no-overwrite write onto the probe key
            succeeded, or replaced the object). The message names the missing feature
            and what to do.
        StorageError: one of the operations failed; the message names the storage,
            the operation and the cause (e.g. "bucket 'x' does not exist", "no AWS
            credentials found", "access denied", "cannot connect to endpoint ...",
            "Not a directory"). The subclass is the cause's: ``ObjectNotFoundError`` for
            a missing bucket, ``StoragePermissionError`` for denied access or missing
            credentials.
    """
    started_s = time.monotonic()
    key = f"{PROBE_PREFIX}probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    commit_key = f"{key}-commit"
    data = f"spotrun preflight probe {key}\n".encode()
    with storage.deadline(timeout_s):
        _attempt(storage, "write a probe object", lambda: storage.put(key, data))
        try:
            _attempt(storage, "read the probe object back", lambda: _read_back(storage, key, data))
            _attempt(storage, "list the probe object", lambda: _find_in_listing(storage, key))
        except StorageError:
            _delete_quietly(storage, key)
            raise
        _attempt(storage, "delete the probe object", lambda: storage.delete(key))
        try:
            _check_commit(storage, commit_key)
        finally:
            _delete_quietly(storage, commit_key)
    result = PreflightResult(
        uri=storage.uri,
        elapsed_s=time.monotonic() - started_s,
        commit_primitive=storage.commit_primitive or "no-overwrite write",
    )
    log.info(
        "storage preflight of %s passed in %.2f s (write, read, list, delete; commits "
        "with a %s, a second commit of the same key refused)",
        result.uri,
        result.elapsed_s,
        result.commit_primitive,
    )
    return result


def _check_commit(storage: Storage, key: str) -> None:
    """Two no-overwrite writes onto ``key``: the first must land, the second be refused."""
    first = f"spotrun preflight commit probe {key}: first writer\n".encode()
    second = f"spotrun preflight commit probe {key}: second writer\n".encode()
    _attempt(storage, "commit a probe object with a no-overwrite write", lambda: storage.put_if_absent(key, first))
    try:
        _attempt(
            storage, "check that a second no-overwrite write is refused", lambda: storage.put_if_absent(key, second)
        )
    except ObjectExistsError:
        pass
    else:
        raise _ignores_condition(
            storage, "a second no-overwrite write onto the same key succeeded and replaced the first"
        )
    stored = _attempt(storage, "read the committed probe back", lambda: storage.get(key))
    if stored != first:
        raise _ignores_condition(
            storage, "a second no-overwrite write onto the same key was refused but replaced the first all the same"
        )


def _ignores_condition(storage: Storage, what_happened: str) -> CommitUnsupportedError:
    return CommitUnsupportedError(
        errno.EOPNOTSUPP,
        f"checkpoint storage {storage.uri} failed the preflight check: {what_happened}: the "
        f"store ignores {storage.commit_requirement}, so two writers could both believe they "
        f"committed the same checkpoint step; {storage.commit_advice}",
    )


def _attempt(storage: Storage, what: str, operation: Callable[[], T]) -> T:
    """Run ``operation``; re-raise a storage error as the same type, naming ``what``."""
    try:
        return operation()
    except StorageError as exc:
        cause = exc.strerror or str(exc)
        raise type(exc)(
            exc.errno or errno.EIO,
            f"checkpoint storage {storage.uri} failed the preflight check: cannot {what}: {cause}",
        ) from exc


def _read_back(storage: Storage, key: str, data: bytes) -> None:
    if storage.get(key) != data:
        raise StorageError(errno.EIO, f"{key} read back with different bytes than were written")


def _find_in_listing(storage: Storage, key: str) -> None:
    if key not in [info.key for info in storage.list(PROBE_PREFIX)]:
        raise StorageError(errno.EIO, f"listing {PROBE_PREFIX} does not show {key}, which was just written")


def _delete_quietly(storage: Storage, key: str) -> None:
    try:
        storage.delete(key)
    except StorageError as exc:  # the first failure is the one to report
        log.warning("could not delete the preflight probe %s: %s", key, exc.strerror or exc)
