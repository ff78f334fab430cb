"""Checking committed steps against their manifests without loading them into a training job
(``spotrun verify``). Nothing is written.

Per step: every listed file exists with its size, every file's digest matches (in format 4 a
mismatch names the byte range of the bad blocks), every tensor is in its file with the recorded
dtype and shape. Memory is bounded whatever the checkpoint's size. The checks in full:
``docs/design/internals.md`` (Checkpoint engine).
"""

from __future__ import annotations

import errno
import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from spotrun.checkpoint.catalog import (
    COMPLETE,
    CORRUPT,
    FENCED,
    INCOMPLETE,
    StepInfo,
    deleted_since_listed,
    inspect_step,
    list_steps,
    step_objects,
)
from spotrun.checkpoint.layout import file_key, parse_manifest_name
from spotrun.checkpoint.manifest import FileRecord, Manifest
from spotrun.checkpoint.rank_index import IndexedFile, RankIndex
from spotrun.checkpoint.step_checks import block_problems, parse_index, skeleton_problems
from spotrun.checkpoint.stream import CHECKSUM_CHUNK_BYTES, WHOLE_SHA256, ChunkDigests, chunk_ranges
from spotrun.checkpoint.strict_json import INDEX_MAX_BYTES
from spotrun.checkpoint.verify_tensors import Finding, ShardHeader, check_chunks, check_whole_tensors, read_header
from spotrun.errors import CorruptShardError, NoCheckpointError, ObjectNotFoundError, ObjectTooShortError
from spotrun.storage.base import Storage

#: The status of a step deleted while it was verified (retention of a live job, ``spotrun gc``):
#: gone, not damaged; no problem.
DELETED = "deleted"
DELETED_NOTE = "deleted while verifying (retention of the live job, or spotrun gc): gone, not damaged"

#: Most bytes of one read (a multiple of the file's checksum chunk, or one chunk when larger).
READ_UNIT_BYTES = CHECKSUM_CHUNK_BYTES


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a step: ``path`` is the file (relative to the step directory), or
    ``None`` when the problem is the step's as a whole."""

    step: int
    path: str | None
    reason: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.path + ': ' if self.path else ''}{self.reason}"


@dataclass
class StepReport:
    """What verifying one step found.

    Attributes:
        step: the step number.
        status: the catalog's status (``complete``, ``corrupt``, ``incomplete``, ``fenced``), or
            :data:`DELETED` for a step deleted while it was read.
        verified: whether its files were read (a step with a manifest that parses).
        problems: everything wrong, in the manifest's file order; empty when all is well.
        files, size_bytes, tensors: what the manifest lists (0 when it was not read).
        algorithms: the digest algorithms its files record (``["blake3-chunks", "sha256"]``).
        note: why a step was not verified (an incomplete, fenced or deleted step), else ``None``.
    """

    step: int
    status: str
    verified: bool
    problems: list[Problem] = field(default_factory=list)
    files: int = 0
    size_bytes: int = 0
    tensors: int = 0
    algorithms: list[str] = field(default_factory=list)
    note: str | None = None

    @property
    def deleted(self) -> bool:
        """The step was deleted while it was read (gone, not damaged)."""
        return self.status == DELETED

    @property
    def ok(self) -> bool:
        """No problem found (an incomplete step listed by ``--all`` is no problem)."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The fields ``spotrun verify --json`` prints for a step."""
        return {
            "step": self.step,
            "status": self.status,
            "verified": self.verified,
            "ok": self.ok,
            "files": self.files,
            "size_bytes": self.size_bytes,
            "tensors": self.tensors,
            "algorithms": self.algorithms,
            "note": self.note,
            "problems": [{"file": p.path, "reason": p.reason} for p in self.problems],
        }


def steps_to_verify(storage: Storage, *, step: int | None = None, every: bool = False) -> list[StepInfo]:
    """The steps ``spotrun verify`` checks, oldest first: ``step``; with ``every``, every step
    directory; else the newest complete step (the one a restart resumes from) and any newer
    step that committed but is corrupt (a restart skips it: its damage is what to report).

    Raises:
        ObjectNotFoundError: there is no step ``step``.
        NoCheckpointError: by default, when no step is complete or corrupt.
        StorageError: listing or reading failed.
    """
    if step is not None:
        info = inspect_step(storage, step)
        if info is None:
            raise ObjectNotFoundError(errno.ENOENT, f"no step {step} under {storage.uri}")
        return [info]
    steps = list_steps(storage)
    if every:
        return steps
    complete = [s for s in steps if s.status == COMPLETE]
    newest = complete[-1].step if complete else -1
    chosen = complete[-1:] + [s for s in steps if s.status == CORRUPT and s.step > newest]
    if not chosen:
        listed = ", ".join(f"{s.step} {s.status}" for s in steps[-5:])
        raise NoCheckpointError(
            f"no complete checkpoint under {storage.uri} to verify" + (f" (steps: {listed})" if steps else "")
        )
    return chosen


def verify_step(
    storage: Storage, info: StepInfo, *, explicit: bool = False, on_bytes: Callable[[int], object] | None = None
) -> StepReport:
    """Check one step (see the module docstring).

    Args:
        info: the step as the catalog lists it.
        explicit: the user named this step: an incomplete or fenced one is then a problem
            (it is not a checkpoint), else only noted.
        on_bytes: called with the number of bytes after each read (progress), from any thread.

    Returns:
        The report; status :data:`DELETED`, no problem, when something was wrong and the step
        turned out to have been deleted since it was listed (see
        :func:`~spotrun.checkpoint.catalog.deleted_since_listed`).

    Raises:
        StorageError: a read failed for another reason than a missing or short file.
    """
    if info.manifest is None:
        if info.status in (INCOMPLETE, FENCED):
            report = StepReport(info.step, info.status, verified=False, note=info.problem)
            if explicit:
                report.problems.append(
                    Problem(info.step, None, f"{info.status}, not a committed checkpoint: {info.problem}")
                )
            return report
        name = info.manifest_key.rpartition("/")[2] if info.manifest_key else None
        reason = (info.problem or "corrupt").replace(f"{storage.uri}/{info.manifest_key} ", "", 1)
        return StepReport(info.step, info.status, verified=False, problems=[Problem(info.step, name, reason)])
    report = _StepCheck(storage, info, on_bytes or (lambda n: None)).run()
    if report.problems and deleted_since_listed(storage, info):
        # a file missing because the step is being deleted under us: gone, not damaged; a step
        # whose manifest is still there, with no deletion begun, keeps its problems
        return StepReport(info.step, DELETED, verified=False, note=DELETED_NOTE)
    return report


class _StepCheck:
    """The checks of one step with a manifest, run once (:meth:`run`)."""

    def __init__(self, storage: Storage, info: StepInfo, on_bytes: Callable[[int], object]) -> None:
        assert info.manifest is not None
        self._storage = storage
        self._info = info
        self._manifest: Manifest = info.manifest
        self._step = info.step
        self._on_bytes = on_bytes
        self._findings: dict[Finding, None] = {}  # an ordered set: a read failure is said once
        self._lock = threading.Lock()
        self._buffers = threading.local()

    def run(self) -> StepReport:
        manifest = self._manifest
        self._check_identity()
        present = self._check_presence()
        data = [(r, size) for r, size in present.items() if not _is_index(r)]
        pool = ThreadPoolExecutor(max_workers=self._storage.read_concurrency, thread_name_prefix="spotrun-verify")
        try:
            index_jobs = {
                r.rank: (r.path, pool.submit(self._load_index, r) if r in present else None)
                for r in manifest.files
                if _is_index(r)
            }
            header_jobs = {r.path: pool.submit(self._header, r, size) for r, size in data}
            indexes = {rank: (path, None if job is None else job.result()) for rank, (path, job) in index_jobs.items()}
            headers = {path: h for path, job in header_jobs.items() if (h := job.result()) is not None}
            blocks = self._block_digests(indexes)
            finishers = [self._submit_digest(pool, r, blocks.get(r.path)) for r, size in data if size == r.size_bytes]
            for finish in finishers:
                finish()
        finally:  # on a storage error or Ctrl-C, the reads still queued are dropped
            pool.shutdown(wait=True, cancel_futures=True)
        for problem in skeleton_problems(manifest):
            self._add((self._info.manifest_key or "").rpartition("/")[2] or None, problem)
        if manifest.format_version >= 4:
            found = check_chunks(manifest, indexes, headers)
        else:
            found = check_whole_tensors(manifest, headers)
        for path, reason in found:
            self._add(path, reason)
        order = {r.path: i for i, r in enumerate(manifest.files)}
        findings = sorted(self._findings, key=lambda f: -1 if f[0] is None else order.get(f[0], len(order)))
        return StepReport(
            self._step,
            self._info.status,
            verified=True,
            problems=[Problem(self._step, path, reason) for path, reason in findings],
            files=len(manifest.files),
            size_bytes=manifest.size_bytes,
            tensors=len(manifest.tensors),
            algorithms=sorted({r.algorithm for r in manifest.files}),
        )

    def _add(self, path: str | None, reason: str) -> None:
        with self._lock:
            self._findings[(path, reason)] = None

    def _check_identity(self) -> None:
        if self._manifest.step != self._step:
            self._add(None, f"the manifest says step {self._manifest.step}")
        name = (self._info.manifest_key or "").rpartition("/")[2]
        _, incarnation = parse_manifest_name(name)
        if incarnation is not None and self._manifest.incarnation != incarnation:
            self._add(name, f"says incarnation {self._manifest.incarnation}, its name {incarnation}")

    def _check_presence(self) -> dict[FileRecord, int]:
        """Every listed file's size as stored; the ones not stored are reported."""
        listed = step_objects(self._storage, self._step, self._manifest)
        sizes = {o.key: o.size_bytes for o in listed}
        present = {}
        for record in self._manifest.files:
            size = sizes.get(file_key(self._step, record, self._manifest))
            if size is None:
                self._add(record.path, f"missing (the manifest records {record.size_bytes} bytes)")
                continue
            if size != record.size_bytes:
                self._add(record.path, f"has {size} bytes, manifest recorded {record.size_bytes}")
            present[record] = size
        return present

    def _load_index(self, record: FileRecord) -> RankIndex | None:
        """A rank's index, verified against the manifest (:func:`~spotrun.checkpoint.step_checks.parse_index`,
        as a restore does); ``None`` (reported) when it is not right."""
        if record.size_bytes > INDEX_MAX_BYTES:  # not read
            self._add(record.path, f"{record.size_bytes} bytes, more than the {INDEX_MAX_BYTES} a rank index may have")
            return None
        try:
            data = self._storage.get(file_key(self._step, record, self._manifest))
        except ObjectNotFoundError:
            self._add(record.path, "missing (deleted while verifying)")
            return None
        self._on_bytes(len(data))
        if len(data) != record.size_bytes:
            return None  # reported by its size
        try:
            return parse_index(data, record, self._manifest)
        except CorruptShardError as exc:
            self._add(record.path, str(exc))
            return None

    def _header(self, record: FileRecord, size_bytes: int) -> ShardHeader | None:
        if size_bytes < 8 and size_bytes != record.size_bytes:
            return None  # reported by its size
        try:
            header = read_header(
                self._storage, file_key(self._step, record, self._manifest), size_bytes, record.size_bytes
            )
        except CorruptShardError as exc:
            self._add(record.path, str(exc))
            return None
        except ObjectNotFoundError:
            self._add(record.path, "missing (deleted while verifying)")
            return None
        for problem in header.problems:
            self._add(record.path, problem)
        return header

    def _block_digests(self, indexes: dict[int, tuple[str, RankIndex | None]]) -> dict[str, IndexedFile]:
        """Data file path -> its entry in its writer's index, where that agrees with the manifest."""
        found = {}
        for index_path, index in indexes.values():
            if index is None:
                continue
            problems = block_problems(index, self._manifest)
            for item in index.files:
                if item.path in problems:
                    self._add(index_path, problems[item.path])
                else:
                    found[item.path] = item
        return found

    def _submit_digest(
        self, pool: ThreadPoolExecutor, record: FileRecord, indexed: IndexedFile | None
    ) -> Callable[[], None]:
        """Queue the reads that hash ``record``'s file; returns the function that waits for them
        and reports a mismatch."""
        key = file_key(self._step, record, self._manifest)
        size = record.size_bytes
        if record.algorithm == WHOLE_SHA256:
            whole = pool.submit(self._sha256_of_file, key, size)

            def finish_whole() -> None:
                if self._settled([whole], record.path) and whole.result() != record.digest:
                    self._add(record.path, f"digest mismatch ({record.algorithm})")

            return finish_whole

        chunk_bytes = record.chunk_bytes or size
        digests = ChunkDigests(size, chunk_bytes, record.algorithm)
        unit = chunk_bytes * max(1, READ_UNIT_BYTES // chunk_bytes)
        reads = [
            pool.submit(self._read, key, start, stop, digests.add_span) for start, stop in chunk_ranges(size, unit)
        ]

        def finish_chunked() -> None:
            if not self._settled(reads, record.path) or digests.hexdigest() == record.digest:
                return
            expected = indexed.block_digests if indexed is not None else []
            bad = [i for i, (a, b) in enumerate(zip(digests.chunk_hexdigests(), expected)) if a != b]
            if not bad:
                self._add(record.path, f"digest mismatch ({record.algorithm})")
            for first, last in _runs(bad):
                self._add(
                    record.path,
                    f"digest mismatch in bytes {first * chunk_bytes}-"
                    f"{min((last + 1) * chunk_bytes, size)} ({record.algorithm})",
                )

        return finish_chunked

    def _settled(self, futures: list[Future], path: str) -> bool:
        """Wait for ``futures``; ``False`` (reported) when the file vanished or shrank meanwhile."""
        whole = True
        for future in futures:
            try:
                future.result()
            except ObjectNotFoundError:
                self._add(path, "missing (deleted while verifying)")
                whole = False
            except ObjectTooShortError:
                self._add(path, "shorter than the manifest records (truncated while verifying)")
                whole = False
        return whole

    def _buffer(self, nbytes: int) -> memoryview:
        """This thread's read buffer (reused: a fresh one costs a page fault per 4 KiB)."""
        buffer = getattr(self._buffers, "data", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = self._buffers.data = bytearray(nbytes)
        return memoryview(buffer)[:nbytes]

    def _read(self, key: str, start: int, stop: int, consume: Callable[[int, memoryview], None]) -> None:
        view = self._buffer(stop - start)
        self._storage.read_into(key, start, [view])
        consume(start, view)
        self._on_bytes(stop - start)

    def _sha256_of_file(self, key: str, size_bytes: int) -> str:
        digest = hashlib.sha256()  # formats 1-2: one hash over the whole file, so read in order
        for start, stop in chunk_ranges(size_bytes, READ_UNIT_BYTES):
            self._read(key, start, stop, lambda _offset, view: digest.update(view))
        return digest.hexdigest()


def _is_index(record: FileRecord) -> bool:
    return record.path.endswith(".index.json")


def _runs(numbers: list[int]) -> list[tuple[int, int]]:
    """``[1, 2, 3, 7]`` -> ``[(1, 3), (7, 7)]`` (sorted input)."""
    runs: list[tuple[int, int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n - 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    return runs
