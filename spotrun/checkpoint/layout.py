"""Names of things inside a checkpoint root.

    <root>/step-000001200/rank-00000.safetensors
    <root>/step-000001200/rank-00001.safetensors
    <root>/step-000001200/rank-00001.part-00001.safetensors   (more of rank 1's tensors, when split)
    <root>/step-000001200/manifest.json        (written last; commits the step)
"""

from __future__ import annotations

import re

from spotrun.manifest import MANIFEST_NAME

STEP_DIR_DIGITS = 9
#: Where a manifest goes when its step fails verification on restore.
REJECTED_MANIFEST_NAME = "rejected-manifest.json"
_STEP_DIR_RE = re.compile(r"^step-(\d{%d,})$" % STEP_DIR_DIGITS)


def step_dir(step: int) -> str:
    """Directory name of a step, zero-padded so names sort by step: ``step-000001200``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:0{STEP_DIR_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a directory name, or ``None`` when it is not a step directory."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def manifest_key(step: int) -> str:
    """Storage key of a step's manifest."""
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def shard_name(rank: int) -> str:
    """File name of the shard that ``rank`` writes: ``rank-00001.safetensors``."""
    return f"rank-{rank:05d}.safetensors"


def shard_part_name(rank: int, part: int) -> str:
    """File name of part ``part`` (0, 1, ...) of ``rank``'s shard.

    Part 0 is :func:`shard_name` itself; part ``k >= 1`` inserts ``.part-0000k`` before
    the extension: ``rank-00001.part-00002.safetensors``.
    """
    if part < 0:
        raise ValueError(f"part must be >= 0, got {part}")
    base = shard_name(rank)
    if part == 0:
        return base
    stem, dot, extension = base.rpartition(".")
    return f"{stem}.part-{part:05d}{dot}{extension}"


def file_key(step: int, path: str) -> str:
    """Storage key of a file recorded in a manifest."""
    return f"{step_dir(step)}/{path}"
