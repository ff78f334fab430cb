"""How a save's failure on one rank becomes the same error on every rank: each phase's gathered
reports carry a failed rank's error (:mod:`spotrun.checkpoint.save`), and every rank raises it alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spotrun.errors import CheckpointSaveError, FencedError, SaveAbortedError


def raise_if_failed(
    reports: list[dict[str, Any]], message: Callable[[dict[int, str]], str], cause: BaseException | None = None
) -> None:
    """Raise on every rank alike the error that a phase's gathered ``reports`` carry (a failed
    rank's report has an ``error``); ``message`` builds the text from {failed rank: error}.

    The error is a :class:`FencedError` when a failed rank was fenced, a
    :class:`SaveAbortedError` when every failed rank was abandoned, else a
    :class:`CheckpointSaveError`; ``retryable`` comes from the reports where they say it.
    """
    failed = {r: rep for r, rep in enumerate(reports) if "error" in rep}
    if not failed:
        return
    if any(rep.get("fenced") for rep in failed.values()):
        error: type[CheckpointSaveError] = FencedError
    elif all(rep.get("aborted") for rep in failed.values()):
        error = SaveAbortedError
    else:
        error = CheckpointSaveError
    said = [rep["retryable"] for rep in failed.values() if "retryable" in rep]
    raise error(
        message({r: rep["error"] for r, rep in failed.items()}), retryable=all(said) if said else None
    ) from cause


def describe(exc: Exception) -> str:
    """``"StorageError: put s3://...: S3 error SlowDown (HTTP 503)"`` (no ``[Errno N]``)."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{type(exc).__name__}: {text}"
