"""Which steps exist under a checkpoint root, and which of them are complete.

A step is ``complete``, ``incomplete``, ``corrupt`` or ``fenced``, decided by the one valid
manifest under the fencing rule; only ``complete`` steps are ever resumed from. Checksums are
not read here; they are verified while loading. The statuses: ``docs/design/internals.md``
(Checkpoint engine).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from spotrun.checkpoint.fencing import Fences, read_fences
from spotrun.checkpoint.layout import (
    DELETION_MARKER_NAME,
    INCARNATIONS_DIR,
    REJECTED_PREFIX,
    file_key,
    parse_manifest_name,
    step_dir,
    step_of_key,
    step_prefixes,
)
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.strict_json import MANIFEST_MAX_BYTES
from spotrun.errors import ManifestError, NoCheckpointError, ObjectNotFoundError, UnsafeObjectError
from spotrun.storage.base import ObjectInfo, Storage

log = logging.getLogger(__name__)

COMPLETE = "complete"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"
FENCED = "fenced"


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
        manifest_key: storage key of that manifest (``None`` without one).
        newest_object_unix_s: the newest object's modification time (seconds, UTC epoch; on
            S3 an object's ``LastModified``).
        object_count: how many objects the step directory holds.
        being_deleted: a deletion was started and nothing was written into the step since:
            its marker ``deleting.json`` is there and no object is newer
            (:mod:`spotrun.checkpoint.retention`); an incomplete step then says so.
        objects: every object of the step as listed (its step directory and, in the spread
            key layout, its ranks' prefixes): what deleting the step deletes.
        manifest_text: the bytes ``manifest`` was parsed from (a restore sends them to the
            other ranks instead of each reading them).
    """

    step: int
    status: str
    size_bytes: int
    world_size: int | None
    created_unix_s: float
    reason: str | None
    problem: str | None
    manifest: Manifest | None = None
    manifest_key: str | None = None
    newest_object_unix_s: float = 0.0
    object_count: int = 0
    being_deleted: bool = False
    objects: tuple[ObjectInfo, ...] = ()
    manifest_text: bytes | None = field(default=None, repr=False, compare=False)

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
    """Every step directory under the root, oldest first (one listing of the root)."""
    return list_root(storage)[0]


def list_root(storage: Storage) -> tuple[list[StepInfo], Fences]:
    """Every step directory under the root, oldest first, and the incarnation table (one
    listing of the root)."""
    objects = storage.list("")
    by_step = objects_by_step(objects)
    fences = read_fences(storage, [o for o in objects if o.key.startswith(f"{INCARNATIONS_DIR}/")])
    return [_inspect(storage, step, objects, fences) for step, objects in sorted(by_step.items())], fences


def objects_by_step(objects: list[ObjectInfo]) -> dict[int, list[ObjectInfo]]:
    """The objects of a root's listing of each step, in its step directory or under a spread
    prefix (:func:`~spotrun.checkpoint.layout.step_of_key`; a linked step dir too)."""
    by_step: dict[int, list[ObjectInfo]] = defaultdict(list)
    for info in objects:
        step = step_of_key(info.key, directory=info.refused is not None)  # refused: a linked step dir
        if step is not None:
            by_step[step].append(info)
    return by_step


def newest_complete(storage: Storage, *, below: int | None = None) -> StepInfo | None:
    """The complete step with the highest number (``< below`` when given), or ``None``."""
    complete = [s for s in list_steps(storage) if s.status == COMPLETE and (below is None or s.step < below)]
    return complete[-1] if complete else None


def inspect_step(storage: Storage, step: int, fences: Fences | None = None) -> StepInfo | None:
    """What one step holds (``None`` when its step directory is empty or absent).

    Lists the step directory, then the spread prefixes its manifests record (one listing each,
    never the whole root): the files of a save that never committed a manifest under spread
    prefixes are found by :func:`list_root` (``spotrun ls``, ``spotrun gc``), not here. The
    incarnation records are read (``fences`` ``None``) only when the step has a manifest.
    """
    prefix = f"{step_dir(step)}/"
    objects = storage.list(prefix)
    if not objects:
        return None
    read: dict[str, tuple[Manifest, bytes] | str | None] = {}
    prefixes = {prefix}
    manifests = [o for o in objects if parse_manifest_name(o.key[len(prefix) :])[0]]
    for info in manifests:
        if info.size_bytes <= MANIFEST_MAX_BYTES:  # a larger one is refused by its size, unread
            found = read[info.key] = _read(storage, info.key)
            if isinstance(found, tuple) and found[0].step == step:
                prefixes.update(step_prefixes(step, found[0]))
    for other in sorted(prefixes - {prefix}):
        objects.extend(storage.list(other))
    if fences is None:
        fences = read_fences(storage) if manifests else Fences()
    return _inspect(storage, step, objects, fences, read)


def step_objects(storage: Storage, step: int, manifest: Manifest | None) -> list[ObjectInfo]:
    """The objects of ``step`` where ``manifest`` says its files lie (its step directory, and
    its writers' spread prefixes): one listing per prefix."""
    return [o for prefix in step_prefixes(step, manifest) for o in storage.list(prefix)]


def committed(storage: Storage, step: int) -> StepInfo:
    """The step, which must be complete (its valid manifest is ``.manifest_key``).

    Raises:
        ObjectNotFoundError: the step is not complete (absent, incomplete, corrupt or fenced).
    """
    info = inspect_step(storage, step)
    if info is None or info.status != COMPLETE:
        why = "absent" if info is None else f"{info.status}: {info.problem}"
        raise ObjectNotFoundError(2, f"{storage.uri}/{step_dir(step)}: step {step} is not committed ({why})")
    return info


def deleted_since_listed(storage: Storage, info: StepInfo) -> bool:
    """Whether ``info``'s step was deleted, or its deletion began, after it was listed: its
    manifest is gone, or its deletion marker is its newest object (a deletion writes the marker
    first, then deletes the manifests: :func:`~spotrun.checkpoint.retention.delete_step`).

    A reader whose read of a listed file failed (``spotrun verify``, ``export``) asks this to
    tell a step that retention or gc removed meanwhile (gone) from a damaged one (its manifest
    still there, no deletion under way, and a file missing). One listing of each prefix of the
    step (:func:`step_objects`).
    """
    prefix = f"{step_dir(info.step)}/"
    objects = {o.key: o for o in step_objects(storage, info.step, info.manifest)}
    if info.manifest_key is not None and info.manifest_key not in objects:
        return True
    marker = objects.get(prefix + DELETION_MARKER_NAME)
    return marker is not None and marker.mtime_s >= max(o.mtime_s for o in objects.values())


def _read(storage: Storage, key: str) -> tuple[Manifest, bytes] | str | None:
    """The parsed manifest and its bytes, a problem description, or ``None`` when it vanished."""
    try:
        text = storage.get(key)
        return Manifest.from_json(text, where=f"{storage.uri}/{key}"), text
    except ObjectNotFoundError:
        return None
    except (ManifestError, UnsafeObjectError) as exc:
        return str(exc)


def _inspect(
    storage: Storage,
    step: int,
    objects: list[ObjectInfo],
    fences: Fences,
    read: dict[str, tuple[Manifest, bytes] | str | None] | None = None,
) -> StepInfo:
    """The status of a step from its listed objects; ``read``: manifests already read, by key."""
    size_bytes = sum(o.size_bytes for o in objects)
    newest_mtime = max(o.mtime_s for o in objects)
    sizes = {o.key: o.size_bytes for o in objects}
    prefix = f"{step_dir(step)}/"
    # manifests, the marker and rejected manifests count only in the step directory itself
    own = [key[len(prefix) :] for key in sizes if key.startswith(prefix)]
    marker = [o for o in objects if o.key == prefix + DELETION_MARKER_NAME]
    being_deleted = bool(marker) and marker[0].mtime_s >= newest_mtime

    def result(
        status: str, problem: str | None, manifest: Manifest | None = None, key: str | None = None, text=None
    ) -> StepInfo:
        return StepInfo(
            step=step,
            status=status,
            size_bytes=size_bytes,
            world_size=manifest.world_size if manifest else None,
            created_unix_s=manifest.created_unix_s if manifest else newest_mtime,
            reason=manifest.reason if manifest else None,
            problem=problem,
            manifest=manifest,
            manifest_key=key,
            newest_object_unix_s=newest_mtime,
            object_count=len(objects),
            being_deleted=being_deleted,
            objects=tuple(objects),
            manifest_text=text if manifest is not None else None,
        )

    refused = [o for o in objects if o.refused is not None]
    if refused:  # nothing of the step is read: what a link leads to is not the checkpoint's
        return result(CORRUPT, f"{refused[0].key} is refused: {refused[0].refused}")
    fenced: list[str] = []
    for incarnation, key in _manifests_newest_first(prefix, own):
        newer = fences.fenced_by(incarnation, step)
        if newer is not None:
            checked = _check_manifest(storage, step, key, incarnation, sizes, result, read)
            if checked.status == CORRUPT:  # damaged whoever fenced it: `ls` says what is wrong
                return checked
            fenced.append(
                f"{key[len(prefix) :]} was committed by incarnation {incarnation} after incarnation "
                f"{newer} started from "
                + ("scratch" if fences.resumed[newer] is None else f"step {fences.resumed[newer]}")
            )
            continue
        info = _check_manifest(storage, step, key, incarnation, sizes, result, read)
        if (
            info.status == CORRUPT
            and info.manifest is not None
            and (being_deleted or deleted_since_listed(storage, info))
        ):
            # a file missing because retention or gc is deleting the step (the listing saw the
            # manifest before its deletion, the files after): gone, not damaged
            return result(
                INCOMPLETE,
                f"being deleted: {info.problem} and the step's deletion has begun "
                f"({DELETION_MARKER_NAME} or its manifest's removal)",
            )
        return info
    if fenced:
        return result(FENCED, "; ".join(fenced) + ": never resumed from")
    if any(name.startswith(REJECTED_PREFIX) for name in own):
        return result(CORRUPT, "failed verification on restore; see the rejected-manifest file")
    if being_deleted:
        return result(
            INCOMPLETE,
            f"being deleted: its manifest is gone, {DELETION_MARKER_NAME} is there "
            "(spotrun gc finishes an interrupted deletion)",
        )
    return result(INCOMPLETE, "no manifest: the save never committed")


def _manifests_newest_first(prefix: str, names: list[str]) -> list[tuple[int | None, str]]:
    """``(incarnation in the name, key)`` of the manifests among ``names`` (in the step directory
    ``prefix``), newest incarnation first: when two are valid (never written so), it wins."""
    found = [(parse_manifest_name(name)[1], prefix + name) for name in names if parse_manifest_name(name)[0]]
    return sorted(found, key=lambda m: -1 if m[0] is None else m[0], reverse=True)


def _check_manifest(
    storage: Storage,
    step: int,
    key: str,
    incarnation: int | None,
    sizes: dict[str, int],
    result,
    read: dict[str, tuple[Manifest, bytes] | str | None] | None,
) -> StepInfo:
    if sizes[key] > MANIFEST_MAX_BYTES:  # refused by its listed size, before it is read
        return result(
            CORRUPT,
            f"{storage.uri}/{key} is refused: {sizes[key]} bytes, more than the "
            f"{MANIFEST_MAX_BYTES} a manifest may have",
            None,
            key,
        )
    found = read[key] if read is not None and key in read else _read(storage, key)
    if found is None:
        return result(INCOMPLETE, f"{key} disappeared while listing")
    if isinstance(found, str):
        return result(CORRUPT, found, None, key)
    manifest, text = found
    if manifest.step != step:
        return result(CORRUPT, f"manifest says step {manifest.step}, directory says {step}", manifest, key)
    if incarnation is not None and manifest.incarnation != incarnation:
        return result(
            CORRUPT, f"manifest says incarnation {manifest.incarnation}, its name says {incarnation}", manifest, key
        )
    for record in manifest.files:
        fkey = file_key(step, record, manifest)
        if fkey not in sizes:
            return result(CORRUPT, f"{record.path} is missing", manifest, key)
        if sizes[fkey] != record.size_bytes:
            return result(
                CORRUPT,
                f"{record.path} has {sizes[fkey]} bytes, manifest recorded {record.size_bytes}",
                manifest,
                key,
            )
    return result(COMPLETE, None, manifest, key, text)


def refuse_start_over(storage: Storage, steps: list[StepInfo]) -> None:
    """Refuse a fresh start where checkpoints exist but every one failed verification.

    Starting over from step 0 would silently throw away the run (and a restart would do it
    again every time): the operator decides.

    Raises:
        NoCheckpointError: ``steps`` has no complete step and some corrupt ones.
    """
    if any(s.status == COMPLETE for s in steps):
        return
    corrupt = [s for s in steps if s.status == CORRUPT]
    if corrupt:
        raise NoCheckpointError(
            f"no checkpoint under {storage.uri} loads: step(s) {[s.step for s in corrupt]} failed verification "
            f"(step {corrupt[-1].step}: {corrupt[-1].problem}); refusing to start over from step 0. To start "
            f"over anyway, move {storage.uri} aside or delete those step directories"
        )
