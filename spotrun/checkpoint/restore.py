"""Loading a step: read the manifest, fetch and verify the files this rank needs, and rebuild
the state dicts; at a start, the newest step every rank can load (:func:`load_newest`: a step
that fails on any rank is skipped by all of them together).

A step is loaded in full (so a corrupt shard is found before any model is touched), then
applied (:func:`load_newest`'s ``apply``). Each file's size and digest (format 4: each
block's) are checked against the manifest before its bytes are used; tensors are checked against the
recorded dtype and shape, and tensors stored as raw bytes are viewed as their recorded dtype
(:mod:`spotrun.checkpoint.dtypes`). A step this reader cannot decode (a dtype this torch
lacks, bytes that do not fit the record) fails verification like a bad checksum:
:class:`CorruptShardError`; so does a step that disagrees with itself, found by the checks
``spotrun verify`` makes (the state skeletons against the tensor records; in format 4 the
chunks, indexes and headers of what is read, :meth:`ChunkReader.check`), and a state the
objects then refuse for its content (an RNG state the generator rejects). Local rank 0
shows a bar of the bytes it reads on a terminal (:mod:`spotrun.tools.progress`; format 4).
On several ranks the manifest is read once, by rank 0, and what several ranks need is read by
one of them and sent to the others (:mod:`spotrun.checkpoint.cooperative`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spotrun.checkpoint import catalog, tree
from spotrun.checkpoint.chunk_reader import ChunkReader
from spotrun.checkpoint.cooperative import HeldBack, PeerError, Peers, relay_manifest
from spotrun.checkpoint.fencing import read_fences
from spotrun.checkpoint.fetch import fetch_chunked, fetch_shared, fetch_tensors, into_dtensors
from spotrun.checkpoint.layout import REJECTED_PREFIX
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.sharded import is_dtensor
from spotrun.checkpoint.step_checks import skeleton_problems
from spotrun.checkpoint.tier_steps import tier_candidates
from spotrun.checkpoint.verdict import judge
from spotrun.errors import (
    CorruptShardError,
    ManifestError,
    NoCheckpointError,
    SpotrunError,
    StateMismatchError,
    StorageError,
)
from spotrun.storage.base import Storage
from spotrun.tools import dist
from spotrun.tools.gc_pause import gc_paused

log = logging.getLogger(__name__)


@dataclass
class LoadedStep:
    """A verified step, ready to apply.

    Attributes:
        manifest: the step's manifest.
        replicated: top-level name -> state dict (as ``state_dict()`` produced it).
        rank_local: this rank's own state by name (e.g. ``"rng"``): the state saved by
            rank ``rank_source``.
        rank_source: the saved rank whose own state this rank took: itself at the same world
            size; at another world size rank ``r`` takes rank ``r mod N``'s (N: saved world size).
        bytes_read: bytes this rank read from storage (format 4; 0 before).
        bytes_received: bytes this rank received from other ranks instead of reading them
            (:mod:`spotrun.checkpoint.cooperative`).
    """

    manifest: Manifest
    replicated: dict[str, Any]
    rank_local: dict[str, Any]
    rank_source: int = 0
    bytes_read: int = 0
    bytes_received: int = 0
    tier: str = "storage"
    """Where it was read: ``"memory"`` (the fast tier) or ``"storage"``."""


def read_manifest(storage: Storage, key: str) -> Manifest:
    """Fetch and parse the manifest stored under ``key``.

    Raises:
        ObjectNotFoundError: no manifest (the step never committed).
        ManifestError: the manifest is malformed.
    """
    return Manifest.from_json(storage.get(key), where=f"{storage.uri}/{key}")


@gc_paused()
def load_step(
    storage: Storage,
    step: int,
    key: str,
    rank: int,
    world_size: int,
    manifest: Manifest | None = None,
    destinations: dict[str, torch.Tensor] | None = None,
    peers: Peers | None = None,
) -> LoadedStep:
    """Load everything ``rank`` needs from ``step`` (its manifest under ``key``, as the
    catalog found it), verifying every file it reads.

    ``manifest``: the step's manifest when the caller has already read it (a listing
    parsed it; a manifest of a million tensors takes seconds to parse), else it is read.
    ``destinations``: tensor name (as encoded: ``model/layer.weight``) -> the live tensor
    that will hold it; files of format 3 are read straight into those that are contiguous
    CPU tensors of the recorded dtype and shape (:mod:`spotrun.checkpoint.reader`), which
    then hold the checkpoint's values even when a later file fails verification.

    Any saved layout loads into any current one: a destination that is a DTensor (FSDP2,
    tensor parallel) receives its own box of the global tensor, read from whichever chunks
    hold it (format 4: only the byte ranges it needs, :mod:`spotrun.checkpoint.chunk_reader`;
    formats 1-3 hold whole tensors, of which it keeps its box). At another world size than
    the step's, rank ``r`` takes the own state (RNGs) of saved rank ``r mod N``.

    ``peers``: every rank loads the step together (collective), and boxes several ranks need
    are read by one of them and sent to the others (format 4: :func:`fetch_shared`).

    Raises:
        StateMismatchError: a DTensor's global shape differs from the saved tensor's.
        HeldBack, PeerError: with ``peers``, another rank failed, or a transfer did.
        CorruptShardError: a file's size, checksum, or a tensor's dtype/shape is wrong.
        ManifestError, ObjectNotFoundError, StorageError: as the reads raise them.
    """
    if manifest is None:
        manifest = read_manifest(storage, key)
    if manifest.step != step:
        raise ManifestError(f"{storage.uri}/{key} says step {manifest.step}, not {step}")
    for problem in skeleton_problems(manifest):  # as spotrun verify checks it
        raise ManifestError(f"{storage.uri}/{key}: {problem}")
    rank_source = rank % manifest.world_size
    rank_skeleton = manifest.rank_state[rank_source]
    reader = (
        ChunkReader(storage, manifest, progress=f"restore step {step}" if dist.local_rank() == 0 else None)
        if manifest.format_version >= 4
        else None
    )
    received = 0
    try:
        needed = tree.tensor_names(manifest.state) + tree.tensor_names(rank_skeleton)
        if reader is not None and peers is not None:
            tensors, received = fetch_shared(reader, manifest, needed, destinations or {}, peers)
        elif reader is not None:
            tensors = fetch_chunked(reader, manifest, needed, destinations or {})
        else:
            tensors = fetch_tensors(storage, manifest, needed, _plain(destinations or {}))
            tensors = into_dtensors(tensors, destinations or {})
        replicated = {name: tree.decode(skel, tensors) for name, skel in manifest.state.items()}
        rank_local = {name: tree.decode(skel, tensors) for name, skel in rank_skeleton.items()}
    except (KeyError, IndexError, ValueError, TypeError, AttributeError, ArithmeticError, RecursionError) as exc:
        if isinstance(exc, SpotrunError):
            raise
        # whatever a committed step holds, not decoding it is a verification failure
        raise ManifestError(f"step {step}: cannot decode the state its manifest describes: {exc!r}") from exc
    return LoadedStep(
        manifest=manifest,
        replicated=replicated,
        rank_local=rank_local,
        rank_source=rank_source,
        bytes_read=reader.bytes_read if reader is not None else 0,
        bytes_received=received,
    )


def load_committed(storage: Storage, step: int, rank: int, world_size: int) -> LoadedStep:
    """:func:`load_step` of a step that must be complete, its valid manifest found by the
    catalog (for tools and tests; training goes through the catalog's listing once).

    Raises:
        ObjectNotFoundError: the step is not complete.
        Everything :func:`load_step` raises.
    """
    return load_step(storage, step, catalog.committed(storage, step).manifest_key, rank, world_size)


def load_newest(
    storage: Storage,
    *,
    supervisor_step: int | None,
    destinations: Callable[[], dict[str, torch.Tensor]] | dict[str, torch.Tensor] | None = None,
    apply: Callable[[LoadedStep], None] | None = None,
    fast_tier: Storage | None = None,
    run_id: str | None = None,
) -> LoadedStep | None:
    """Load the newest complete step that every rank can verify, or ``None`` when there is none.

    Lists the steps again (so a step committed since the supervisor chose ``supervisor_step``
    is newer and used). With a ``fast_tier`` (:mod:`spotrun.train.fast_tier`), its steps of
    this job (``run_id``, when given) are candidates too, tried before the same step on storage.
    A step that fails verification on any rank is skipped by every rank
    (:func:`judge`), logged (``checkpoint step S failed verification (...); falling back to step R``) and,
    when a file or manifest is corrupt, un-committed. ``destinations`` (name -> live
    tensor, or a function returning them, called only once there is a step to load) are
    filled in place where they fit (:func:`load_step`). ``apply`` puts a loaded step into the
    training objects: it is part of loading it, so a step whose state they refuse for what it
    holds (:class:`~spotrun.errors.CorruptShardError`, :class:`~spotrun.errors.ManifestError`:
    an RNG state the generator rejects) falls back like a bad checksum; a
    :class:`StateMismatchError` (the job's objects differ) or any other exception (the job's
    own code) stops every rank without un-committing anything.

    Raises:
        StorageError: the listing failed.
        NoCheckpointError: complete steps exist but none of them loads.
        StateMismatchError: the newest step every rank verified does not fit the job's objects.
        Whatever ``apply`` raised that is no verification failure, on the rank that raised it.
    """
    tiers = {"storage": storage, **({"memory": fast_tier} if fast_tier is not None else {})}
    listing, listed = _list_candidates(storage, supervisor_step, fast_tier, run_id) if dist.rank() == 0 else ({}, {})
    listing = dist.broadcast_json(listing)
    if "refused" in listing:
        raise NoCheckpointError(listing["refused"])
    if "error" in listing:
        raise StorageError(5, f"cannot list checkpoints under {storage.uri}: {listing['error']}")
    candidates = [(step, tier) for step, _key, tier in listing["steps"]]
    if callable(destinations) and candidates:
        destinations = destinations()
    for index, (step, key, tier) in enumerate(listing["steps"]):
        source = tiers[tier]
        loaded, raised, reports = _try_together(source, step, key, listed.pop((step, tier), None), destinations, apply)
        verdict = judge([report["problem"] for report in reports])
        if verdict.loads:
            loaded.tier = tier
            if dist.rank() == 0:
                _log_totals(step, reports, loaded.manifest)
            return loaded
        if verdict.mismatch is not None:
            if raised is not None:  # this rank's objects refused it: their own words
                raise raised
            raise StateMismatchError(f"checkpoint step {step} does not fit this job: {verdict.mismatch}")
        older = candidates[index + 1] if index + 1 < len(candidates) else None
        if dist.rank() == 0:
            log.warning(
                "checkpoint step %d%s failed verification (%s); falling back to %s",
                step,
                " in the fast tier" if tier == "memory" else "",
                "; ".join(f"rank {r}: {p}" for r, p in sorted(verdict.failures.items())),
                _described(older, len(tiers) > 1),
            )
            if verdict.corrupt:
                reject_step(source, key, "; ".join(verdict.failures.values()))
    if candidates:
        raise NoCheckpointError(
            f"no complete checkpoint under {storage.uri} could be loaded "
            f"(tried steps {[step for step, _tier in candidates]}); see the log for each failure"
        )
    return None


def _list_candidates(
    storage: Storage, supervisor_step: int | None, fast_tier: Storage | None, run_id: str | None
) -> tuple[dict, dict[tuple[int, str], tuple[Manifest, bytes | None]]]:
    """Rank 0: the complete steps of both tiers, newest first (the fast tier first at the same step),
    as told to every rank, and the manifest of the first with its bytes (parsed already: not
    parsed again, nor read again to send to the other ranks)."""
    try:
        memory = _fast_tier_newest_first(fast_tier, storage, run_id) if fast_tier is not None else []
        complete = _complete_newest_first(storage, supervisor_step, newer=memory[0].step if memory else None)
    except NoCheckpointError as exc:
        return {"refused": str(exc)}, {}
    except (SpotrunError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}, {}
    both = [(s, "memory") for s in memory] + [(s, "storage") for s in complete]
    both.sort(key=lambda pair: (pair[0].step, pair[1] == "memory"), reverse=True)
    listing = {"steps": [(s.step, s.manifest_key, tier) for s, tier in both]}
    return listing, {(s.step, tier): (s.manifest, s.manifest_text) for s, tier in both[:1]}


def _described(candidate: tuple[int, str] | None, tiers: bool) -> str:
    if candidate is None:
        return "nothing older"
    step, tier = candidate
    if not tiers:
        return f"step {step}"
    return f"step {step} {'in the fast tier' if tier == 'memory' else 'on storage'}"


def _fast_tier_newest_first(fast_tier: Storage, storage: Storage, run_id: str | None) -> list[catalog.StepInfo]:
    """The fast tier's steps a restart may use (:mod:`spotrun.checkpoint.tier_steps`), newest first;
    the others newer than those are said once."""
    found = tier_candidates(fast_tier, read_fences(storage), run_id)
    for step, why in found.ignored:
        log.warning("fast tier step %d ignored: %s", step, why)
    return found.usable


def _complete_newest_first(
    storage: Storage, supervisor_step: int | None, newer: int | None = None
) -> list[catalog.StepInfo]:
    steps = catalog.list_steps(storage)
    catalog.refuse_start_over(storage, steps)
    complete = [s for s in steps if s.status == catalog.COMPLETE]
    complete.sort(key=lambda s: s.step, reverse=True)
    newest_complete = complete[0].step if complete else -1
    # Found corrupt by the listing itself (a size, a link, a manifest that does not parse): said
    # once per start, as a step that fails on load is; under `spotrun run` the supervisor said it.
    if supervisor_step is None:
        for skipped in [s for s in steps if s.status == catalog.CORRUPT and s.step > newest_complete]:
            log.warning("checkpoint step %d is corrupt (%s); skipped", skipped.step, skipped.problem)
    newest = max(newest_complete, newer if newer is not None else -1)
    if supervisor_step is not None and newest >= 0 and newest != supervisor_step:
        log.info("the supervisor chose step %d; the newest complete step is now %d", supervisor_step, newest)
    return complete


def _try_together(
    storage: Storage,
    step: int,
    key: str,
    listed: tuple[Manifest, bytes | None] | None,
    destinations: Any,
    apply: Callable[[LoadedStep], None] | None,
) -> tuple[LoadedStep | None, Exception | None, list[dict]]:
    """:func:`_try_load` on every rank, with a new :class:`Peers` (a group whose transfer timed out
    is never used again): this rank's step and exception, and every rank's report (its problem
    and its bytes read and received)."""
    peers = Peers.open()
    try:
        loaded, problem, raised = _try_load(storage, step, key, listed, destinations, apply, peers)
        read, received = (loaded.bytes_read, loaded.bytes_received) if loaded is not None else (0, 0)
        reports = dist.all_gather_json({"problem": problem, "read": read, "received": received})
    finally:  # after the gather: every rank is done with the group
        if peers is not None:
            peers.close()
    return loaded, raised, reports


def _try_load(
    storage: Storage,
    step: int,
    key: str,
    listed: tuple[Manifest, bytes | None] | None,
    destinations: Any,
    apply: Callable[[LoadedStep], None] | None,
    peers: Peers | None,
) -> tuple[LoadedStep | None, dict | None, Exception | None]:
    """Load (and apply) one step on this rank: (the step, None, None), or (None, this rank's
    problem with it for :func:`judge`, the exception to raise again when the job's own code
    failed); (None, None, None) when another rank's problem stopped it (:class:`HeldBack`).
    With ``peers``, every rank loads the step together (:func:`load_step`)."""
    try:
        if peers is not None:
            manifest = relay_manifest(peers, storage, key, listed)
        else:
            manifest = listed[0] if listed is not None else None
        loaded = load_step(storage, step, key, dist.rank(), dist.world_size(), manifest, destinations, peers)
    except HeldBack:
        return None, None, None
    except (CorruptShardError, ManifestError) as exc:
        return None, {"corrupt": True, "message": str(exc)}, None
    except StateMismatchError as exc:  # not a bad step: every rank refuses it together
        return None, {"corrupt": False, "mismatch": True, "message": str(exc)}, None
    except (StorageError, PeerError) as exc:  # missing object, the store failed after retries, a peer failed
        return None, {"corrupt": False, "message": f"{type(exc).__name__}: {exc}"}, None
    if apply is None:
        return loaded, None, None
    try:
        apply(loaded)
    except (CorruptShardError, ManifestError) as exc:  # the step's content, refused by spotrun's own objects
        return None, {"corrupt": True, "message": f"{storage.uri}/{key}: {exc}"}, None
    except StateMismatchError as exc:  # raised again as it is, on this rank
        return None, {"corrupt": False, "mismatch": True, "message": str(exc)}, exc
    except Exception as exc:  # the job's own load_state_dict: never the step's fault to un-commit
        return None, {"corrupt": False, "mismatch": True, "message": f"{type(exc).__name__}: {exc}"}, exc
    return loaded, None, None


def _log_totals(step: int, reports: list[dict], manifest: Manifest) -> None:
    """Rank 0: one line with the bytes every rank read from storage and received from the others."""
    read = [report["read"] for report in reports]
    received = sum(report["received"] for report in reports)
    log.info(
        "restored step %d: %d rank(s) read %d bytes from storage in total (at most %d on one rank; "
        "the step's data files hold %d) and received %d bytes from each other",
        step,
        len(reports),
        sum(read),
        max(read),
        manifest.data_bytes,
        received,
    )


def _plain(destinations: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in destinations.items() if not is_dtensor(t)}


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
        doc = {
            "reason": reason,
            "rejected_unix_s": time.time(),
            "manifest": storage.get(key).decode("utf-8", "replace"),
        }
        storage.put(rejected, json.dumps(doc).encode())
        storage.delete(key)
        log.warning("%s un-committed: its manifest moved to %s", directory, rejected)
    except OSError as exc:
        log.error("could not un-commit corrupt %s: %s", directory, exc)
