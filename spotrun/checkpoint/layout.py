"""Names of things inside a checkpoint root.

    <root>/incarnations/incarnation-000000003.json     one per start of the job (fencing)
    <root>/step-000001200/rank-00000.i000000003.safetensors
    <root>/step-000001200/rank-00001.i000000003.safetensors
    <root>/step-000001200/rank-00001.i000000003.part-00001.safetensors   (more of rank 1's tensors, when split)
    <root>/step-000001200/manifest.i000000003.json      (written last; commits the step)
    <root>/step-000001200/deleting.json                 (only while the step is being deleted)

The spread key layout (format 5, object stores from 256 ranks on: ``key_layout``) puts each
rank's data files and index under a prefix of its own, the last digits of its rank reversed,
so that a save's requests spread over the store's partitions; the manifest stays in the step
directory and records the layout:

    <root>/10/step-000001200/rank-00001.i000000003.safetensors
    <root>/10/step-000001200/rank-00001.i000000003.index.json
    <root>/20/step-000001200/rank-00102.i000000003.safetensors
    <root>/step-000001200/manifest.i000000003.json

Every file a writer creates carries its incarnation, so two incarnations of a job (a new
start and a zombie of the old one) never write to the same name: a committed step's
bytes cannot be replaced by another writer. ``manifest.json`` and
``rank-NNNNN.safetensors`` without an incarnation are the names of format version 1
(read, never written). :func:`file_key` is the one place a data file's key is made.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from spotrun.checkpoint.key_layout import MAX_SPREAD_DIGITS, SpreadLayout
from spotrun.checkpoint.manifest import MANIFEST_NAME

if TYPE_CHECKING:
    from spotrun.checkpoint.manifest import FileRecord, Manifest

STEP_DIR_DIGITS = 9
INCARNATION_DIGITS = 9
#: Prefix under the root of the incarnation records (see :mod:`spotrun.checkpoint.fencing`).
INCARNATIONS_DIR = "incarnations"
#: A manifest that failed verification is renamed to this prefix + its name.
REJECTED_PREFIX = "rejected-"
#: Where a version-1 manifest (``manifest.json``) goes when its step fails verification.
REJECTED_MANIFEST_NAME = REJECTED_PREFIX + MANIFEST_NAME
#: Written into a step directory before its deletion starts and removed last
#: (see :mod:`spotrun.checkpoint.retention`).
DELETION_MARKER_NAME = "deleting.json"
_STEP_DIR_RE = re.compile(r"^step-(\d{%d,})$" % STEP_DIR_DIGITS)
_MANIFEST_RE = re.compile(r"^manifest\.i(\d{%d,})\.json$" % INCARNATION_DIGITS)
_INCARNATION_RE = re.compile(r"^incarnation-(\d{%d,})\.json$" % INCARNATION_DIGITS)
_SPREAD_DIR_RE = re.compile(r"^\d{1,%d}$" % MAX_SPREAD_DIGITS)
#: Digits of the spread prefixes a save writes: 100 prefixes (the derivation:
#: ``docs/design/storage.md``, Requests that scale).
SPREAD_DIGITS = 2


def step_dir(step: int) -> str:
    """Directory name of a step, zero-padded so names sort by step: ``step-000001200``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:0{STEP_DIR_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a directory name, or ``None`` when it is not a step directory."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def _tag(incarnation: int) -> str:
    if incarnation < 0:
        raise ValueError(f"incarnation must be >= 0, got {incarnation}")
    return f"i{incarnation:0{INCARNATION_DIGITS}d}"


def manifest_name(incarnation: int | None) -> str:
    """File name of the manifest an incarnation commits: ``manifest.i000000003.json``
    (``None``: the version-1 name ``manifest.json``)."""
    return MANIFEST_NAME if incarnation is None else f"manifest.{_tag(incarnation)}.json"


def parse_manifest_name(name: str) -> tuple[bool, int | None]:
    """``(is a manifest, incarnation)``; the incarnation is ``None`` for ``manifest.json``."""
    if name == MANIFEST_NAME:
        return True, None
    match = _MANIFEST_RE.match(name)
    return (True, int(match.group(1))) if match else (False, None)


def manifest_key(step: int, incarnation: int | None) -> str:
    """Storage key of the manifest that ``incarnation`` commits for ``step``."""
    return f"{step_dir(step)}/{manifest_name(incarnation)}"


def shard_name(rank: int, incarnation: int | None) -> str:
    """File name of the shard that ``rank`` of ``incarnation`` writes:
    ``rank-00001.i000000003.safetensors`` (``None``: version 1's ``rank-00001.safetensors``)."""
    if incarnation is None:
        return f"rank-{rank:05d}.safetensors"
    return f"rank-{rank:05d}.{_tag(incarnation)}.safetensors"


def shard_part_name(rank: int, incarnation: int | None, part: int) -> str:
    """File name of part ``part`` (0, 1, ...) of the shard that ``rank`` of ``incarnation`` writes.

    Part 0 is :func:`shard_name` itself; part ``k >= 1`` inserts ``.part-0000k`` before
    the extension: ``rank-00001.i000000003.part-00002.safetensors``.
    """
    if part < 0:
        raise ValueError(f"part must be >= 0, got {part}")
    base = shard_name(rank, incarnation)
    if part == 0:
        return base
    stem, dot, extension = base.rpartition(".")
    return f"{stem}.part-{part:05d}{dot}{extension}"


def index_name(rank: int, incarnation: int) -> str:
    """File name of the index that ``rank`` of ``incarnation`` writes next to its shard files
    (format 4: where each of its chunks lies and each block's digest):
    ``rank-00001.i000000003.index.json``."""
    return f"rank-{rank:05d}.{_tag(incarnation)}.index.json"


def spread_dir(rank: int, digits: int) -> str:
    """The spread prefix of ``rank``'s files: its last ``digits`` decimal digits, reversed, so
    that the fastest-changing digit comes first (rank 1234, 2 digits: ``"43"``)."""
    if rank < 0 or not 1 <= digits <= MAX_SPREAD_DIGITS:
        raise ValueError(f"spread_dir needs a rank >= 0 and 1 to {MAX_SPREAD_DIGITS} digits, got {rank}, {digits}")
    return f"{rank % 10**digits:0{digits}d}"[::-1]


def is_spread_dir(name: str) -> bool:
    """Whether ``name`` (the first component of a key) can be a spread prefix."""
    return _SPREAD_DIR_RE.match(name) is not None


def data_file_key(step: int, rank: int, name: str, layout: SpreadLayout | None) -> str:
    """Storage key of the data file or index ``name`` that ``rank`` writes for ``step``:
    ``step-N/name``, or under the layout's spread prefix, ``<spread>/step-N/name``."""
    if layout is None:
        return f"{step_dir(step)}/{name}"
    return f"{spread_dir(rank, layout.digits)}/{step_dir(step)}/{name}"


def file_key(step: int, record: FileRecord, manifest: Manifest) -> str:
    """Storage key of a file ``manifest`` records for ``step`` (wherever its key layout put it)."""
    return data_file_key(step, record.rank, record.path, manifest.key_layout)


def step_of_key(key: str, *, directory: bool = False) -> int | None:
    """The step an object of a root's listing belongs to (``step-N/...`` or ``<spread>/step-N/...``),
    or ``None``. ``directory``: ``key`` may be the step directory itself (a refused link)."""
    top, sep, rest = key.partition("/")
    if is_spread_dir(top) and sep:
        top, sep, rest = rest.partition("/")
    return parse_step_dir(top) if sep or directory else None


def step_prefixes(step: int, manifest: Manifest | None) -> list[str]:
    """The key prefixes that hold ``step``'s objects as ``manifest`` records them: the step
    directory, then the spread prefixes of its writers (sorted)."""
    prefixes = [f"{step_dir(step)}/"]
    if manifest is not None and manifest.key_layout is not None:
        digits = manifest.key_layout.digits
        spreads = sorted({spread_dir(f.rank, digits) for f in manifest.files})
        prefixes.extend(f"{spread}/{step_dir(step)}/" for spread in spreads)
    return prefixes


def incarnation_key(incarnation: int) -> str:
    """Storage key of an incarnation's record: ``incarnations/incarnation-000000003.json``."""
    return f"{INCARNATIONS_DIR}/incarnation-{incarnation:0{INCARNATION_DIGITS}d}.json"


def parse_incarnation_key(key: str) -> int | None:
    """The incarnation of a record's key, or ``None`` when ``key`` is not one."""
    top, sep, name = key.partition("/")
    if top != INCARNATIONS_DIR or not sep:
        return None
    match = _INCARNATION_RE.match(name)
    return int(match.group(1)) if match else None
