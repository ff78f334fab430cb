"""Loading one step: read the manifest, fetch and verify the files this rank needs,
and rebuild the state dicts.

Nothing is applied to the training objects here: a caller first loads everything
(so a corrupt shard is found before any model is touched), then applies it. Each file
is fetched once and its size and SHA-256 are checked against the manifest before it
is parsed; tensors are checked against the recorded dtype and shape, and tensors stored
as raw bytes are viewed as their recorded dtype (:mod:`spotrun.checkpoint.dtypes`). A
step this reader cannot decode (a dtype this torch lacks, bytes that do not fit the
record) fails verification like a bad checksum: :class:`CorruptShardError`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import REJECTED_PREFIX, file_key
from spotrun.checkpoint.dtypes import from_stored
from spotrun.checkpoint.reader import read_shard_into
from spotrun.gc_pause import gc_paused
from spotrun.checkpoint.shard import decode_shard
from spotrun.errors import CorruptShardError, ManifestError, SpotrunError, StateMismatchError
from spotrun.manifest import Manifest
from spotrun.state import tree
from spotrun.storage.base import Storage

log = logging.getLogger(__name__)


@dataclass
class LoadedStep:
    """A verified step, ready to apply.

    Attributes:
        manifest: the step's manifest.
        replicated: top-level name -> state dict (as ``state_dict()`` produced it).
        rank_local: this rank's own state by name (e.g. ``"rng"``).
    """

    manifest: Manifest
    replicated: dict[str, Any]
    rank_local: dict[str, Any]


def read_manifest(storage: Storage, key: str) -> Manifest:
    """Fetch and parse the manifest stored under ``key``.

    Raises:
        ObjectNotFoundError: no manifest (the step never committed).
        ManifestError: the manifest is malformed.
    """
    return Manifest.from_json(storage.get(key), where=f"{storage.uri}/{key}")


@gc_paused()
def load_step(storage: Storage, step: int, key: str, rank: int, world_size: int,
              manifest: Manifest | None = None,
              destinations: dict[str, torch.Tensor] | None = None) -> LoadedStep:
    """Load everything ``rank`` needs from ``step`` (its manifest under ``key``, as the
    catalog found it), verifying every file it reads.

    ``manifest``: the step's manifest when the caller has already read it (a listing
    parsed it; a manifest of a million tensors takes seconds to parse), else it is read.
    ``destinations``: tensor name (as encoded: ``model/layer.weight``) -> the live tensor
    that will hold it; files of format 3 are read straight into those that are contiguous
    CPU tensors of the recorded dtype and shape (:mod:`spotrun.checkpoint.reader`), which
    then hold the checkpoint's values even when a later file fails verification.

    Raises:
        StateMismatchError: the step was saved at another world size.
        CorruptShardError: a file's size, checksum, or a tensor's dtype/shape is wrong.
        ManifestError, ObjectNotFoundError, StorageError: as the reads raise them.
    """
    if manifest is None:
        manifest = read_manifest(storage, key)
    if manifest.step != step:
        raise ManifestError(f"{storage.uri}/{key} says step {manifest.step}, not {step}")
    if manifest.world_size != world_size:
        raise StateMismatchError(
            f"checkpoint step {step} was saved by {manifest.world_size} rank(s), this job has "
            f"{world_size}; resuming at another world size is not supported yet - start the job "
            f"with {manifest.world_size} rank(s), or point --checkpoint-uri elsewhere"
        )
    rank_skeleton = manifest.rank_state[rank]
    try:
        needed = tree.tensor_names(manifest.state) + tree.tensor_names(rank_skeleton)
        tensors = _fetch_tensors(storage, manifest, needed, destinations or {})
        replicated = {name: tree.decode(skel, tensors) for name, skel in manifest.state.items()}
        rank_local = {name: tree.decode(skel, tensors) for name, skel in rank_skeleton.items()}
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as exc:
        if isinstance(exc, SpotrunError):
            raise
        # whatever a committed step holds, not decoding it is a verification failure
        raise ManifestError(f"step {step}: cannot decode the state its manifest describes: {exc!r}") from exc
    return LoadedStep(manifest=manifest, replicated=replicated, rank_local=rank_local)


def load_committed(storage: Storage, step: int, rank: int, world_size: int) -> LoadedStep:
    """:func:`load_step` of a step that must be complete, its valid manifest found by the
    catalog (for tools and tests; training goes through the catalog's listing once).

    Raises:
        ObjectNotFoundError: the step is not complete.
        Everything :func:`load_step` raises.
    """
    return load_step(storage, step, catalog.committed(storage, step).manifest_key, rank, world_size)


def _fetch_tensors(storage: Storage, manifest: Manifest, names: list[str],
                   destinations: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    records = {f.path: f for f in manifest.files}
    stored_name = {n: manifest.aliases.get(n, n) for n in names}
    by_file: dict[str, list[str]] = {}
    for name in names:
        target = stored_name[name]
        if target not in manifest.tensors:
            raise CorruptShardError(f"step {manifest.step}: manifest lists no tensor {target!r}")
        by_file.setdefault(manifest.tensors[target].file, []).append(name)
    loaded: dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        key = file_key(manifest.step, path)
        where = f"{storage.uri}/{key}"
        if records[path].algorithm == "sha256":  # formats 1 and 2: whole-file checksum
            content = decode_shard(storage.get(key), records[path], where=where)
            for name in file_names:
                target = stored_name[name]
                if target not in loaded:
                    loaded[target] = _checked(content, target, manifest, key)
                loaded[name] = loaded[target]
            continue
        wanted = {stored_name[n]: manifest.tensors[stored_name[n]] for n in file_names}
        read = read_shard_into(storage, key, records[path], wanted, destinations, where=where)
        for name in file_names:
            loaded[name] = read[stored_name[name]]
    return loaded


def _checked(content: dict[str, torch.Tensor], name: str, manifest: Manifest, key: str) -> torch.Tensor:
    if name not in content:
        raise CorruptShardError(f"{key}: tensor {name!r} is missing")
    tensor = from_stored(content[name], manifest.tensors[name], where=f"{key}: tensor {name!r}")
    # The parser's tensors are views into its read buffers (16-byte aligned, at offsets that
    # depend on the heap). An optimizer keeps what it is given, so a copy in torch's own
    # allocation (64-byte aligned, own storage) makes restored state lie in memory like the
    # state of an uninterrupted run, whatever a kernel's vector loop makes of alignment.
    return tensor.clone(memory_format=torch.contiguous_format)


def reject_step(storage: Storage, key: str, reason: str) -> None:
    """Un-commit a step that failed verification, keeping its manifest for inspection.

    The manifest under ``key`` moves to ``rejected-<its name>`` (with the reason), so the
    step shows as ``corrupt`` in ``spotrun ls``, is never resumed from again, and a later
    save of the same step can commit. Errors are logged, not raised: the caller is already
    falling back.
    """
    directory, _, name = key.rpartition("/")
    rejected = f"{directory}/{REJECTED_PREFIX}{name}"
    try:
        doc = {"reason": reason, "rejected_unix_s": time.time(), "manifest": storage.get(key).decode("utf-8", "replace")}
        storage.put(rejected, json.dumps(doc).encode())
        storage.delete(key)
        log.warning("%s un-committed: its manifest moved to %s", directory, rejected)
    except OSError as exc:
        log.error("could not un-commit corrupt %s: %s", directory, exc)
