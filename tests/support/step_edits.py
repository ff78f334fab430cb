"""Editing a committed step's files on a local root as someone who can write there would, and
recomputing every digest the way spotrun records it, so that the edit passes the digest checks
and reaches the validation behind them (issue 21)."""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Callable

from spotrun.checkpoint.stream import CHUNKED_BLAKE3, ChunkDigests


def step_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / f"step-{step:09d}"


def manifest_file(root: pathlib.Path, step: int) -> pathlib.Path:
    """The step's manifest (one incarnation wrote it), whatever the catalog now thinks of it."""
    [path] = step_dir(root, step).glob("manifest.*.json")
    return path


def redigest(root: pathlib.Path, step: int) -> None:
    """Recompute every digest of ``step`` from its files as they are now: each data file's block
    digests (BLAKE3 of each of its index's ``block_bytes`` blocks) and size in its writer's
    index, its digest (BLAKE3 of the block digests) and size in the manifest, and each index
    file's SHA-256 and size in the manifest."""
    path = manifest_file(root, step)
    doc = json.loads(path.read_text())
    records = {f["path"]: f for f in doc["files"]}
    for index_file in sorted(step_dir(root, step).glob("rank-*.index.json")):
        index = json.loads(index_file.read_text())
        for item in index["files"]:
            data = (step_dir(root, step) / item["path"]).read_bytes()
            digests = ChunkDigests(len(data), item["block_bytes"], CHUNKED_BLAKE3)
            digests.add_span(0, memoryview(data))
            item["size_bytes"], item["block_digests"] = len(data), digests.chunk_hexdigests()
            records[item["path"]].update(size_bytes=len(data), digest=digests.hexdigest())
        raw = json.dumps(index, separators=(",", ":")).encode()
        index_file.write_bytes(raw)
        records[index_file.name].update(size_bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    path.write_text(json.dumps(doc))


def edit_manifest(root: pathlib.Path, step: int, edit: Callable[[dict], None]) -> None:
    path = manifest_file(root, step)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def index_path(root: pathlib.Path, step: int, rank: int) -> pathlib.Path:
    return next(step_dir(root, step).glob(f"rank-{rank:05d}.*.index.json"))


def edit_index(root: pathlib.Path, step: int, rank: int, edit: Callable[[dict], None]) -> None:
    path = index_path(root, step, rank)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, separators=(",", ":")))


def data_path(root: pathlib.Path, step: int, rank: int) -> pathlib.Path:
    return next(step_dir(root, step).glob(f"rank-{rank:05d}.*.safetensors"))


def edit_header(root: pathlib.Path, step: int, rank: int, edit: Callable[[dict], None]) -> None:
    """Edit the JSON header of ``rank``'s data file in place (padded with spaces to its length,
    as safetensors allows, so that no byte of data moves)."""
    path = data_path(root, step, rank)
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= length
    path.write_bytes(data[:8] + raw.ljust(length, b" ") + data[8 + length :])


def edit_chunk_bytes(root: pathlib.Path, step: int, rank: int, key: str, edit: Callable[[bytearray], None]) -> None:
    """Edit the bytes of chunk ``key`` where ``rank``'s index says they lie."""
    _, begin, end = json.loads(index_path(root, step, rank).read_text())["chunks"][key]
    path = data_path(root, step, rank)
    data = bytearray(path.read_bytes())
    chunk = data[begin:end]
    edit(chunk)
    data[begin:end] = chunk
    path.write_bytes(bytes(data))
