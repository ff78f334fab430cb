"""``spotrun export --format hf``: a checkpoint step's model weights as Hugging Face sharded
safetensors, written to a local directory or an ``s3://`` prefix.

The files are planned from the manifest (:mod:`spotrun.export.plan`), then written one at a
time with bounded memory, bit-identical to the saved tensors, the index last so that a reader
that finds it finds every file complete. The source checkpoint is only read. Memory bounds,
order of writes and a step deleted while exported: ``docs/design/internals.md`` (Export).
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass

from spotrun.checkpoint import catalog
from spotrun.checkpoint.chunk_reader import ChunkReader
from spotrun.checkpoint.fetch import read_whole_tensors
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.stream import CHECKSUM_CHUNK_BYTES, ShardSource
from spotrun.errors import (
    CorruptShardError,
    ExportError,
    NoCheckpointError,
    ObjectNotFoundError,
    ObjectTooShortError,
    StepDeletedError,
)
from spotrun.export.plan import INDEX_NAME, WEIGHT_FILE_RE, ExportPlan, ExportShard, plan_export
from spotrun.storage.base import Storage
from spotrun.tools.progress import progress_bar

log = logging.getLogger(__name__)

#: Format 4: tensors of one output file are read in batches of about this many bytes, so the
#: progress bar moves and small tensors are read in parallel.
READ_BATCH_BYTES = 64 * 2**20
#: Without a step named: how many times the newest complete step is exported when the one being
#: exported was deleted meanwhile (a live job with ``--keep-last``; each time from the start).
NEWEST_STEP_ATTEMPTS = 3


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        plan: the files and the tensors in each.
        out_uri: where they are.
        file_sizes: file name -> bytes written, in the order written.
        removed: stale weight files of an earlier export that were deleted (``overwrite``).
    """

    plan: ExportPlan
    out_uri: str
    file_sizes: dict[str, int]
    removed: tuple[str, ...] = ()


def find_step(storage: Storage, step: int | None) -> catalog.StepInfo:
    """The complete step ``step``, or the newest complete one when ``step`` is ``None``.

    Raises:
        ObjectNotFoundError: ``step`` is not complete (absent, incomplete, corrupt, fenced).
        NoCheckpointError: no complete step at all.
    """
    if step is None:
        info = catalog.newest_complete(storage)
        if info is None:
            raise NoCheckpointError(f"no complete step under {storage.uri} (spotrun ls shows what is there)")
        return info
    info = catalog.inspect_step(storage, step)
    if info is not None and info.status == catalog.COMPLETE:
        return info
    why = "absent" if info is None else f"{info.status}: {info.problem}"
    complete = [str(s.step) for s in catalog.list_steps(storage) if s.status == catalog.COMPLETE]
    raise ObjectNotFoundError(
        errno.ENOENT,
        f"step {step} under {storage.uri} is not complete ({why}); "
        f"newest complete steps: {', '.join(complete[-10:]) or 'none'}",
    )


def export_hf(
    source: Storage,
    out: Storage,
    *,
    step: int | None = None,
    state_name: str = "model",
    max_shard_size_bytes: int = 5 * 10**9,
    tied: str = "copy",
    overwrite: bool = False,
) -> ExportResult:
    """Export ``state_name`` of ``step`` under ``source`` as Hugging Face safetensors into ``out``.

    Args:
        source: the checkpoint root.
        out: the output root (a directory, or an S3 prefix).
        step: the step to export; ``None``: the newest complete one.
        state_name: the top-level state (``Checkpointer(state={"model": ...})``).
        max_shard_size_bytes: most bytes of tensor data per file.
        tied: ``"copy"`` (tied keys written each) or ``"drop"`` (once): see
            :mod:`spotrun.export.plan`.
        overwrite: replace weight files an earlier export left in ``out`` (other files there,
            such as ``config.json``, are never touched).

    Raises:
        ExportError: no such state, an unsupported dtype, ``out`` already holds weight files
            and not ``overwrite``. Nothing is written.
        ObjectNotFoundError, NoCheckpointError: the step is not complete, or none is.
        CorruptShardError: a checkpoint file fails verification (files already written stay;
            no index names them; with ``overwrite``, the earlier export's index is gone too:
            logged as an error).
        StepDeletedError: the step was deleted while it was read (the job's retention, gc);
            without ``step``, the newest complete step was deleted under each of
            :data:`NEWEST_STEP_ATTEMPTS` attempts. The files this export wrote are deleted.
        StorageError: a read or write failed.
    """
    info = find_step(source, step)
    manifest, plan = _plan(info, state_name, max_shard_size_bytes, tied)
    existing = sorted(o.key for o in out.list("") if "/" not in o.key and WEIGHT_FILE_RE.match(o.key))
    if existing and not overwrite:
        shown = ", ".join(existing[:3]) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
        raise ExportError(
            f"{out.uri} already holds exported weights ({shown}); pass --overwrite to replace "
            "them, or choose another output"
        )
    if INDEX_NAME in existing:
        out.delete(INDEX_NAME)  # first: no index may name a half-replaced set of files
    try:
        plan, file_sizes = _write_step(
            source,
            out,
            info,
            manifest,
            plan,
            attempts=NEWEST_STEP_ATTEMPTS if step is None else 1,
            state_name=state_name,
            max_shard_size_bytes=max_shard_size_bytes,
            tied=tied,
        )
    except BaseException:
        if existing:
            log.error(
                "the earlier export in %s is no longer usable: its index was removed before this export "
                "began writing; export again",
                out.uri,
            )
        raise
    removed = tuple(name for name in existing if name not in file_sizes)
    for name in removed:
        out.delete(name)
    return ExportResult(plan=plan, out_uri=out.uri, file_sizes=file_sizes, removed=removed)


def _plan(info: catalog.StepInfo, state_name: str, max_shard_size_bytes: int, tied: str) -> tuple[Manifest, ExportPlan]:
    """The complete step's manifest, and the files to export ``state_name`` of it into."""
    manifest = info.manifest
    assert manifest is not None  # a complete step has one
    return manifest, plan_export(manifest, state_name, max_shard_size_bytes, tied)


def _write_step(
    source: Storage,
    out: Storage,
    info: catalog.StepInfo,
    manifest: Manifest,
    plan: ExportPlan,
    *,
    attempts: int,
    state_name: str,
    max_shard_size_bytes: int,
    tied: str,
) -> tuple[ExportPlan, dict[str, int]]:
    """Write ``plan``'s files; when the step is deleted meanwhile and ``attempts`` allow, the
    newest complete step's instead. Returns the plan written and file name -> bytes written.

    Raises:
        StepDeletedError: the step was deleted under each attempt (its files written are deleted).
    """
    for attempt in range(attempts):
        if attempt:  # the newest complete step was deleted under us: export the newest now
            log.warning(
                "step %d was deleted while exporting it (the job's retention); exporting the newest "
                "complete step instead",
                plan.step,
            )
            info = find_step(source, None)
            manifest, plan = _plan(info, state_name, max_shard_size_bytes, tied)
        file_sizes: dict[str, int] = {}
        try:
            _write_files(source, out, manifest, plan, file_sizes)
            return plan, file_sizes
        except (ObjectNotFoundError, CorruptShardError, ObjectTooShortError):
            if not catalog.deleted_since_listed(source, info):
                raise
            for name in file_sizes:  # this attempt's files, of a step that is gone
                out.delete(name)
    raise StepDeletedError(
        errno.ENOENT,
        f"step {plan.step} under {source.uri} was deleted while exporting it (the job's "
        "retention, --keep-last, or spotrun gc removed it); nothing of it was left in "
        f"{out.uri}: export again, or a step the job keeps (--keep-every)",
    )


def _write_files(
    source: Storage, out: Storage, manifest: Manifest, plan: ExportPlan, file_sizes: dict[str, int]
) -> None:
    """Write the planned files, the index last; ``file_sizes`` gets each file written."""
    reader = ChunkReader(source, manifest) if manifest.format_version >= 4 else None
    with progress_bar(2 * plan.total_size_bytes, f"export step {plan.step}: read + write") as bar:
        for shard in plan.shards:
            file_sizes[shard.filename] = _write_shard(source, out, manifest, plan, shard, reader, bar)
        index = plan.index_json()  # last: it names only files that are whole
        out.put(INDEX_NAME, index)
        file_sizes[INDEX_NAME] = len(index)


def _write_shard(
    source: Storage,
    out: Storage,
    manifest: Manifest,
    plan: ExportPlan,
    shard: ExportShard,
    reader: ChunkReader | None,
    bar,
) -> int:
    """Read one output file's tensors, stream the file out, and return its size in bytes."""
    sizes: dict[str, int] = {}
    for tensor in shard.tensors:  # a tied pair in one file is read once
        sizes.setdefault(tensor.source, tensor.size_bytes)
    values = {}
    for batch in _batches(sizes, READ_BATCH_BYTES if reader is not None else None):
        values.update(read_whole_tensors(source, manifest, batch, reader))
        bar.update(sum(sizes[name] for name in batch))
    file = ShardSource({t.key: values[t.source] for t in shard.tensors}, plan.metadata())
    # the bar counted each tensor's bytes twice: a tied copy is read once, and the header is written too
    bar.total += (sum(sizes.values()) - shard.size_bytes) + (file.size_bytes - shard.size_bytes)
    out.put_stream(
        shard.filename, file, chunk_bytes=CHECKSUM_CHUNK_BYTES, on_chunk=lambda _offset, data: bar.update(len(data))
    )
    return file.size_bytes


def _batches(sizes: dict[str, int], batch_bytes: int | None) -> list[list[str]]:
    """Names in order, cut into batches of about ``batch_bytes`` (``None``: one batch; formats
    1-3 read whole files, so one batch per output file reads each source file once)."""
    batches: list[list[str]] = [[]]
    held = 0
    for name, size in sizes.items():
        if batch_bytes is not None and batches[-1] and held + size > batch_bytes:
            batches.append([])
            held = 0
        batches[-1].append(name)
        held += size
    return [b for b in batches if b]
