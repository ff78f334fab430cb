"""Checks of a committed step's own consistency that ``spotrun verify`` and a restore share:
a writer's index against the manifest, and the state skeletons against the tensor records.

A checkpoint is input from outside the process (another job, a half-broken disk, a bucket
someone else can write to), and digests only say that the bytes are the ones the manifest
records, not that the manifest, the indexes and the files describe one state. These checks do
(with the header and chunk checks of :mod:`spotrun.checkpoint.verify_tensors`): a step that
fails them is corrupt, on either path, before a byte of it reaches a live tensor. A step that
passes them is self-consistent: if it then does not fit the job's objects, the job's code
differs (:class:`~spotrun.errors.StateMismatchError`), not the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from spotrun.checkpoint.manifest import FileRecord, Manifest
from spotrun.checkpoint.rank_index import RankIndex
from spotrun.checkpoint.shard import sha256_hex
from spotrun.checkpoint.stream import WHOLE_SHA256, ChunkDigests
from spotrun.errors import CorruptShardError

_TAGS = ("__tensor__", "__tuple__", "__dict__", "__float__")


def digest_of(data: bytes, record: FileRecord) -> str:
    """The digest of a small file held in memory, by its record's algorithm."""
    if record.algorithm == WHOLE_SHA256:
        return sha256_hex(data)
    digests = ChunkDigests(len(data), record.chunk_bytes or max(1, len(data)), record.algorithm)
    digests.add_span(0, memoryview(data))
    return digests.hexdigest()


def parse_index(data: bytes, record: FileRecord, manifest: Manifest) -> RankIndex:
    """A writer's index file as read (``data``), checked against the manifest: the size and
    digest ``record`` records, well formed (:meth:`RankIndex.from_json`), the block digests of
    each of its files adding up to that file's digest in the manifest, and the index of
    ``record.rank`` at the manifest's step.

    Raises:
        CorruptShardError: the reason, without the file's name.
    """
    if len(data) != record.size_bytes:
        raise CorruptShardError(f"has {len(data)} bytes, manifest recorded {record.size_bytes}")
    if digest_of(data, record) != record.digest:
        raise CorruptShardError(f"digest mismatch ({record.algorithm})")
    try:
        index = RankIndex.from_json(data, where=record.path)
        index.check_against({f.path: f.digest for f in manifest.files if f.rank == record.rank}, record.path)
    except CorruptShardError as exc:
        raise CorruptShardError(str(exc).removeprefix(f"{record.path}: ")) from exc
    if (index.step, index.rank) != (manifest.step, record.rank):
        raise CorruptShardError(f"is the index of rank {index.rank} at step {index.step}")
    return index


def block_problems(index: RankIndex, manifest: Manifest) -> dict[str, str]:
    """Data file path -> why ``index`` records it otherwise than the manifest does (its size,
    or a block size other than the manifest's chunk size: the block digests would then be
    of other byte ranges than a reader hashes), for each file where they disagree."""
    records = {r.path: r for r in manifest.files}
    found = {}
    for item in index.files:
        record = records.get(item.path)
        if record is None:
            found[item.path] = f"records {item.path}, which the manifest does not list"
        elif (item.size_bytes, item.block_bytes) != (record.size_bytes, record.chunk_bytes):
            found[item.path] = (
                f"records {item.path} as {item.size_bytes} bytes in blocks of {item.block_bytes}; "
                f"the manifest records {record.size_bytes} bytes in chunks of {record.chunk_bytes}"
            )
    return found


def skeleton_problems(manifest: Manifest) -> Iterator[str]:
    """Why the state skeletons and the tensor records do not describe one state: a tensor
    reference that is not named after its place in the state (a save names every tensor by
    its path: ``model/layer.weight``), a tensor referred to twice, a reference to a tensor
    the manifest has no record or alias of, a record no state refers to."""
    refs: list[str] = []
    misplaced: list[str] = []
    for name, skeleton in manifest.state.items():
        _walk(skeleton, name, refs, misplaced)
    for rank, skeletons in enumerate(manifest.rank_state):
        for name, skeleton in skeletons.items():
            _walk(skeleton, f"rank-{rank:05d}/{name}", refs, misplaced)
    yield from misplaced[:1]
    seen: set[str] = set()
    for ref in refs:
        if ref in seen:
            yield f"the state refers to tensor {ref} twice"
            return
        seen.add(ref)
    known = set(manifest.tensors) | set(manifest.aliases)
    unknown = sorted(seen - known)
    if unknown:
        yield f"the state refers to tensor {unknown[0]}, which the manifest has no record of"
    unused = sorted(known - seen)
    if unused:
        yield f"tensor {unused[0]} is part of no state"


def _walk(node: Any, path: str, refs: list[str], misplaced: list[str]) -> None:
    """Collect the tensor references under ``node`` (at ``path``), as the save's encoder
    (:func:`spotrun.checkpoint.tree.encode`) named them; a malformed node is left to the decoder.
    Iterative: a skeleton nested deeper than Python's recursion limit is not a crash."""
    stack = [(node, path)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if len(node) == 1 and next(iter(node)) in _TAGS:
            ((tag, body),) = node.items()
            if tag == "__tensor__":
                refs.append(body if isinstance(body, str) else repr(body))
                if body != path and not misplaced:
                    misplaced.append(f"the state holds tensor {body!r} at {path}")
            elif tag in ("__tuple__",) and isinstance(body, list):
                stack.extend((v, f"{path}/{i}") for i, v in enumerate(body))
            elif tag == "__dict__" and isinstance(body, list):
                stack.extend((p[1], f"{path}/{p[0]}") for p in body if isinstance(p, list) and len(p) == 2)
            continue
        stack.extend((v, f"{path}/{k}") for k, v in node.items())
