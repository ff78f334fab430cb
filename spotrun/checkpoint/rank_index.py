"""The index each rank writes next to its shard files (format 4).

One small JSON object per rank and step (``rank-RRRRR.i<incarnation>.index.json``, listed in
the manifest with its digest like any file) says where each chunk lies in the rank's files and
holds the BLAKE3 digest of every block, so the manifest stays small however many chunks a job
writes and a reader can verify part of a file. The format: ``docs/design/internals.md``
(Checkpoint engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import blake3

from spotrun.checkpoint import strict_json
from spotrun.checkpoint.manifest import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from spotrun.errors import CorruptShardError

INDEX_FORMAT = "spotrun-rank-index"


def chunk_key(
    name: str,
    offsets: tuple[int, ...] | list[int],
    lengths: tuple[int, ...] | list[int],
    shape: tuple[int, ...] | list[int],
) -> str:
    """The key of a chunk: ``name`` for a whole tensor, else ``name@o0,o1,...``."""
    if all(o == 0 for o in offsets) and tuple(lengths) == tuple(shape):
        return name
    return f"{name}@{','.join(str(o) for o in offsets)}"


@dataclass(frozen=True)
class IndexedFile:
    """One shard file of a rank: path (relative to the step), size, and block digests (hex)."""

    path: str
    size_bytes: int
    block_bytes: int
    block_digests: list[str]


@dataclass(frozen=True)
class RankIndex:
    """A parsed rank index (see the module docstring)."""

    step: int
    rank: int
    files: list[IndexedFile]
    chunks: dict[str, tuple[int, int, int]]

    def to_json(self) -> bytes:
        doc = {
            "format": INDEX_FORMAT,
            "format_version": 4,
            "step": self.step,
            "rank": self.rank,
            "files": [vars(f) for f in self.files],
            "chunks": {k: list(v) for k, v in self.chunks.items()},
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> RankIndex:
        """Parse and check an index (its bytes already verified against the manifest).

        Raises:
            CorruptShardError: malformed, over a limit (:mod:`spotrun.checkpoint.strict_json`),
                or a chunk outside its file.
        """
        try:
            doc = strict_json.loads(data, max_bytes=strict_json.INDEX_MAX_BYTES, what="rank index")
            if doc.get("format") != INDEX_FORMAT:
                raise ValueError("not a spotrun rank index")
            files = []
            for raw in doc["files"]:
                item = IndexedFile(
                    path=str(raw["path"]),
                    size_bytes=int(raw["size_bytes"]),
                    block_bytes=int(raw["block_bytes"]),
                    block_digests=list(raw["block_digests"]),
                )
                if not MIN_CHUNK_BYTES <= item.block_bytes <= MAX_CHUNK_BYTES:
                    raise ValueError(
                        f"file {item.path!r}: blocks of {item.block_bytes} bytes, not "
                        f"{MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES}"
                    )
                if len(item.block_digests) != -(-item.size_bytes // item.block_bytes):
                    raise ValueError(
                        f"file {item.path!r}: {len(item.block_digests)} block digests for "
                        f"{item.size_bytes} bytes in blocks of {item.block_bytes}"
                    )
                files.append(item)
            chunks = {}
            for key, (index, begin, end) in doc["chunks"].items():
                if not (
                    type(index) is int
                    and 0 <= index < len(files)
                    and type(begin) is int
                    and type(end) is int
                    and 0 <= begin <= end <= files[index].size_bytes
                ):
                    raise ValueError(f"chunk {key!r} lies outside its file")
                chunks[key] = (index, begin, end)
            return cls(step=int(doc["step"]), rank=int(doc["rank"]), files=files, chunks=chunks)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptShardError(f"{where}: malformed rank index: {exc}") from exc

    def check_against(self, digests: dict[str, str], where: str) -> None:
        """Check every file's block digests against the manifest's file digest
        (``path -> digest``: BLAKE3 of the concatenated block digests).

        Raises:
            CorruptShardError: a file the manifest does not list, or digests that disagree.
        """
        for item in self.files:
            expected = digests.get(item.path)
            if expected is None:
                raise CorruptShardError(f"{where}: lists {item.path!r}, which the manifest does not")
            actual = blake3.blake3(b"".join(bytes.fromhex(d) for d in item.block_digests)).hexdigest()
            if actual != expected:
                raise CorruptShardError(f"{where}: block digests of {item.path!r} do not match the manifest")
