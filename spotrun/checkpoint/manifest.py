"""The checkpoint manifest: versioned JSON, written last, whose presence commits a step.

Builds, writes and parses formats 4 (sharded tensors as chunk layouts) and 5 (the same, each
rank's files under a key prefix of their own: ``key_layout``) and reads formats 1 to 3.
The format specification, every field and what changed in each version:
docs/reference/checkpoint-format.md.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from spotrun.checkpoint import strict_json
from spotrun.checkpoint.chunks import ChunkLayout, brief
from spotrun.checkpoint.key_layout import SPREAD_LAYOUT_FORMAT_VERSION, SpreadLayout, parse_key_layout
from spotrun.errors import ManifestError

FORMAT_NAME = "spotrun-checkpoint"
#: The newest format this spotrun reads and writes.
FORMAT_VERSION = 5
#: The format of a step whose files all lie in its step directory (no ``key_layout``).
STEP_LAYOUT_FORMAT_VERSION = 4
MANIFEST_NAME = "manifest.json"
#: ``TensorRecord.stored_as`` of a tensor kept as its raw bytes (a 1-D uint8 tensor).
STORED_AS_BYTES = "bytes"
#: How the name of a rank index file (format 4) ends; every other file holds tensor data.
INDEX_SUFFIX = ".index.json"
#: Smallest and largest checksum chunk a manifest (or a rank index, its blocks) may record:
#: writers use 1 MiB and 8 MiB; a reader keeps a digest per chunk (a tiny chunk: a digest per
#: byte or so) and holds up to a chunk per read thread (a huge one: the whole file at once).
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 64 * 2**20
#: Largest size of one dimension: torch's (a signed 64-bit integer).
MAX_DIM = 2**63 - 1
#: Fewest bytes of a chunk's entry in a rank index (``"k":[0,0,0],``): a grid cell that holds
#: elements is an entry in its writer's index, which bounds how many cells a grid may have.
MIN_INDEX_ENTRY_BYTES = 12


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint step.

    Attributes:
        path: path relative to the step directory.
        rank: the rank that wrote it.
        size_bytes: exact size in bytes.
        digest: hex checksum of the file, by ``algorithm``.
        algorithm: ``"sha256"`` (SHA-256 of the whole file; formats 1 and 2) or, since
            format 3, ``"blake3-chunks"`` (written) or ``"sha256-chunks"``: the hash of the
            concatenated hashes of the file's consecutive ``chunk_bytes`` chunks
            (:mod:`spotrun.checkpoint.stream`).
        chunk_bytes: the chunk size of a chunked algorithm, ``None`` for ``"sha256"``.
    """

    path: str
    rank: int
    size_bytes: int
    digest: str
    algorithm: str = "sha256"
    chunk_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object (format 1/2 spelling for ``"sha256"``)."""
        if self.algorithm == "sha256":
            return {"path": self.path, "rank": self.rank, "size_bytes": self.size_bytes, "sha256": self.digest}
        return {
            "path": self.path,
            "rank": self.rank,
            "size_bytes": self.size_bytes,
            "algorithm": self.algorithm,
            "chunk_bytes": self.chunk_bytes,
            "digest": self.digest,
        }


#: Checksum algorithms a reader verifies.
CHECKSUM_ALGORITHMS = frozenset({"sha256", "sha256-chunks", "blake3-chunks"})


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives.

    Attributes:
        file: the :class:`FileRecord` path holding it (formats 1-3); ``None`` in format 4.
        dtype: torch dtype name without ``torch.`` (``"float32"``).
        shape: global shape.
        offsets: formats 1-3: always ``None`` (the whole tensor).
        stored_as: ``None`` when the file holds the tensor under its own dtype,
            :data:`STORED_AS_BYTES` when it holds its bytes (a 1-D uint8 tensor).
        chunks: format 4: the tensor's chunks and the rank that wrote each
            (:class:`~spotrun.checkpoint.chunks.ChunkLayout`); each writer's index file says
            where in its files they lie.
    """

    file: str | None
    dtype: str
    shape: list[int]
    offsets: list[int] | None = None
    stored_as: str | None = None
    chunks: ChunkLayout | None = None


@dataclass(frozen=True)
class SaveTiming:
    """How long a save took, recorded for estimating the next ones.

    Attributes:
        write_s: seconds the slowest rank took to stage and write its shard.
        step_time_s: seconds one training step took before the save (the slowest of the
            recent steps); ``None`` when unknown.
    """

    write_s: float
    step_time_s: float | None = None


@dataclass
class Manifest:
    """A parsed, validated manifest (see the module docstring for the JSON form)."""

    step: int
    world_size: int
    files: list[FileRecord]
    tensors: dict[str, TensorRecord]
    state: Any
    rank_state: list[Any]
    aliases: dict[str, str] = field(default_factory=dict)
    reason: str = "periodic"
    created_unix_s: float = 0.0
    run_id: str = ""
    incarnation: int = 0
    spotrun_version: str = ""
    torch_version: str = ""
    format_version: int = STEP_LAYOUT_FORMAT_VERSION
    timing: SaveTiming | None = None
    meshes: list[dict[str, Any]] = field(default_factory=list)
    key_layout: SpreadLayout | None = None

    @property
    def size_bytes(self) -> int:
        """Total bytes of all files (the manifest itself excluded)."""
        return sum(f.size_bytes for f in self.files)

    @functools.cached_property
    def data_bytes(self) -> int:
        """Total bytes of the files that hold tensors (rank indexes excluded): what any tensor
        read from this step may hold at most (the catalog checked these sizes against storage).
        Computed once: a restore asks for every tensor it allocates."""
        return sum(f.size_bytes for f in self.files if not f.path.endswith(INDEX_SUFFIX))

    def to_json(self) -> bytes:
        """Serialise to UTF-8 JSON on one line (strict: no NaN tokens).

        Built field by field and without indentation, so that json's C encoder does the
        work: a manifest of a million tensors takes seconds, not minutes.
        """
        doc = {"format": FORMAT_NAME}
        for item in fields(self):
            doc[item.name] = getattr(self, item.name)
        doc["files"] = [f.to_json() for f in self.files]
        doc["tensors"] = {name: _tensor_json(r) for name, r in self.tensors.items()}
        doc["timing"] = None if self.timing is None else vars(self.timing)
        if self.key_layout is None:  # format 4 and older: no such field
            del doc["key_layout"]
        elif self.format_version < SPREAD_LAYOUT_FORMAT_VERSION:  # would not parse back
            raise ValueError(f"a key_layout needs format_version {SPREAD_LAYOUT_FORMAT_VERSION}")
        else:
            doc["key_layout"] = self.key_layout.to_json()
        return json.dumps(doc, sort_keys=True, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate.

        Parsed within limits (:mod:`spotrun.checkpoint.strict_json`: size, nesting, no
        repeated key), and every shape and chunk grid bounded by the bytes of the step's files
        before anything is built from it.

        Raises:
            ManifestError: not JSON, over a limit, not a spotrun manifest, a newer format, a
                field of the wrong type, tensors larger than the files could hold; the message
                says which and where.
        """
        try:
            doc = strict_json.loads(data, max_bytes=strict_json.MANIFEST_MAX_BYTES, what="manifest")
        except strict_json.StrictJSONError as exc:
            raise ManifestError(f"{where} is refused: {exc}") from exc
        except ValueError as exc:  # UnicodeDecodeError, json.JSONDecodeError
            raise ManifestError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where} is not a spotrun checkpoint manifest")
        version = doc.get("format_version")
        if not isinstance(version, int) or version < 1:
            raise ManifestError(f"{where} has an invalid format_version {version!r}")
        if version > FORMAT_VERSION:
            raise ManifestError(
                f"{where} has format_version {version}; this spotrun reads up to "
                f"{FORMAT_VERSION}: upgrade spotrun to load it"
            )
        try:
            return _parse_v1(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where} is malformed: {exc!r}") from exc


def _tensor_json(record: TensorRecord) -> dict[str, Any]:
    if record.chunks is not None:
        doc = {"dtype": record.dtype, "shape": record.shape, **record.chunks.to_json()}
    else:
        doc = {"file": record.file, "dtype": record.dtype, "shape": record.shape, "offsets": record.offsets}
    if record.stored_as is not None:  # left out when null: a million records, 20 bytes each
        doc["stored_as"] = record.stored_as
    return doc


def _int(value: Any, name: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value


def _parse_v1(doc: dict[str, Any]) -> Manifest:
    world_size = _int(doc["world_size"], "world_size", 1)
    rank_state = doc["rank_state"]  # first: its length bounds world_size by the document's size
    if not isinstance(rank_state, list) or len(rank_state) != world_size:
        raise ValueError(f"rank_state must list {world_size} entries (one per rank)")
    files = []
    for raw in doc["files"]:
        path = _str(raw["path"], "files[].path")
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"file path {path!r} escapes the step directory")
        files.append(_file_record(raw, path))
    file_paths = {f.path for f in files}
    bounds = _Bounds(files, world_size, len(doc["tensors"]))
    tensors = {}
    for name, raw in doc["tensors"].items():
        tensors[name] = _tensor_record(name, raw, file_paths, bounds)
    aliases = {_str(k, "aliases key"): _str(v, "aliases value") for k, v in doc.get("aliases", {}).items()}
    for alias, target in aliases.items():
        if target not in tensors:
            raise ValueError(f"alias {alias!r} points at unknown tensor {target!r}")
    if not isinstance(doc["state"], dict) or not all(isinstance(r, dict) for r in rank_state):
        raise ValueError("state and every rank_state entry must be JSON objects")
    created = doc.get("created_unix_s", 0.0)
    if not isinstance(created, (int, float)) or not math.isfinite(created):
        raise ValueError(f"created_unix_s must be a number, got {created!r}")
    return Manifest(
        step=_int(doc["step"], "step"),
        world_size=world_size,
        files=files,
        tensors=tensors,
        state=doc["state"],
        rank_state=rank_state,
        aliases=aliases,
        reason=_str(doc.get("reason", "periodic"), "reason"),
        created_unix_s=float(created),
        run_id=_str(doc.get("run_id", ""), "run_id"),
        incarnation=_int(doc.get("incarnation", 0), "incarnation"),
        spotrun_version=_str(doc.get("spotrun_version", ""), "spotrun_version"),
        torch_version=_str(doc.get("torch_version", ""), "torch_version"),
        format_version=doc["format_version"],
        timing=_timing(doc.get("timing")),
        meshes=_meshes(doc.get("meshes", [])),
        key_layout=parse_key_layout(doc),
    )


def _meshes(raw: Any) -> list[dict[str, Any]]:
    """``meshes`` (format 4; absent before): the device meshes of the step's sharded tensors,
    each ``{"shape": [int, ...], "dim_names": [str, ...] | null}``."""
    if not isinstance(raw, list):
        raise ValueError(f"meshes must be a list, got {raw!r}")
    for mesh in raw:
        if (
            not isinstance(mesh, dict)
            or type(mesh.get("shape")) is not list
            or not all(type(d) is int and d >= 1 for d in mesh["shape"])
        ):
            raise ValueError(f"meshes[] must be objects with a shape of positive integers, got {mesh!r}")
        names = mesh.get("dim_names")
        if names is not None and not (type(names) is list and all(isinstance(n, str) for n in names)):
            raise ValueError(f"meshes[].dim_names must be null or a list of strings, got {names!r}")
    return raw


def _file_record(raw: dict[str, Any], path: str) -> FileRecord:
    rank, size_bytes = _int(raw["rank"], "files[].rank"), _int(raw["size_bytes"], "files[].size_bytes")
    if "sha256" in raw:  # formats 1 and 2
        return FileRecord(path=path, rank=rank, size_bytes=size_bytes, digest=_str(raw["sha256"], "files[].sha256"))
    algorithm = _str(raw["algorithm"], "files[].algorithm")
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise ValueError(
            f"file {path!r} has checksum algorithm {algorithm!r}; this spotrun knows {sorted(CHECKSUM_ALGORITHMS)}"
        )
    chunk_bytes = _int(raw["chunk_bytes"], "files[].chunk_bytes", MIN_CHUNK_BYTES) if algorithm != "sha256" else None
    if chunk_bytes is not None and chunk_bytes > MAX_CHUNK_BYTES:
        raise ValueError(f"files[].chunk_bytes must be at most {MAX_CHUNK_BYTES}, got {chunk_bytes}")
    return FileRecord(
        path=path,
        rank=rank,
        size_bytes=size_bytes,
        digest=_str(raw["digest"], "files[].digest"),
        algorithm=algorithm,
        chunk_bytes=chunk_bytes,
    )


class _Bounds:
    """What the files of a step can hold, to check each tensor record against before anything
    is sized from it: every element takes at least a byte of a data file (no dtype is
    smaller), and every grid cell either is one of at most ``world_size`` a tensor is cut into
    (DTensor placements over a mesh) or holds elements, and then has an entry in its writer's
    index."""

    def __init__(self, files: list[FileRecord], world_size: int, tensor_count: int) -> None:
        self.data_bytes = sum(f.size_bytes for f in files if not f.path.endswith(INDEX_SUFFIX))
        self.elements_left = self.data_bytes
        self.world_size = world_size
        self.indexed_cells = sum(f.size_bytes for f in files if f.path.endswith(INDEX_SUFFIX)) // MIN_INDEX_ENTRY_BYTES
        self.cells_left = tensor_count * world_size + self.indexed_cells

    def take(self, name: str, shape: list[int]) -> int:
        """Count ``shape``'s elements against the data files; the most grid cells it may have.

        Raises:
            ValueError: more elements than the files' bytes could hold.
        """
        elements = 0 if 0 in shape else 1
        for d in shape if elements else ():  # stops early: a hostile shape never builds a huge integer
            elements *= d
            if elements > self.elements_left:
                raise ValueError(
                    f"tensor {name!r} of shape {brief(shape)} holds more elements than the "
                    f"{self.data_bytes} bytes of the step's data files could hold"
                )
        self.elements_left -= elements
        return min(max(self.world_size, min(elements, self.indexed_cells)), self.cells_left)


def _tensor_record(name: str, raw: dict[str, Any], file_paths: set[str], bounds: _Bounds) -> TensorRecord:
    """One entry of ``tensors`` (checked without building a message per field: a manifest
    may list millions)."""
    if "file" not in raw:  # format 4: chunks
        dtype, shape = raw["dtype"], raw["shape"]
        if (
            type(dtype) is not str
            or type(shape) is not list
            or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
        ):
            raise ValueError(
                f"tensors[{name}] needs a dtype string and a shape of integers from 0 to {MAX_DIM}, got {brief(raw)}"
            )
        layout = ChunkLayout.from_json(shape, raw, max_cells=bounds.take(name, shape))
        if layout.grid is not None:
            bounds.cells_left -= math.prod(layout.grid)
        return TensorRecord(
            file=None, dtype=dtype, shape=shape, stored_as=_stored_as(raw.get("stored_as"), name), chunks=layout
        )
    file, dtype, shape, offsets = raw["file"], raw["dtype"], raw["shape"], raw.get("offsets")
    if type(file) is not str or type(dtype) is not str:
        raise ValueError(f"tensors[{name}].file and .dtype must be strings, got {brief(raw)}")
    if type(shape) is not list:
        raise ValueError(f"tensors[{name}].shape must list integers >= 0, got {brief(shape)}")
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            raise ValueError(f"tensors[{name}].shape must list integers from 0 to {MAX_DIM}, got {brief(shape)}")
    bounds.take(name, shape)
    if offsets is not None:
        offsets = [_int(o, f"tensors[{name}].offsets[]") for o in offsets]
    if file not in file_paths:
        raise ValueError(f"tensor {name!r} is in {file!r}, which is not among the files")
    return TensorRecord(
        file=file, dtype=dtype, shape=shape, offsets=offsets, stored_as=_stored_as(raw.get("stored_as"), name)
    )


def _stored_as(value: Any, name: str) -> str | None:
    if value is not None and value != STORED_AS_BYTES:
        raise ValueError(f"tensors[{name}].stored_as must be null or {STORED_AS_BYTES!r}, got {value!r}")
    return value


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _timing(raw: Any) -> SaveTiming | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"timing must be an object or null, got {raw!r}")
    step_time_s = raw.get("step_time_s")
    return SaveTiming(
        write_s=_seconds(raw["write_s"], "timing.write_s"),
        step_time_s=None if step_time_s is None else _seconds(step_time_s, "timing.step_time_s"),
    )
