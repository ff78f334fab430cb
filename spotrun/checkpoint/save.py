"""Saving one step on every rank: prepare (encode, pick this rank's tensors, stage them), then
commit in three phases, each ending in one collective: agree (same structure, the step may be
saved), write this rank's shard, commit (rank 0 writes the manifest with ``put_if_absent``).

A failure on any rank is reported through the collectives, so every rank raises for the same
step and no rank waits alone; without a manifest the step never commits. Each collective gives
up at the save's collective deadline (:mod:`spotrun.checkpoint.save_bounds`), naming the ranks that did
not arrive (:class:`~spotrun.errors.CollectiveTimeoutError`). Preparing and
committing are separate so that the commit can run on a background thread. The sequence:
``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from spotrun.checkpoint import catalog, fencing
from spotrun.checkpoint.dtypes import to_stored
from spotrun.checkpoint.encode import EncodedState, encode_state, structure_digest
from spotrun.checkpoint.layout import SPREAD_DIGITS, manifest_key
from spotrun.checkpoint.manifest import Manifest, SpreadLayout
from spotrun.checkpoint.manifest_build import build_manifest
from spotrun.checkpoint.restore import reject_step
from spotrun.checkpoint.save_bounds import collectives_deadline_s, phase_timeout_s
from spotrun.checkpoint.save_failures import describe, raise_if_failed
from spotrun.checkpoint.shard import ShardLimits, split_into_parts
from spotrun.checkpoint.shard_write import SaveProgress, write_index, write_shard
from spotrun.checkpoint.staging import StagingBuffers
from spotrun.checkpoint.write_plan import plan_writes, save_report
from spotrun.control.env import DEFAULT_SAVE_TIMEOUT_S
from spotrun.errors import (
    CheckpointSaveError,
    CommitUnsupportedError,
    FencedError,
    SaveAbortedError,
    SpotrunError,
    StateMismatchError,
)
from spotrun.storage.base import Storage
from spotrun.tools import dist
from spotrun.tools.gc_pause import gc_paused
from spotrun.tools.progress import progress_bar

log = logging.getLogger(__name__)


@dataclass
class PreparedSave:
    """This rank's part of a step, ready to be written (by this thread or a background one).

    Attributes:
        step: training step.
        rank, world_size: of the writer.
        encoded: the encoded state (its tensors are the live ones).
        tensors: chunk key (:func:`~spotrun.checkpoint.rank_index.chunk_key`) -> tensor this
            rank writes, in stored form
            (:func:`spotrun.checkpoint.dtypes.to_stored`): host copies in staging buffers
            for a background save, or the live tensors themselves for a synchronous one
            (written straight from their memory; nothing may change them until the save ends).
        error: the state could not be encoded on this rank (reported to every rank by
            :func:`commit_save`, which then raises it here).
    """

    step: int
    rank: int
    world_size: int
    encoded: EncodedState | None
    tensors: dict[str, torch.Tensor]
    error: SpotrunError | None = None
    chunks: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] | None = None
    """chunk key -> (tensor name, offsets, lengths in the global tensor) of every tensor
    in :attr:`tensors`."""
    reported: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] | None = None
    """The part of :attr:`chunks` rank 0 must be told: all but the chunks of DTensors whose
    layout it derives from their placements
    (:func:`~spotrun.checkpoint.sharded.predicted_grid`)."""


@gc_paused()
def prepare_save(
    step: int,
    replicated: dict[str, Any],
    rank_local: dict[str, Any],
    *,
    staging: StagingBuffers | None = None,
) -> PreparedSave:
    """Encode the state and pick the tensors this rank writes (no collective).

    With ``staging`` the tensors are copied into its reused host buffers (returns once
    the copies are complete: training may then change the live tensors); without, the
    save writes from the live tensors (a GPU tensor through a bounded host buffer).
    Never raises for bad state: the error travels in :attr:`PreparedSave.error` so that
    :func:`commit_save` tells every rank.
    """
    rank, world_size = dist.rank(), dist.world_size()
    try:
        encoded = encode_state(replicated, rank_local, rank)
        plan = plan_writes(encoded, rank, world_size)
    except SpotrunError as exc:
        return PreparedSave(step, rank, world_size, None, {}, error=exc)
    mine = {key: to_stored(t.detach()) for key, t in plan.tensors.items()}
    if staging is not None:
        mine = staging.stage(mine)
    return PreparedSave(step, rank, world_size, encoded, mine, chunks=plan.chunks, reported=plan.reported)


@dataclass(frozen=True)
class SavedStep:
    """What :func:`save_step` returns on every rank.

    Attributes:
        manifest: the committed manifest on rank 0, ``None`` on other ranks.
        size_bytes: bytes of all the step's shard files (every rank's; manifest excluded).
    """

    manifest: Manifest | None
    size_bytes: int


@dataclass(frozen=True)
class SaveContext:
    """Facts recorded in the manifest besides the state itself.

    Attributes:
        reason: why the step is saved (``periodic``, ``emergency``, ...).
        run_id: the job's identifier.
        incarnation: the incarnation this process claimed (:mod:`spotrun.checkpoint.fencing`);
            it names every file written and the manifest.
        step_time_s: seconds a training step takes (recorded in the manifest's ``timing``);
            ``None`` when unknown.
    """

    reason: str
    run_id: str
    incarnation: int
    step_time_s: float | None = None


def save_step(
    storage: Storage,
    step: int,
    replicated: dict[str, Any],
    rank_local: dict[str, Any],
    context: SaveContext,
    limits: ShardLimits | None = None,
    *,
    collective_deadline_s: float | None = None,
) -> SavedStep:
    """Save and commit ``step`` on every rank, synchronously, from the live tensors
    (collective: all ranks must call it): :func:`prepare_save` then :func:`commit_save`.

    Raises:
        Everything :func:`commit_save` raises.
    """
    prepared = prepare_save(step, replicated, rank_local)
    return commit_save(
        storage, prepared, context, limits, show_progress=True, collective_deadline_s=collective_deadline_s
    )


def commit_save(
    storage: Storage,
    prepared: PreparedSave,
    context: SaveContext,
    limits: ShardLimits | None = None,
    *,
    group: Any = None,
    abort: threading.Event | None = None,
    progress: SaveProgress | None = None,
    show_progress: bool = False,
    collective_deadline_s: float | None = None,
) -> SavedStep:
    """Write this rank's shard of ``prepared`` and commit the step (collective on ``group``:
    every rank calls it for the same step; a background thread passes its own group).

    ``limits`` (default :class:`~spotrun.checkpoint.shard.ShardLimits`) says when a rank's
    shard is split into several files. ``abort`` (set on every rank) abandons the save:
    nothing is committed and every rank raises :class:`SaveAbortedError` (unless rank 0
    had already committed, in which case the save succeeds everywhere). ``progress`` is
    updated as bytes are written. ``show_progress``: a bar of the bytes local rank 0 writes, on
    a terminal (:mod:`spotrun.tools.progress`; not for background saves: it would cut through training output).
    ``collective_deadline_s``: when (``time.monotonic()``) each phase's collective gives up
    (:func:`~spotrun.checkpoint.save_bounds.collectives_deadline_s`); default: that of a save
    bounded by the default save timeout.

    Returns:
        The committed manifest (rank 0 only) and the step's size in bytes (every rank,
        from the gathered shard records: no extra collective).

    Raises:
        StateSerializationError: a state value cannot be stored (before anything is written).
        StateMismatchError: ranks disagree on the replicated state's structure.
        FencedError: a newer incarnation of the job started on this root; nothing committed.
        SaveAbortedError: ``abort`` was set; nothing committed.
        CheckpointSaveError: writing or committing failed on some rank; nothing committed.
        CollectiveTimeoutError: a rank did not arrive at a phase's collective in time (it names
            the ranks); nothing committed, and ``group`` is unusable.
    """
    until_s = collective_deadline_s or collectives_deadline_s(DEFAULT_SAVE_TIMEOUT_S)
    layout = _agree(storage, prepared, context, group, until_s)
    reports = _write(
        storage,
        prepared,
        context,
        limits,
        layout,
        group=group,
        abort=abort,
        progress=progress,
        show_progress=show_progress,
        until_s=until_s,
    )
    manifest = _commit(storage, prepared, context, reports, layout, group=group, abort=abort, until_s=until_s)
    return SavedStep(manifest=manifest, size_bytes=sum(f["size_bytes"] for rep in reports for f in rep["files"]))


def _agree(
    storage: Storage, prepared: PreparedSave, context: SaveContext, group: Any, until_s: float
) -> SpreadLayout | None:
    """Phase 1 (1 gather): every rank encoded its state, rank 0 may save the step, and the
    replicated structure is the same everywhere; otherwise every rank raises. Returns the key
    layout of the step, rank 0's choice (:meth:`~spotrun.storage.base.Storage.spreads_rank_keys`),
    so that every rank writes where the manifest will say."""
    rank, world_size, step = prepared.rank, prepared.world_size, prepared.step
    local_error: SpotrunError | None = prepared.error
    first: dict[str, Any]
    if local_error is not None:
        first = {"error": f"{type(local_error).__name__}: {local_error}", "fenced": False}
    else:
        assert prepared.encoded is not None
        # compared between ranks; one rank has nothing to compare
        first = {"digest": structure_digest(prepared.encoded) if world_size > 1 else ""}
        if rank == 0:
            first["spread_digits"] = SPREAD_DIGITS if storage.spreads_rank_keys(world_size) else None
            try:
                first["committed"] = _clear_the_way(storage, step, context.incarnation)
            except FencedError as exc:  # reported to the other ranks so none waits alone
                local_error, first = exc, {"error": f"{type(exc).__name__}: {exc}", "fenced": True}
            except (SpotrunError, OSError) as exc:
                local_error = CheckpointSaveError(
                    f"save of step {step} failed on rank 0: {describe(exc)} - nothing was committed"
                )
                local_error.__cause__ = exc
                first = {"error": f"{type(local_error).__name__}: {local_error}", "fenced": False}
    what = f"the agree gather of step {step}'s save"
    firsts = dist.all_gather_json(first, group=group, timeout_s=phase_timeout_s(until_s), what=what)
    if local_error is not None:
        raise local_error
    if firsts[0].get("fenced"):
        raise FencedError(f"save of step {step} refused on rank 0: {firsts[0]['error']}")
    if firsts[0].get("committed"):
        raise CheckpointSaveError(
            f"step {step} is already committed under {storage.uri} ({firsts[0]['committed']}); "
            "not overwriting it - nothing was written"
        )
    raise_if_failed(
        firsts, lambda failed: f"save of step {step} refused: " + "; ".join(f"rank {r}: {e}" for r, e in failed.items())
    )
    digests = [f["digest"] for f in firsts]
    if len(set(digests)) != 1:
        differing = [r for r, d in enumerate(digests) if d != digests[0]]
        raise StateMismatchError(
            f"replicated state differs in structure between rank 0 and rank(s) {differing}; "
            "state passed to Checkpointer(state=...) must be identical on every rank (as in DDP)"
        )
    digits = firsts[0].get("spread_digits")
    return None if digits is None else SpreadLayout(digits)


def _write(
    storage: Storage,
    prepared: PreparedSave,
    context: SaveContext,
    limits: ShardLimits | None,
    layout: SpreadLayout | None,
    *,
    group: Any,
    abort: threading.Event | None,
    progress: SaveProgress | None,
    show_progress: bool,
    until_s: float,
) -> list[dict[str, Any]]:
    """Phase 2 (1 gather): write this rank's shard and index; returns every rank's report
    (its file records and rank state), or raises on every rank when one failed."""
    step, encoded = prepared.step, prepared.encoded
    assert encoded is not None
    report: dict[str, Any] = {"ok": True}
    write_error: Exception | None = None
    try:
        write_started_s = time.monotonic()
        parts = split_into_parts(prepared.tensors, limits or ShardLimits())
        bytes_total = sum(t.numel() * t.element_size() for t in prepared.tensors.values())
        if progress is not None:
            progress.bytes_total = bytes_total
            progress.started_monotonic_s = write_started_s
        with progress_bar(bytes_total, f"save step {step}", show=show_progress and dist.local_rank() == 0) as bar:
            records, index = write_shard(
                storage,
                prepared,
                context.incarnation,
                parts,
                layout,
                abort=abort,
                progress=progress or SaveProgress(on_add=bar.update),
            )
        if abort is not None and abort.is_set():  # abandoned while its last bytes were written
            raise SaveAbortedError(f"save of step {step} abandoned")
        records.append(write_index(storage, index, context.incarnation, layout))
        assert prepared.reported is not None
        report = save_report(encoded, prepared.reported, records, time.monotonic() - write_started_s)
    except Exception as exc:  # any failure is reported, so that no rank waits alone at the gather
        write_error, report = exc, {"ok": False, "error": describe(exc), "aborted": isinstance(exc, SaveAbortedError)}
        if not isinstance(exc, SaveAbortedError):
            log.error("rank %d failed to write its shard of step %d: %s", prepared.rank, step, report["error"])
    what = f"the write gather of step {step}'s save"
    reports = dist.all_gather_json(report, group=group, timeout_s=phase_timeout_s(until_s), what=what)
    raise_if_failed(
        reports,
        lambda failed: (
            f"save of step {step} failed on rank(s) {sorted(failed)}: "
            + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            + " - nothing was committed"
        ),
        cause=write_error,
    )
    return reports


def _commit(
    storage: Storage,
    prepared: PreparedSave,
    context: SaveContext,
    reports: list[dict[str, Any]],
    layout: SpreadLayout | None,
    *,
    group: Any,
    abort: threading.Event | None,
    until_s: float,
) -> Manifest | None:
    """Phase 3 (1 broadcast): rank 0 writes the manifest unless fenced or abandoned; returns
    it on rank 0 (``None`` elsewhere), or raises on every rank when the commit failed."""
    step = prepared.step
    outcome: dict[str, Any] = {"ok": True}
    manifest = None
    if prepared.rank == 0:
        assert prepared.encoded is not None
        try:
            with gc_paused():
                manifest = build_manifest(step, prepared.encoded, reports, context, prepared.world_size, layout)
                manifest_json = manifest.to_json()
            fencing.check_not_fenced(storage, context.incarnation)
            if abort is not None and abort.is_set():  # the last moment an abandon takes effect
                raise SaveAbortedError(f"save of step {step} abandoned before its commit")
            storage.put_if_absent(manifest_key(step, context.incarnation), manifest_json)
        except Exception as exc:  # reported through the broadcast, so no rank waits for it
            outcome = {
                "ok": False,
                "error": describe(exc),
                "fenced": isinstance(exc, FencedError),
                "aborted": isinstance(exc, SaveAbortedError),
                "retryable": not isinstance(exc, (FencedError, CommitUnsupportedError)),
            }
        # a store spread over nodes (the fast tier across nodes) keeps the manifest on each of them
        if outcome["ok"] and getattr(storage, "manifest_on_every_node", False):
            outcome["manifest"] = manifest_json.decode()
    what = f"the commit broadcast of step {step}'s save"
    outcome = dist.broadcast_json(outcome, group=group, timeout_s=phase_timeout_s(until_s), what=what)
    raise_if_failed([outcome], lambda failed: f"commit of step {step} failed on rank 0: {failed[0]}")
    if "manifest" in outcome and prepared.rank != 0 and dist.local_rank() == 0:
        try:  # the step is committed: a node without its copy reads it from the others
            storage.put(manifest_key(step, context.incarnation), outcome["manifest"].encode())
        except (SpotrunError, OSError) as exc:
            log.warning("step %d is committed, but this node's copy of its manifest failed: %s", step, exc)
    return manifest


def _clear_the_way(storage: Storage, step: int, incarnation: int) -> str | None:
    """Rank 0, before anything is written: never write into a committed step.

    Refuses (:class:`FencedError`) when a newer incarnation has started. A step that is
    complete (its valid manifest and files present) is left alone (returns a description:
    the save is refused). A step whose valid manifest is broken or whose files are missing
    or of the wrong size is un-committed first (its manifest moved aside), so that it can
    be saved again - this is how a job that fell back past a corrupt step gets through
    that step again. Manifests of older incarnations that are fenced are ignored: this
    incarnation commits under its own names and overwrites nothing.
    """
    fencing.check_not_fenced(storage, incarnation)
    info = catalog.inspect_step(storage, step)
    if info is None or info.manifest_key is None:
        return None
    if info.status == catalog.COMPLETE:
        manifest = info.manifest
        return f"run {manifest.run_id}, incarnation {manifest.incarnation}, {manifest.reason}"
    reject_step(storage, info.manifest_key, f"re-saving over a {info.status} step: {info.problem}")
    return None
