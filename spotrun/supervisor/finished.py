"""The record of a finished job: the same command started again on a finished root exits 0 at
once, without starting torchrun (which would import torch, rendezvous and restore only to find
nothing left to train).

``finished/<digest>.json`` (a digest of the command line and of the files it names) records the
newest complete step when the command exited 0; ``--rerun-finished`` launches anyway. When a
start skips its launch: ``docs/design/internals.md`` (Supervisor and control channel).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import socket
import time
from collections.abc import Sequence

from spotrun.checkpoint import catalog, strict_json
from spotrun.checkpoint.catalog import StepInfo
from spotrun.errors import ObjectNotFoundError, SpotrunError
from spotrun.storage import Storage
from spotrun.tools.logs import utc_iso_ms

log = logging.getLogger(__name__)

#: Folder of the records under the checkpoint root.
FINISHED_DIR = "finished"
#: Files named on the command line up to this size are hashed by content; larger ones (data)
#: by size and modification time, so that a start never reads gigabytes.
HASH_CONTENT_MAX_BYTES = 4 * 1024 * 1024
#: Most seconds reading or writing the record may take (S3 retries included).
RECORD_TIMEOUT_S = 30.0
_FORMAT = 1


def command_digest(command: Sequence[str]) -> str:
    """SHA-256 (hex) of ``command`` and of the files it names (see the module docstring)."""
    files = {}
    for arg in command:
        for path in {arg, arg.partition("=")[2]} - {""}:
            try:
                if not os.path.isfile(path):
                    continue
                size = os.path.getsize(path)
                if size <= HASH_CONTENT_MAX_BYTES:
                    with open(path, "rb") as f:
                        files[path] = hashlib.sha256(f.read()).hexdigest()
                else:
                    files[path] = f"size {size} mtime_ns {os.stat(path).st_mtime_ns}"
            except OSError:  # unreadable: named by its path alone
                continue
    text = json.dumps({"command": list(command), "files": files}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def record_key(command: Sequence[str]) -> str:
    """Key of ``command``'s record: ``finished/<digest>.json``."""
    return f"{FINISHED_DIR}/{command_digest(command)}.json"


def record_finished(storage: Storage, command: Sequence[str]) -> StepInfo | None:
    """``command`` exited 0 as the end of training: record the newest complete step (none: no
    record). Failures are logged, never raised: the job did finish.

    Returns:
        The newest complete step, or ``None`` (none, or the listing failed).
    """
    try:
        with storage.deadline(RECORD_TIMEOUT_S):
            newest = catalog.newest_complete(storage)
            if newest is not None:
                storage.put(
                    record_key(command),
                    json.dumps(
                        {
                            "format": _FORMAT,
                            "command": list(command),
                            "step": newest.step,
                            "step_created_unix_s": newest.created_unix_s,
                            "finished_unix_s": time.time(),
                            "host": socket.gethostname(),
                        },
                        indent=1,
                    ).encode(),
                )
    except (SpotrunError, OSError) as exc:
        log.warning(
            "could not record that the job finished under %s (a start of the same command will launch it again): %s",
            storage.uri,
            exc,
        )
        return None
    return newest


def finished_line(uri: str, newest: StepInfo | None, endpoint_url: str | None = None) -> str:
    """The last line of a finished run: where its checkpoint is and what to do with it next."""
    if newest is None:
        return f"training finished; no complete spotrun checkpoint found under {uri}"
    root = shlex.quote(uri) + (f" --s3-endpoint-url {shlex.quote(endpoint_url)}" if endpoint_url else "")
    return (
        f"training finished: the checkpoint is step {newest.step} under {uri}; `spotrun ls {root}` lists its "
        f"steps, `spotrun export {root} --format hf OUT` writes step {newest.step}'s model as Hugging Face "
        "safetensors into OUT"
    )


def finished_step(storage: Storage, command: Sequence[str]) -> StepInfo | None:
    """The newest complete step, when ``command`` finished after it was saved and nothing
    changed since (see the module docstring); ``None``: launch. Never raises: a record that
    cannot be read means a launch."""
    key = record_key(command)
    try:
        with storage.deadline(RECORD_TIMEOUT_S):
            record = strict_json.loads(
                storage.get(key), max_bytes=strict_json.RECORD_MAX_BYTES, what="finished-run record"
            )
            newest = catalog.newest_complete(storage)
    except ObjectNotFoundError:
        return None
    except (SpotrunError, OSError, ValueError) as exc:
        log.warning("cannot read %s/%s (%s): starting the command", storage.uri, key, exc)
        return None
    if (
        not isinstance(record, dict)
        or record.get("format") != _FORMAT
        or record.get("command") != list(command)
        or newest is None
        or record.get("step") != newest.step
        or record.get("step_created_unix_s") != newest.created_unix_s
    ):
        return None
    log.info(
        "the job already finished: this command exited 0 at %s with step %d as its newest complete "
        "checkpoint, and it still is; not starting it again (exit 0; --rerun-finished starts it anyway): %s",
        utc_iso_ms(record.get("finished_unix_s") or 0.0),
        newest.step,
        shlex.join(command),
    )
    return newest
