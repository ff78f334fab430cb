"""The edits of the mutation campaign (tests/support/mutation_campaign.py; issue 21, item 5): a family of
changes to the newest step of a format-4 root - its manifest, a rank index, a safetensors
header, and links or a FIFO in place of its files - each applied with every digest recomputed
the way spotrun records it, so that the edit passes the digest checks and reaches the
validation behind them:

* a data file's blocks: BLAKE3 of each ``block_bytes`` block, in its writer's index
  (``block_digests``), and the BLAKE3 of their concatenation in the manifest (``digest``,
  ``size_bytes``; :class:`spotrun.checkpoint.stream.ChunkDigests`);
* a rank index: its SHA-256 and size in the manifest;
* the manifest: nothing (it is the root of the checks).

A header edit that changes the header's length moves the data: the index's chunk ranges move
with it, so only what the edit meant to change changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass

from spotrun.checkpoint.stream import CHUNKED_BLAKE3, ChunkDigests

#: The tensor most edits aim at: whole in a replicated save, in chunks on both ranks in FSDP2's.
TENSOR = "model/up.weight"
DEEP = 100_000  # nesting depth of the deep-JSON edits (Python's recursion limit is 1,000)


class NewestStep:
    """The newest step's files, edited in memory, written by :meth:`finish` with every digest
    recomputed (see the module docstring)."""

    def __init__(self, step_dir: pathlib.Path) -> None:
        self.dir = step_dir
        [self.manifest_path] = step_dir.glob("manifest.*.json")
        self.manifest = json.loads(self.manifest_path.read_bytes())
        self.manifest_raw: bytes | None = None  # written as is instead of ``manifest``
        self.indexes: dict[int, dict] = {}
        self.index_raw: dict[int, bytes] = {}
        self.headers: dict[int, dict] = {}
        self.header_raw: dict[int, bytes] = {}
        self.length_prefix: dict[int, bytes] = {}

    # --- the files -----------------------------------------------------------------------

    def record(self, suffix: str, rank: int) -> dict:
        return next(f for f in self.manifest["files"] if f["rank"] == rank and f["path"].endswith(suffix))

    def index(self, rank: int = 0) -> dict:
        if rank not in self.indexes:
            self.indexes[rank] = json.loads((self.dir / self.record(".index.json", rank)["path"]).read_bytes())
        return self.indexes[rank]

    def _data(self, rank: int) -> tuple[dict, bytes]:
        raw = (self.dir / self.record(".safetensors", rank)["path"]).read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        return json.loads(raw[8 : 8 + length]), raw[8 + length :]

    def header(self, rank: int = 0) -> dict:
        if rank not in self.headers:
            self.headers[rank] = self._data(rank)[0]
        return self.headers[rank]

    def tensor(self, name: str = TENSOR) -> dict:
        return self.manifest["tensors"][name]

    def chunk_keys(self, rank: int = 0, name: str = TENSOR) -> list[str]:
        """The keys of ``name``'s chunks in ``rank``'s index (and header)."""
        return [k for k in self.index(rank)["chunks"] if k == name or k.startswith(name + "@")]

    # --- writing -------------------------------------------------------------------------

    def finish(self) -> None:
        """Write what was edited: data files, then indexes, then the manifest, each digest
        recomputed over what was written."""
        for rank in sorted(set(self.headers) | set(self.header_raw) | set(self.length_prefix)):
            self._write_data(rank)
        for rank in sorted(set(self.indexes) | set(self.index_raw)):
            data = self.index_raw.get(rank)
            if data is None:
                data = json.dumps(self.indexes[rank], separators=(",", ":")).encode()
            record = self.record(".index.json", rank)
            (self.dir / record["path"]).write_bytes(data)
            record["size_bytes"], record["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        self.manifest_path.write_bytes(
            self.manifest_raw if self.manifest_raw is not None else json.dumps(self.manifest).encode()
        )

    def _write_data(self, rank: int) -> None:
        old_header, body = self._data(rank)
        text = self.header_raw.get(rank)
        if text is None:
            text = json.dumps(self.headers.get(rank, old_header), separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        old_start = (self.dir / self.record(".safetensors", rank)["path"]).stat().st_size - len(body)
        prefix = self.length_prefix.get(rank, struct.pack("<Q", len(text)))
        data = prefix + text + body
        record = self.record(".safetensors", rank)
        (self.dir / record["path"]).write_bytes(data)
        index = self.index(rank)
        entry = index["files"][0]
        shift = len(prefix) + len(text) - old_start
        if shift:  # the data moved: so do the chunk ranges
            index["chunks"] = {k: [v[0], v[1] + shift, v[2] + shift] for k, v in index["chunks"].items()}
        block = (
            entry["block_bytes"]
            if type(entry.get("block_bytes")) is int and entry["block_bytes"] > 0
            else record["chunk_bytes"]
        )
        digests = ChunkDigests(len(data), block, CHUNKED_BLAKE3)
        digests.add_span(0, memoryview(data))
        entry["size_bytes"], entry["block_digests"] = len(data), digests.chunk_hexdigests()
        record["size_bytes"], record["digest"] = len(data), digests.hexdigest()


@dataclass(frozen=True)
class Edit:
    """One edit: ``apply(step, outside)`` changes ``step`` (``outside``: a directory beside the
    root, for links to lead into). ``must_fall_back``: resuming the newest step's values is not
    acceptable either (a link or a repeated key: the checkpoint is not what a reader sees).
    ``self_consistent``: the edited step is a sound checkpoint of another job, which a restore
    refuses (``StateMismatchError``) rather than falling back from. ``rewrites``: the step's
    edited documents are written (with their digests) after ``apply``."""

    name: str
    apply: Callable[[NewestStep, pathlib.Path], None]
    must_fall_back: bool = False
    self_consistent: bool = False
    rewrites: bool = True  # False: the edit replaces files itself; nothing is written after it


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _manifest_text(step: NewestStep, key: str, value_text: str) -> None:
    """The manifest with ``key``'s value replaced by raw JSON text (numbers, nesting)."""
    doc = dict(step.manifest)
    doc[key] = "@@VALUE@@"
    step.manifest_raw = json.dumps(doc).replace('"@@VALUE@@"', value_text).encode()


def _repeat_key_in_manifest(step: NewestStep) -> None:
    """The tensor's record twice under one key: first a wrong shape, then the real record
    (json.loads keeps the last; another reader may keep the first)."""
    text = json.dumps(step.manifest)
    real = f'"{TENSOR}": ' + json.dumps(step.tensor())
    bogus = dict(step.tensor(), shape=[s + 1 for s in step.tensor()["shape"]])
    assert real in text
    step.manifest_raw = text.replace(real, f'"{TENSOR}": {json.dumps(bogus)}, {real}', 1).encode()


def _repeat_chunk_in_index(step: NewestStep) -> None:
    index = step.index(0)
    key = step.chunk_keys(0)[0]
    text = json.dumps(index, separators=(",", ":"))
    real = f'"{key}":' + json.dumps(index["chunks"][key], separators=(",", ":"))
    other = next(v for k, v in index["chunks"].items() if k != key)
    assert real in text
    step.index_raw[0] = text.replace(real, f'"{key}":{json.dumps(other)},{real}', 1).encode()


def _repeat_entry_in_header(step: NewestStep) -> None:
    header = step.header(0)
    key = step.chunk_keys(0)[0]
    text = json.dumps(header, separators=(",", ":"))
    real = f'"{key}":' + json.dumps(header[key], separators=(",", ":"))
    bogus = dict(header[key], dtype="I32")
    step.header_raw[0] = text.replace(real, f'"{key}":{json.dumps(bogus)},{real}', 1).encode()


def _header_entry(step: NewestStep, change: Callable[[dict], None], rank: int = 0) -> None:
    change(step.header(rank)[step.chunk_keys(rank)[0]])


def _swap_offsets(step: NewestStep) -> None:
    """Two equal-sized entries of the header trade their data_offsets (the index still says
    where each chunk is: the header and the index disagree)."""
    header = step.header(0)
    entries = [k for k in header if k != "__metadata__"]
    size = {k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in entries}
    a, b = next((a, b) for i, a in enumerate(entries) for b in entries[i + 1 :] if size[a] == size[b] and size[a])
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]


def _index_chunk(step: NewestStep, change: Callable[[list, dict], None], rank: int = 0) -> None:
    index = step.index(rank)
    change(index["chunks"][step.chunk_keys(rank)[0]], index)


def _overlap(step: NewestStep) -> None:
    """The tensor's chunk points at the bytes of the chunk before it (two chunks, one range)."""
    index = step.index(0)
    key = step.chunk_keys(0)[0]
    ranges = sorted(index["chunks"].values(), key=lambda v: v[1])
    mine = index["chunks"][key]
    previous = max((v for v in ranges if v[2] <= mine[1]), key=lambda v: v[1], default=None)
    if previous is not None:
        length = mine[2] - mine[1]
        index["chunks"][key] = [mine[0], previous[1], previous[1] + length]


def _block_size(step: NewestStep, block_bytes: int) -> None:
    """The index's block size changed, its block digests (and the manifest's file digest)
    recomputed for it: only the block size disagrees with the manifest's chunk_bytes."""
    step.index(0)["files"][0]["block_bytes"] = block_bytes
    step.header(0)  # the data file is rewritten (same bytes), its digests recomputed


def _link(step: NewestStep, outside: pathlib.Path, what: str) -> None:
    if what == "step directory":
        copy = outside / step.dir.name
        shutil.copytree(step.dir, copy, symlinks=True)
        shutil.rmtree(step.dir)
        step.dir.symlink_to(copy, target_is_directory=True)
        return
    path = {
        "data": step.dir / step.record(".safetensors", 0)["path"],
        "index": step.dir / step.record(".index.json", 0)["path"],
        "manifest": step.manifest_path,
    }[what]
    shutil.copy2(path, outside / path.name)
    path.unlink()
    path.symlink_to(outside / path.name)


def _fifo(step: NewestStep, outside: pathlib.Path, inside: bool) -> None:
    path = step.dir / step.record(".safetensors", 0)["path"]
    path.unlink()
    if inside:
        os.mkfifo(path)
    else:
        os.mkfifo(outside / "fifo")
        path.symlink_to(outside / "fifo")


def _m(change: Callable[[dict], None]) -> Callable[[NewestStep, pathlib.Path], None]:
    return lambda step, outside: change(step.manifest)


def _t(change: Callable[[dict], None]) -> Callable[[NewestStep, pathlib.Path], None]:
    return lambda step, outside: change(step.tensor())


def _set(key: str, value) -> Callable[[dict], None]:
    def change(doc: dict) -> None:
        doc[key] = value

    return change


def _drop(key: str) -> Callable[[dict], None]:
    return lambda doc: doc.pop(key)


def _data_record(change: Callable[[dict], None]) -> Callable[[NewestStep, pathlib.Path], None]:
    return lambda step, outside: change(step.record(".safetensors", 0))


def _grow_first(doc: dict) -> None:
    doc["shape"] = [doc["shape"][0] + 1] + doc["shape"][1:]


EDITS: list[Edit] = [
    # --- the manifest: a tensor record -------------------------------------------------------
    Edit("manifest: dtype float32 -> float64", _t(_set("dtype", "float64"))),
    Edit("manifest: dtype float32 -> int32 (same size)", _t(_set("dtype", "int32"))),
    Edit("manifest: dtype unknown", _t(_set("dtype", "float99"))),
    Edit("manifest: dtype wrong type", _t(_set("dtype", 7))),
    Edit("manifest: shape one row more", _t(_grow_first)),
    Edit("manifest: shape transposed", _t(lambda d: d.__setitem__("shape", d["shape"][::-1]))),
    Edit("manifest: shape impossible allocation", _t(_set("shape", [2**40, 2**40]))),
    Edit("manifest: shape negative", _t(lambda d: d.__setitem__("shape", [-d["shape"][0]] + d["shape"][1:]))),
    Edit("manifest: shape wrong type", _t(_set("shape", "20x12"))),
    Edit("manifest: shape missing", _t(_drop("shape"))),
    Edit("manifest: shape one more dimension", _t(lambda d: d.__setitem__("shape", d["shape"] + [1]))),
    Edit(
        "manifest: grid astronomical",
        _t(lambda d: d.update(grid=[10**6] * len(d["shape"]), writers={"first": 0, "step": 0})),
    ),
    Edit("manifest: grid negative", _t(lambda d: d.__setitem__("grid", [-1] * len(d["shape"])))),
    Edit(
        "manifest: grid one cell more",
        _t(lambda d: d.update(grid=[d["grid"][0] + 1] + d["grid"][1:], writers=d["writers"] + [0])),
    ),
    Edit("manifest: writers out of range", _t(lambda d: d.__setitem__("writers", [99] * len(d["writers"])))),
    Edit(
        "manifest: chunks overlapping",
        _t(
            lambda d: (
                d.update(chunks=[[[0] * len(d["shape"]), d["shape"], 0], [[0] * len(d["shape"]), d["shape"], 0]])
                or d.pop("grid")
                and d.pop("writers")
            )
        ),
    ),
    Edit(
        "manifest: chunks leaving a gap",
        _t(
            lambda d: (
                d.update(chunks=[[[0] * len(d["shape"]), [1] + d["shape"][1:], 0]])
                or d.pop("grid")
                and d.pop("writers")
            )
        ),
    ),
    Edit("manifest: tensor record removed", _m(lambda m: m["tensors"].pop(TENSOR))),
    Edit("manifest: tensor record wrong type", _m(lambda m: m["tensors"].__setitem__(TENSOR, "x"))),
    Edit(
        "manifest: tensor record repeated key", lambda step, outside: _repeat_key_in_manifest(step), must_fall_back=True
    ),
    # --- the manifest: files, counts, the document ---------------------------------------------
    Edit("manifest: data file size + 1", _data_record(lambda r: r.__setitem__("size_bytes", r["size_bytes"] + 1))),
    Edit("manifest: data file block size 4096", _data_record(_set("chunk_bytes", 4096))),
    Edit("manifest: data file block size 0", _data_record(_set("chunk_bytes", 0))),
    Edit("manifest: data file path leaves the step", _data_record(_set("path", "../../../etc/hostname"))),
    Edit(
        "manifest: index record removed",
        _m(
            lambda m: m["files"].remove(
                next(f for f in m["files"] if f["rank"] == 0 and f["path"].endswith(".index.json"))
            )
        ),
    ),
    Edit("manifest: world size 0", _m(_set("world_size", 0))),
    Edit("manifest: world size huge", _m(_set("world_size", 10**18))),
    Edit("manifest: rank states missing", _m(_set("rank_state", []))),
    Edit("manifest: step negative", _m(_set("step", -3))),
    Edit("manifest: format version 99", _m(_set("format_version", 99))),
    Edit("manifest: aliases to a missing tensor", _m(_set("aliases", {TENSOR: "model/nothing"}))),
    Edit("manifest: meshes huge", _m(_set("meshes", [{"shape": [10**9] * 8, "dim_names": None}]))),
    Edit("manifest: top-level state missing", _m(lambda m: m["state"].pop("scheduler")), self_consistent=True),
    Edit("manifest: state nested 100000 deep", lambda step, outside: _manifest_text(step, "state", _deep(DEEP))),
    Edit("manifest: number of 5000 digits", lambda step, outside: _manifest_text(step, "world_size", "9" * 5000)),
    Edit("manifest: NaN world size", lambda step, outside: _manifest_text(step, "world_size", "NaN")),
    Edit("manifest: not an object", lambda step, outside: setattr(step, "manifest_raw", b"[]")),
    # --- a rank index -----------------------------------------------------------------------
    Edit(
        "index: chunk range into the header",
        lambda s, o: _index_chunk(s, lambda v, i: v.__setitem__(slice(1, 3), [8, 8 + v[2] - v[1]])),
    ),
    Edit("index: chunk range overlaps the one before", lambda s, o: _overlap(s)),
    Edit("index: chunk range 4 bytes short", lambda s, o: _index_chunk(s, lambda v, i: v.__setitem__(2, v[2] - 4))),
    Edit(
        "index: chunk range past the end",
        lambda s, o: _index_chunk(s, lambda v, i: v.__setitem__(2, i["files"][0]["size_bytes"] + 100)),
    ),
    Edit("index: chunk range negative", lambda s, o: _index_chunk(s, lambda v, i: v.__setitem__(1, -8))),
    Edit("index: chunk in a file it does not have", lambda s, o: _index_chunk(s, lambda v, i: v.__setitem__(0, 5))),
    Edit("index: chunk missing", lambda s, o: s.index(0)["chunks"].pop(s.chunk_keys(0)[0])),
    Edit("index: chunk range wrong type", lambda s, o: s.index(0)["chunks"].__setitem__(s.chunk_keys(0)[0], "0,1,2")),
    Edit("index: block size 4096 (digests recomputed)", lambda s, o: _block_size(s, 4096)),
    Edit("index: block size 0", lambda s, o: s.index(0)["files"][0].__setitem__("block_bytes", 0)),
    Edit("index: file size huge", lambda s, o: s.index(0)["files"][0].__setitem__("size_bytes", 2**62)),
    Edit("index: step wrong", lambda s, o: s.index(0).__setitem__("step", s.index(0)["step"] - 1)),
    Edit("index: rank wrong", lambda s, o: s.index(0).__setitem__("rank", 1)),
    Edit("index: files missing", lambda s, o: s.index(0).pop("files")),
    Edit(
        "index: chunks nested 100000 deep",
        lambda s, o: s.index_raw.__setitem__(
            0, json.dumps(dict(s.index(0), chunks="@@")).replace('"@@"', _deep(DEEP)).encode()
        ),
    ),
    Edit(
        "index: number of 5000 digits",
        lambda s, o: s.index_raw.__setitem__(
            0, json.dumps(dict(s.index(0), step="@@")).replace('"@@"', "9" * 5000).encode()
        ),
    ),
    Edit("index: repeated chunk key", lambda s, o: _repeat_chunk_in_index(s), must_fall_back=True),
    # --- a safetensors header ------------------------------------------------------------------
    Edit("header: dtype F32 -> F64", lambda s, o: _header_entry(s, lambda e: e.__setitem__("dtype", "F64"))),
    Edit(
        "header: dtype F32 -> I32 (same size)", lambda s, o: _header_entry(s, lambda e: e.__setitem__("dtype", "I32"))
    ),
    Edit("header: shape transposed", lambda s, o: _header_entry(s, lambda e: e.__setitem__("shape", e["shape"][::-1]))),
    Edit(
        "header: data offsets shifted",
        lambda s, o: _header_entry(
            s, lambda e: e.__setitem__("data_offsets", [e["data_offsets"][0] + 4, e["data_offsets"][1] + 4])
        ),
    ),
    Edit("header: data offsets of two tensors swapped", lambda s, o: _swap_offsets(s)),
    Edit("header: entry removed", lambda s, o: s.header(0).pop(s.chunk_keys(0)[0])),
    Edit("header: repeated entry", lambda s, o: _repeat_entry_in_header(s), must_fall_back=True),
    Edit(
        "header: metadata nested 100000 deep",
        lambda s, o: s.header_raw.__setitem__(
            0,
            json.dumps(dict(s.header(0), __metadata__="@@"), separators=(",", ":"))
            .replace('"@@"', _deep(DEEP))
            .encode(),
        ),
    ),
    Edit("header: length prefix huge", lambda s, o: s.length_prefix.__setitem__(0, struct.pack("<Q", 2**62))),
    Edit("header: not an object", lambda s, o: s.header_raw.__setitem__(0, b"[]")),
    # --- links and FIFOs (the root is a boundary) -------------------------------------------------
    Edit(
        "link: data file to an identical copy outside",
        lambda s, o: _link(s, o, "data"),
        must_fall_back=True,
        rewrites=False,
    ),
    Edit(
        "link: index to an identical copy outside",
        lambda s, o: _link(s, o, "index"),
        must_fall_back=True,
        rewrites=False,
    ),
    Edit(
        "link: manifest to an identical copy outside",
        lambda s, o: _link(s, o, "manifest"),
        must_fall_back=True,
        rewrites=False,
    ),
    Edit(
        "link: step directory to an identical copy outside",
        lambda s, o: _link(s, o, "step directory"),
        must_fall_back=True,
        rewrites=False,
    ),
    Edit("fifo: in place of a data file", lambda s, o: _fifo(s, o, inside=True), must_fall_back=True, rewrites=False),
    Edit(
        "link: data file to a FIFO outside", lambda s, o: _fifo(s, o, inside=False), must_fall_back=True, rewrites=False
    ),
]
