"""Reading a committed step's tensors into where they go, every byte verified: the live tensors
that fit (:mod:`spotrun.checkpoint.reader`), a DTensor's own box (format 4: only the byte ranges
it needs, :mod:`spotrun.checkpoint.chunk_reader`), or new tensors; for :mod:`.restore` and tools.
At a restore on several ranks, what several of them need is read by one and sent to the others
(:func:`fetch_shared`, :mod:`spotrun.checkpoint.cooperative`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spotrun.checkpoint.chunk_reader import BoxRead, ChunkReader, dtype_of
from spotrun.checkpoint.chunks import Box
from spotrun.checkpoint.cooperative import HeldBack, Peers, share
from spotrun.checkpoint.dtypes import from_stored
from spotrun.checkpoint.layout import file_key
from spotrun.checkpoint.manifest import Manifest, TensorRecord
from spotrun.checkpoint.reader import fits, read_shard_into
from spotrun.checkpoint.shard import decode_shard
from spotrun.checkpoint.sharded import is_dtensor, local_box
from spotrun.checkpoint.share_plan import Need, pieces_of, plan_from_digests, segments, shared_anywhere
from spotrun.checkpoint.stream import byte_view
from spotrun.errors import CorruptShardError, StateMismatchError
from spotrun.storage.base import Storage


def read_whole_tensors(
    storage: Storage, manifest: Manifest, names: list[str], reader: ChunkReader | None = None
) -> dict[str, torch.Tensor]:
    """Whole tensors of a committed step by manifest name (``model/layer.weight``; aliases
    resolved), each a new contiguous CPU tensor of its recorded dtype and global shape, every
    byte read verified (for tools such as ``spotrun export``).

    Format 4 reads each tensor's chunks from whichever ranks wrote them (``reader``: one
    :class:`ChunkReader` of the step to reuse, so each index file is read once); formats 1-3
    read the files that hold the tensors.

    Raises:
        CorruptShardError: a name the manifest lacks, a checksum or size that differs, a
            dtype this torch cannot decode.
        StorageError: a read failed.
    """
    if manifest.format_version >= 4:
        return fetch_chunked(reader or ChunkReader(storage, manifest), manifest, names, {})
    return fetch_tensors(storage, manifest, names, {})


def fetch_tensors(
    storage: Storage, manifest: Manifest, names: list[str], destinations: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
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
        key = file_key(manifest.step, records[path], manifest)
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


def into_dtensors(tensors: dict[str, torch.Tensor], destinations: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors read from a format 1-3 step, each DTensor destination given its box."""
    result = dict(tensors)
    for name, tensor in tensors.items():
        dest = destinations.get(name)
        if is_dtensor(dest):
            _check_shape(name, list(tensor.shape), dest)
            offsets, lengths = local_box(dest)
            dest.to_local().copy_(tensor[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))])
            result[name] = dest
    return result


def _check_shape(name: str, saved_shape: list[int], dest: torch.Tensor) -> None:
    if list(dest.shape) != saved_shape:
        raise StateMismatchError(
            f"tensor {name!r} has shape {saved_shape} in the checkpoint and {list(dest.shape)} here"
        )


def fetch_chunked(
    reader: ChunkReader, manifest: Manifest, names: list[str], destinations: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Format 4: every needed tensor's box, read into its destination where it fits.

    Everything the reads rely on is checked first (:meth:`ChunkReader.check`), before anything
    is allocated by the manifest's shapes or compared with the live tensors: a step that
    disagrees with its own files is corrupt, and only a self-consistent one can be a
    :class:`StateMismatchError` (a tensor of another shape here: another model). A DTensor of
    another global shape has every chunk of the tensor checked, not its box alone.
    """
    reader.check([(target, record, box) for target, record, box, _reshaped in _boxes(manifest, names, destinations)])
    prepared = _prepare(manifest, names, destinations)
    reader.read(prepared.reads)
    return prepared.finish()


def _boxes(
    manifest: Manifest, names: list[str], destinations: dict[str, torch.Tensor]
) -> list[tuple[str, TensorRecord, Box, bool]]:
    """Each needed tensor's box to check (name, record, box, whether the destination is a DTensor
    of another global shape: then the whole tensor)."""
    boxes = []
    for name in names:
        target = manifest.aliases.get(name, name)
        record = manifest.tensors.get(target)
        if record is None or record.chunks is None:
            raise CorruptShardError(f"step {manifest.step}: manifest lists no chunks of tensor {target!r}")
        dest = destinations.get(name, destinations.get(target))
        reshaped = is_dtensor(dest) and list(dest.shape) != record.shape
        whole = ((0,) * len(record.shape), tuple(record.shape))
        boxes.append((target, record, local_box(dest) if is_dtensor(dest) and not reshaped else whole, reshaped))
    return boxes


@dataclass
class _Prepared:
    """The boxes to read (one per tensor), the copies once they are read (into destinations of
    another dtype or device), and what each name then holds."""

    reads: list[BoxRead]
    copies: list[tuple[torch.Tensor, torch.Tensor]]
    loaded: dict[str, torch.Tensor]

    def finish(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for dest, into in self.copies:
                dest.copy_(into)
        return self.loaded


def _prepare(manifest: Manifest, names: list[str], destinations: dict[str, torch.Tensor]) -> _Prepared:
    """Where each box is read into (see :func:`fetch_chunked`).

    Raises:
        StateMismatchError: a DTensor of another global shape than the saved tensor's.
    """
    reads: list[BoxRead] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, what was read for it)
    loaded: dict[str, torch.Tensor] = {}
    for name in names:
        target = manifest.aliases.get(name, name)
        if target in loaded:
            loaded[name] = loaded[target]
            continue
        record = manifest.tensors.get(target)
        if record is None or record.chunks is None:
            raise CorruptShardError(f"step {manifest.step}: manifest lists no chunks of tensor {target!r}")
        dtype = dtype_of(record, f"step {manifest.step}: tensor {target!r}")
        dest = destinations.get(name, destinations.get(target))
        if is_dtensor(dest):
            _check_shape(target, record.shape, dest)
            box = local_box(dest)
            local = dest.to_local()
            if fits(local, dtype, list(box[1])):
                into = local.detach()
            else:  # another dtype or device: read, then copy (cast) into it
                into = torch.empty(box[1], dtype=dtype)
                copies.append((local, into))
            result = dest
        else:
            box = ((0,) * len(record.shape), tuple(record.shape))
            if dest is not None and fits(dest, dtype, record.shape):
                into, result = dest.detach(), dest
            else:  # load_state_dict copies (casts) it into the object
                into = result = _allocate(manifest, record.shape, dtype, target)
        reads.append(BoxRead(target, record, box, into))
        loaded[target] = loaded[name] = result
    return _Prepared(reads, copies, loaded)


def fetch_shared(
    reader: ChunkReader,
    manifest: Manifest,
    names: list[str],
    destinations: dict[str, torch.Tensor],
    peers: Peers,
) -> tuple[dict[str, torch.Tensor], int]:
    """:func:`fetch_chunked` on every rank together: boxes that several ranks need are read by
    one of them and sent to the others (:mod:`spotrun.checkpoint.cooperative`); the tensors and
    the bytes this rank received. Collective: every rank calls it for the same step.

    A rank that cannot plan its reads, or read and verify its share, makes every rank stop
    before anything is sent: it raises its own error, the others :class:`HeldBack`.

    Raises:
        HeldBack: another rank failed.
        PeerError: a transfer failed.
        Whatever :func:`fetch_chunked` raises.
    """
    try:
        # what a DTensor of another global shape relies on is checked before it is refused
        boxes = _boxes(manifest, names, destinations)
        reader.check([(target, record, box) for target, record, box, reshaped in boxes if reshaped])
        prepared = _prepare(manifest, names, destinations)
        by_need = {
            Need(r.name, tuple(r.box[0]), tuple(r.box[1]), r.into.numel() * r.into.element_size()): r
            for r in prepared.reads
        }
        mine = segments(by_need, manifest)
    except Exception:
        peers.gather_json(None)  # the others learn that this rank stops
        raise
    digests_by_rank = peers.gather_json(list(mine))
    if any(d is None for d in digests_by_rank):
        raise HeldBack("another rank could not plan its reads")
    if not shared_anywhere(digests_by_rank):  # nobody shares: each reads what it needs, as without peers
        reader.read(prepared.reads)
        return prepared.finish(), 0
    plan = plan_from_digests(digests_by_rank, mine, manifest)
    groups = plan.groups_of(peers.rank)
    parts = _parts(by_need, [part for group in groups for part in group.needs], manifest)
    try:
        reader.read([parts[need] if need in parts else by_need[need] for need in plan.reads(peers.rank)])
    except Exception:
        peers.gather_json(False)
        raise
    if not all(peers.gather_json(True)):
        raise HeldBack("another rank could not read its share")
    received = share(peers, groups, {need: read.into for need, read in {**by_need, **parts}.items()})
    return prepared.finish(), received


def _parts(by_need: dict[Need, BoxRead], parts: list[Need], manifest: Manifest) -> dict[Need, BoxRead]:
    """The reads of the pieces of this rank's needs that the plan shares (:func:`pieces_of`),
    each into its bytes of the need's tensor (one contiguous range)."""
    wanted = set(parts)
    found = {}
    for need, read in by_need.items():
        for part, offset in pieces_of(need, manifest):
            if part in wanted and part != need:
                view = byte_view(read.into)[offset : offset + part.nbytes]
                found[part] = BoxRead(need.name, read.record, part.box, view.view(read.into.dtype).view(part.lengths))
    return found


def _allocate(manifest: Manifest, shape: list[int], dtype: torch.dtype, name: str) -> torch.Tensor:
    """A new tensor of a shape the manifest gives, once the step's data files (their sizes as
    stored: the catalog checked them) are shown to hold that many bytes.

    Raises:
        CorruptShardError: they do not.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > manifest.data_bytes:
        raise CorruptShardError(
            f"step {manifest.step}: tensor {name!r} of {nbytes} bytes is larger than the "
            f"{manifest.data_bytes} bytes of the step's data files"
        )
    return torch.empty(shape, dtype=dtype)


def _checked(content: dict[str, torch.Tensor], name: str, manifest: Manifest, key: str) -> torch.Tensor:
    if name not in content:
        raise CorruptShardError(f"{key}: tensor {name!r} is missing")
    tensor = from_stored(content[name], manifest.tensors[name], where=f"{key}: tensor {name!r}")
    # The parser's tensors are views into its read buffers (16-byte aligned, at offsets that
    # depend on the heap). An optimizer keeps what it is given, so a copy in torch's own
    # allocation (64-byte aligned, own storage) makes restored state lie in memory like the
    # state of an uninterrupted run, whatever a kernel's vector loop makes of alignment.
    return tensor.clone(memory_format=torch.contiguous_format)
