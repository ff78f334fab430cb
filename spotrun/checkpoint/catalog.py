"""Which steps exist under a checkpoint root, and which of them are complete.

A step is

* ``complete``   - its manifest parses and every file it lists exists with the recorded size;
* ``incomplete`` - files exist but no manifest (a save that never committed, e.g. a kill
  in the middle of a write);
* ``corrupt``    - a manifest exists but does not parse, or a listed file is missing or has
  the wrong size.

Only ``complete`` steps are ever resumed from. Checksums are not read here (that needs
the whole file); they are verified while loading, see :mod:`spotrun.checkpoint.read`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

from spotrun.checkpoint.layout import (
    REJECTED_MANIFEST_NAME,
    file_key,
    manifest_key,
    parse_step_dir,
    step_dir,
)
from spotrun.errors import ManifestError, ObjectNotFoundError
from spotrun.manifest import MANIFEST_NAME, Manifest
from spotrun.storage.base import ObjectInfo, Storage

log = logging.getLogger(__name__)

COMPLETE = "complete"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"


@dataclass(frozen=True)
class StepInfo:
    """What the catalog knows about one step directory.

    Attributes:
        step: training step number.
        status: ``complete``, ``incomplete`` or ``corrupt``.
        size_bytes: bytes of every object under the step directory (manifest included).
        world_size: from the manifest; ``None`` without a readable manifest.
        created_unix_s: manifest creation time, else the newest object's mtime (seconds, UTC epoch).
        reason: why it was saved (``periodic``, ``emergency``, ``final``, ...); ``None`` if unknown.
        problem: for ``incomplete`` and ``corrupt``, a one-line explanation.
        manifest: the parsed manifest when there is one that parses.
    """

    step: int
    status: str
    size_bytes: int
    world_size: int | None
    created_unix_s: float
    reason: str | None
    problem: str | None
    manifest: Manifest | None = None

    def to_json(self) -> dict:
        """The fields ``spotrun ls --json`` prints."""
        return {
            "step": self.step,
            "status": self.status,
            "size_bytes": self.size_bytes,
            "world_size": self.world_size,
            "created_unix_s": self.created_unix_s,
            "reason": self.reason,
            "problem": self.problem,
        }


def list_steps(storage: Storage) -> list[StepInfo]:
    """Every step directory under the root, oldest first."""
    by_step: dict[int, list[ObjectInfo]] = defaultdict(list)
    for info in storage.list(""):
        top, sep, _rest = info.key.partition("/")
        step = parse_step_dir(top) if sep else None
        if step is not None:
            by_step[step].append(info)
    return [_inspect(storage, step, objects) for step, objects in sorted(by_step.items())]


def newest_complete(storage: Storage, *, below: int | None = None) -> StepInfo | None:
    """The complete step with the highest number (``< below`` when given), or ``None``."""
    complete = [
        s for s in list_steps(storage)
        if s.status == COMPLETE and (below is None or s.step < below)
    ]
    return complete[-1] if complete else None


def inspect_step(storage: Storage, step: int) -> StepInfo | None:
    """What one step directory holds (``None`` when it is empty or absent)."""
    objects = storage.list(f"{step_dir(step)}/")
    return _inspect(storage, step, objects) if objects else None


def _inspect(storage: Storage, step: int, objects: list[ObjectInfo]) -> StepInfo:
    size_bytes = sum(o.size_bytes for o in objects)
    newest_mtime = max(o.mtime_s for o in objects)
    sizes = {o.key: o.size_bytes for o in objects}
    mkey = manifest_key(step)

    def result(status: str, problem: str | None, manifest: Manifest | None = None) -> StepInfo:
        return StepInfo(
            step=step,
            status=status,
            size_bytes=size_bytes,
            world_size=manifest.world_size if manifest else None,
            created_unix_s=manifest.created_unix_s if manifest else newest_mtime,
            reason=manifest.reason if manifest else None,
            problem=problem,
            manifest=manifest,
        )

    if mkey not in sizes:
        if f"{step_dir(step)}/{REJECTED_MANIFEST_NAME}" in sizes:
            return result(CORRUPT, "failed verification on restore; see " + REJECTED_MANIFEST_NAME)
        return result(INCOMPLETE, f"no {MANIFEST_NAME}: the save never committed")
    try:
        manifest = Manifest.from_json(storage.get(mkey), where=f"{storage.uri}/{mkey}")
    except ObjectNotFoundError:
        return result(INCOMPLETE, f"{MANIFEST_NAME} disappeared while listing")
    except ManifestError as exc:
        return result(CORRUPT, str(exc))
    if manifest.step != step:
        return result(CORRUPT, f"manifest says step {manifest.step}, directory says {step}", manifest)
    for record in manifest.files:
        key = file_key(step, record.path)
        if key not in sizes:
            return result(CORRUPT, f"{record.path} is missing", manifest)
        if sizes[key] != record.size_bytes:
            return result(
                CORRUPT,
                f"{record.path} has {sizes[key]} bytes, manifest recorded {record.size_bytes}",
                manifest,
            )
    return result(COMPLETE, None, manifest)
