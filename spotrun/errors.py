"""Exception types raised by spotrun.

Every error that spotrun raises on purpose derives from :class:`SpotrunError`, so a
training script can catch them all at once. Storage errors also derive from the
matching builtin (``FileNotFoundError``, ``PermissionError``, ``FileExistsError``)
so code that already handles those keeps working.
"""

from __future__ import annotations


class SpotrunError(Exception):
    """Base class of every error spotrun raises on purpose."""


class ConfigError(SpotrunError, ValueError):
    """A bad option, URI or environment variable, found before any work starts."""


# --- storage -----------------------------------------------------------------


class StorageError(SpotrunError, OSError):
    """A storage operation failed (after retries, where the backend retries)."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist."""


class ObjectExistsError(StorageError, FileExistsError):
    """A conditional put found the object already there (another writer committed first)."""


class StepDeletedError(ObjectNotFoundError):
    """A step was deleted (the job's retention, ``spotrun gc``) while a read-only tool read it
    (``spotrun verify --step``, ``spotrun export``): gone, not damaged."""


class ObjectTooShortError(StorageError):
    """A read asked for bytes past the end of the object (it is shorter than expected)."""


class StoragePermissionError(StorageError, PermissionError):
    """The credentials in use may not perform this operation."""


class CommitUnsupportedError(StorageError):
    """The store lacks the no-overwrite write that commits a step, or ignores it.

    Locally: neither a hard link nor ``renameat2(RENAME_NOREPLACE)`` works on the
    filesystem of the root. On S3: the store answers ``501 NotImplemented`` to a
    ``PutObject`` with ``If-None-Match: *``, or (found by the preflight) lets a second
    such write replace the first. The message names the missing feature and what to do.
    Never retried: the next attempt would fail the same way.
    """


# --- checkpoints -------------------------------------------------------------


class CheckpointError(SpotrunError):
    """Base class of checkpoint format and consistency errors."""


class ManifestError(CheckpointError):
    """A manifest is missing, is not valid JSON, or does not follow the format."""


class CorruptShardError(CheckpointError):
    """A shard's size or checksum differs from what its manifest recorded."""


class CorruptStateError(CorruptShardError):
    """A step's files agree with its manifest, but a state they hold is one that spotrun's own
    objects refuse for its content (an RNG state the generator rejects): the step is damaged
    and fails verification like a bad checksum (never a :class:`StateMismatchError`: no user
    setting is part of such a state)."""


class UnsafeObjectError(CorruptShardError, StorageError):
    """A local checkpoint root holds, where an object should be, something spotrun refuses to
    open: a symbolic link (on the way to it or in its place; it could lead outside the root) or
    not a regular file (a FIFO would block a read forever). The step is corrupt, as with a bad
    checksum (:mod:`spotrun.storage.local_beneath`)."""


class StateSerializationError(CheckpointError, TypeError):
    """A state value is neither a tensor nor JSON-serialisable; the message names its key."""


class StateMismatchError(CheckpointError):
    """Saved state does not fit the objects it is loaded into (missing keys, world size...)."""


class CheckpointSaveError(CheckpointError):
    """A save failed on at least one rank; no manifest was written, so nothing was committed.

    Attributes:
        retryable: ``False`` when a later save would fail the same way (the store cannot
            commit; a newer incarnation owns the root): periodic saves stop at once.
    """

    retryable = True

    def __init__(self, *args: object, retryable: bool | None = None) -> None:
        super().__init__(*args)
        if retryable is not None:
            self.retryable = retryable


class NoCheckpointError(CheckpointError):
    """No complete checkpoint exists where one was required."""


class FencedError(CheckpointSaveError):
    """A newer incarnation of the job started on the same checkpoint root: this (older)
    incarnation may no longer commit. Nothing was committed; the process should stop."""

    retryable = False


class SaveAbortedError(CheckpointSaveError):
    """A background save was abandoned on purpose (an emergency save of a newer step
    replaced it); nothing of it was committed."""


class CollectiveTimeoutError(SpotrunError):
    """Not every rank arrived at one of spotrun's collectives within its bound (a rank stopped,
    hung or died): the ranks that did not are named, found by a roll call on the job's store.
    spotrun's process group is unusable afterwards; the job must restart (under ``spotrun run``
    the supervisor stops and restarts it). Never a failed save that training survives.

    Attributes:
        ranks: the ranks that did not arrive; empty when the roll call could not tell.
        what: the collective, e.g. ``"the write gather of step 40's save"``.
        timeout_s: its bound in seconds.
    """

    def __init__(self, message: str, *, ranks: list[int], what: str, timeout_s: float) -> None:
        super().__init__(message)
        self.ranks = list(ranks)
        self.what = what
        self.timeout_s = timeout_s


class ExportError(SpotrunError):
    """A checkpoint cannot be exported as asked (``spotrun export``): no such state, a dtype
    the target format cannot hold, an output that already holds exported files. Found
    before anything is written."""
