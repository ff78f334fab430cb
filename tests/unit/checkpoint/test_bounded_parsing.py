"""A checkpoint's JSON documents and the sizes they give are parsed within bounds (issue 21,
item 2): nesting, size, repeated keys, shapes and grids that ask for more than the step's files
hold are a corrupt step - a fallback with one line naming the file and the limit - never a
RecursionError, a MemoryError or a step resumed silently with whichever reading json picked.

The end-to-end cases save two real steps, edit the newest one's manifest or rank index (with
the sizes and digests spotrun records for the edited file recomputed, so the edit reaches the
parser), and run ``spotrun verify``, ``Checkpointer.restore()`` and ``spotrun ls`` each in a
process under an address-space limit of 2 GiB, with a timeout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import resource
import subprocess
import sys

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog, strict_json, tree
from spotrun.checkpoint.fencing import read_fences
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.rank_index import RankIndex
from spotrun.checkpoint.reader import read_header
from spotrun.errors import CorruptShardError, ManifestError, StateSerializationError
from spotrun.eventlog.records import parse_records
from spotrun.storage import LocalStorage
from tests.support.ckpt_files import manifest_path
from tests.support.paths import REPO

ADDRESS_SPACE_BYTES = 2 * 2**30
DEEP = 100_000


def deep(levels: int = DEEP) -> str:
    return "[" * levels + "]" * levels


def limited(args: list[str], timeout_s: float = 120, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` from the repository under the address-space limit, with a timeout."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))

    # glibc reserves 64 MiB of address space per malloc arena, one per thread that meets
    # contention (more on a busy machine): two arenas keep the limit about what is allocated
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        timeout=timeout_s,
        preexec_fn=limit,
        input=stdin,
        env=env,
    )


def save_two_steps(root: pathlib.Path) -> dict[str, str]:
    """Steps 1 and 2 of a Linear(4, 4) and a dict; returns step 1's values as the worker prints them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    extra = {"epoch": 1}
    ckpt = spotrun.Checkpointer(
        {"model": model, "extra": extra}, storage=LocalStorage(str(root), fsync=False), handle_signals=False
    )
    ckpt.save(1)
    at_1 = {
        "weight": model.weight.detach().numpy().tobytes().hex(),
        "bias": model.bias.detach().numpy().tobytes().hex(),
    }
    with torch.no_grad():
        model.weight.add_(1.0)
    extra["epoch"] = 2
    ckpt.save(2)
    ckpt.close()
    return at_1


def manifest_doc(root: pathlib.Path) -> tuple[pathlib.Path, dict]:
    path = manifest_path(root, 2)
    return path, json.loads(path.read_text())


def write_manifest_with(path: pathlib.Path, doc: dict, placeholder: str, text: str) -> None:
    """Write ``doc`` with the JSON string ``placeholder`` replaced by raw JSON ``text`` (json.dumps
    itself cannot write 100,000 levels)."""
    path.write_text(json.dumps(doc).replace(json.dumps(placeholder), text, 1))


# --- edits of step 2 (each keeps every size and digest the catalog and the readers check) -------


def manifest_state_nested_deep(root: pathlib.Path) -> None:
    path, doc = manifest_doc(root)
    doc["state"]["extra"] = {"epoch": "@deep"}
    write_manifest_with(path, doc, "@deep", deep())


def manifest_repeated_key(root: pathlib.Path) -> None:
    """json keeps the last of two keys, another reader may keep the first: two checkpoints."""
    path, doc = manifest_doc(root)
    text = json.dumps(doc)
    path.write_text(text.replace('"reason": ', '"reason": "final", "reason": ', 1))


def manifest_shape_2_40_squared(root: pathlib.Path) -> None:
    path, doc = manifest_doc(root)
    doc["tensors"]["model/weight"]["shape"] = [2**40, 2**40]
    doc["tensors"]["model/weight"]["grid"] = [1, 1]
    path.write_text(json.dumps(doc))


def manifest_grid_of_10_12_cells(root: pathlib.Path) -> None:
    """A 60-byte edit: a grid whose writers, expanded, would be 10**12 ranks."""
    path, doc = manifest_doc(root)
    doc["tensors"]["model/weight"]["grid"] = [10**6, 10**6]
    doc["tensors"]["model/weight"]["writers"] = {"first": 0, "step": 0}
    path.write_text(json.dumps(doc))


def manifest_shape_of_4_times_the_data_bytes(root: pathlib.Path) -> None:
    """As many float32 elements as the data files have bytes left: the manifest parses (an
    element takes at least a byte), the tensor it asks for is 4x the files."""
    path, doc = manifest_doc(root)
    others = sum(math.prod(r["shape"]) for n, r in doc["tensors"].items() if n != "model/weight")
    data_bytes = sum(f["size_bytes"] for f in doc["files"] if f["path"].endswith(".safetensors"))
    doc["tensors"]["model/weight"].update(shape=[data_bytes - others], grid=[1])
    path.write_text(json.dumps(doc))


def reseal_index(root: pathlib.Path, index_text: str) -> None:
    """Replace rank 0's index of step 2 and record its size and SHA-256 in the manifest, as a
    writer does."""
    path, doc = manifest_doc(root)
    (record,) = [f for f in doc["files"] if f["path"].endswith(".index.json")]
    data = index_text.encode()
    (path.parent / record["path"]).write_bytes(data)
    record.update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    path.write_text(json.dumps(doc))


def index_of(root: pathlib.Path) -> str:
    return next((root / "step-000000002").glob("rank-00000.*.index.json")).read_text()


def index_nested_deep(root: pathlib.Path) -> None:
    reseal_index(root, index_of(root).replace('"chunks":', f'"deep":{deep()},"chunks":', 1))


def index_repeated_key(root: pathlib.Path) -> None:
    """The weight's chunk listed twice: json would read the second (the bias's bytes)."""
    text = index_of(root)
    chunks = json.loads(text)["chunks"]
    weight = f'"model/weight":{json.dumps(chunks["model/weight"], separators=(",", ":"))}'
    bias = json.dumps(chunks["model/bias"], separators=(",", ":"))
    assert weight in text
    reseal_index(root, text.replace(weight, f'{weight},"model/weight":{bias}', 1))


EDITS = [
    manifest_state_nested_deep,
    manifest_repeated_key,
    manifest_shape_2_40_squared,
    manifest_grid_of_10_12_cells,
    manifest_shape_of_4_times_the_data_bytes,
    index_nested_deep,
    index_repeated_key,
]
REASONS = {  # what the one line about step 2 says (verify's and restore's, when they differ)
    # the restore runs verify's header check (issue 21 item 1) before it sizes anything
    manifest_shape_of_4_times_the_data_bytes: "tensor model/weight is stored as F32[4, 4]",
    manifest_state_nested_deep: "nested more than 128 levels deep",
    manifest_repeated_key: "names the key 'reason' twice",
    manifest_shape_2_40_squared: "holds more elements than the",
    manifest_grid_of_10_12_cells: "has more cells than the",
    index_nested_deep: "nested more than 128 levels deep",
    index_repeated_key: "names the key 'model/weight' twice",
}


@pytest.mark.parametrize("edit", EDITS, ids=[e.__name__ for e in EDITS])
def test_an_edited_newest_step_is_refused_by_every_reader_and_restore_resumes_the_previous_one(tmp_path, edit):
    """Issue 21 (C06, C12: a committed step that cannot be decoded is a verification failure with
    fallback, never a crash loop). Under 2 GiB of address space: ``spotrun verify`` exits 1 with
    one line naming the file and the limit; ``restore()`` resumes step 1 bit-exactly; ``spotrun
    ls`` lists step 2 as corrupt (exit 0) with a one-line reason. A refused manifest makes the
    step corrupt in the catalog (never a candidate); a refused index is found by the restore,
    which logs one line with the reason and un-commits the step."""
    root = tmp_path / "ckpt"
    at_1 = save_two_steps(root)
    edit(root)
    reason = REASONS[edit]
    reason, restore_reason = reason if isinstance(reason, tuple) else (reason, reason)

    verify = limited(["-m", "spotrun", "verify", str(root), "--step", "2"])
    out = verify.stdout.decode()
    assert verify.returncode == 1, verify.stderr.decode()[-3000:]
    assert "Traceback" not in verify.stderr.decode()
    lines = out.splitlines()
    assert len([line for line in lines if reason in line]) == 1 and all(
        line.startswith("step 2: ") for line in lines
    ), out

    before = ls(root)[2]
    manifest_refused = before["status"] == "corrupt"
    if manifest_refused:
        assert reason in before["problem"] and "\n" not in before["problem"]
    restore = limited(["tests/jobs/bounded_restore.py", str(root)])
    log = restore.stderr.decode()
    assert restore.returncode == 0 and "Traceback" not in log, log[-3000:]
    restored = json.loads(restore.stdout)
    assert restored == {"step": 1, **at_1, "epoch": 1}
    fallbacks = [line for line in log.splitlines() if "failed verification" in line]
    if manifest_refused:  # the catalog lists step 2 as corrupt: never tried, never complete
        assert fallbacks == [], log
    else:  # tried, refused, un-committed
        assert len(fallbacks) == 1 and restore_reason in fallbacks[0] and "falling back to step 1" in fallbacks[0], log

    after = ls(root)
    assert after[1]["status"] == "complete"
    if manifest_refused:  # never resumed: the start from step 1 fences what incarnation 0 committed after it
        assert after[2]["status"] in ("corrupt", "fenced")
    else:
        assert after[2]["status"] == "corrupt" and "failed verification" in after[2]["problem"]


def ls(root: pathlib.Path) -> dict[int, dict]:
    """``spotrun ls --json`` (exit 0) by step."""
    listing = limited(["-m", "spotrun", "ls", str(root), "--json"])
    assert listing.returncode == 0, listing.stderr.decode()[-3000:]
    return {s["step"]: s for s in json.loads(listing.stdout)}


# --- each document alone -----------------------------------------------------------------------


def valid_manifest(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict]:
    root = tmp_path / "ckpt"
    save_two_steps(root)
    return manifest_doc(root)


def test_json_nested_100000_deep_is_a_corrupt_document_not_a_recursion_error(tmp_path, caplog):
    """Issue 21: a manifest, a rank index, a safetensors header, an incarnation record and an
    event line of 100,000 '[' are each refused with their reader's error (json never recurses)."""
    with pytest.raises(ManifestError, match="nested more than 128 levels deep"):
        Manifest.from_json(deep().encode(), where="m.json")
    with pytest.raises(CorruptShardError, match="nested more than 128 levels deep"):
        RankIndex.from_json(deep().encode(), where="i.json")
    header = deep().encode()
    (tmp_path / "f.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CorruptShardError, match="nested more than 128 levels deep"):
        read_header(LocalStorage(str(tmp_path)), "f.safetensors", 8 + len(header), where="f.safetensors")
    (tmp_path / "incarnations").mkdir()
    (tmp_path / "incarnations" / "incarnation-000000001.json").write_text(deep())
    with caplog.at_level(logging.WARNING):
        assert read_fences(LocalStorage(str(tmp_path))).resumed == {}
        assert parse_records(deep().encode() + b"\n", "events/x.jsonl") == ()


def test_a_repeated_key_is_refused_in_a_manifest_an_index_and_a_header(tmp_path):
    """Issue 21: json would keep the last of two keys and safetensors' reader may keep another,
    so two readers would see two checkpoints: a repeated key is a corrupt document."""
    path, doc = valid_manifest(tmp_path)
    text = json.dumps(doc)
    with pytest.raises(ManifestError, match="names the key 'step' twice"):
        Manifest.from_json(text.replace('"step": 2', '"step": 2, "step": 2').encode())
    index = index_of(tmp_path / "ckpt")
    with pytest.raises(CorruptShardError, match="names the key 'step' twice"):
        RankIndex.from_json(index.replace('"step":2', '"step":2,"step":2').encode(), where="i.json")
    header = (
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    )
    (tmp_path / "f.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"x")
    with pytest.raises(CorruptShardError, match="names the key 'a' twice"):
        read_header(LocalStorage(str(tmp_path)), "f.safetensors", 9 + len(header), where="f.safetensors")


def test_nan_and_infinity_are_refused_in_every_document(tmp_path):
    path, doc = valid_manifest(tmp_path)
    with pytest.raises(ManifestError, match="NaN"):
        Manifest.from_json(json.dumps(doc).replace('"epoch": 2', '"epoch": NaN').encode())
    with pytest.raises(CorruptShardError, match="Infinity"):
        RankIndex.from_json(index_of(tmp_path / "ckpt").replace('"step":2', '"step":Infinity').encode(), where="i")


def test_a_manifest_larger_than_the_limit_is_a_corrupt_step_by_its_listed_size(tmp_path):
    """Issue 21: an oversized manifest (here a sparse file one byte over the limit) is refused by
    the size its listing gives; ``spotrun ls`` shows the step as corrupt with the limit."""
    step = tmp_path / "step-000000007"
    step.mkdir()
    with open(step / "manifest.i000000001.json", "wb") as f:
        f.truncate(strict_json.MANIFEST_MAX_BYTES + 1)
    (info,) = catalog.list_steps(LocalStorage(str(tmp_path)))
    assert info.status == "corrupt"
    assert f"more than the {strict_json.MANIFEST_MAX_BYTES} a manifest may have" in info.problem


def parse_limited(data: bytes) -> str:
    """``Manifest.from_json`` in a process of at most 2 GiB: its error's name and message."""
    done = limited(
        [
            "-c",
            "import sys\nfrom spotrun.checkpoint.manifest import Manifest\ntry:\n"
            "    Manifest.from_json(sys.stdin.buffer.read())\n    print('parsed')\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)",
        ],
        stdin=data,
        timeout_s=60,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode().strip()


def test_a_grid_of_10_12_cells_is_refused_before_it_is_expanded(tmp_path):
    """Issue 21: a grid is bounded by what the step's files can hold (its cells by the world size
    or the writers' index entries, its elements by the data files' bytes) before any list of
    cells or writers is built: refused within a 2 GiB process, not a MemoryError."""
    path, doc = valid_manifest(tmp_path)
    doc["tensors"]["model/weight"].update(grid=[10**6, 10**6], writers={"first": 0, "step": 0})
    answer = parse_limited(json.dumps(doc).encode())
    assert answer.startswith("ManifestError") and "has more cells than the" in answer, answer
    doc["tensors"]["model/weight"].update(shape=[10**6, 10**6])
    answer = parse_limited(json.dumps(doc).encode())
    assert answer.startswith("ManifestError") and "holds more elements than the" in answer, answer


@pytest.mark.parametrize("shape", [[2**40, 2**40], [2**64, 1], [-1, 4], [3, 0, 2**70]])
def test_a_shape_beyond_the_files_or_torch_is_refused_when_the_manifest_is_parsed(tmp_path, shape):
    """Issue 21: no allocation is sized from a shape the step's data files could not hold (or
    one torch cannot express); an empty tensor with a huge dimension is still refused."""
    path, doc = valid_manifest(tmp_path)
    doc["tensors"]["model/weight"].update(shape=shape, grid=[1] * len(shape))
    answer = parse_limited(json.dumps(doc).encode())
    assert answer.startswith("ManifestError") and "tensor" in answer, answer


@pytest.mark.parametrize("chunk_bytes, refusal", [(1, ">= 4096"), (2**40, "at most 67108864")])
def test_a_checksum_chunk_outside_4_kib_to_64_mib_is_refused(tmp_path, chunk_bytes, refusal):
    """Issue 21: a reader keeps a digest per checksum chunk and holds up to a chunk per thread;
    writers use 1 and 8 MiB, so 1-byte chunks (a digest per byte) or 1 TiB ones (a whole file
    in memory) in a manifest or a rank index are refused."""
    path, doc = valid_manifest(tmp_path)
    (record,) = [f for f in doc["files"] if f["path"].endswith(".safetensors")]
    record["chunk_bytes"] = chunk_bytes
    with pytest.raises(ManifestError, match=f"chunk_bytes must be .*{refusal}"):
        Manifest.from_json(json.dumps(doc).encode())
    index = json.loads(index_of(tmp_path / "ckpt"))
    index["files"][0].update(
        block_bytes=chunk_bytes, block_digests=["0" * 64] * -(-index["files"][0]["size_bytes"] // chunk_bytes)
    )
    with pytest.raises(CorruptShardError, match=f"blocks of {chunk_bytes} bytes"):
        RankIndex.from_json(json.dumps(index).encode(), where="i.json")


def test_a_header_entry_past_the_end_of_its_file_is_refused_before_its_tensor_is_allocated(tmp_path):
    """Issue 21, format 3 reader: the manifest and the header agree on [2**20, 2**20] float32,
    but the header's offsets lie past the file's end: refused before the 4 TiB tensor exists."""
    from spotrun.checkpoint.manifest import FileRecord, TensorRecord
    from spotrun.checkpoint.reader import read_shard_into

    nbytes = 2**40 * 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**20, 2**20], "data_offsets": [0, nbytes]}}).encode()
    data = len(header).to_bytes(8, "little") + header + b"\0" * 64
    (tmp_path / "f.safetensors").write_bytes(data)
    record = FileRecord(
        path="f.safetensors",
        rank=0,
        size_bytes=len(data),
        digest="0" * 64,
        algorithm="blake3-chunks",
        chunk_bytes=2**20,
    )
    wanted = {"w": TensorRecord(file="f.safetensors", dtype="float32", shape=[2**20, 2**20])}
    with pytest.raises(CorruptShardError, match="the header describes 4398046511200 bytes, the manifest records 160"):
        read_shard_into(LocalStorage(str(tmp_path)), "f.safetensors", record, wanted, {}, where="f.safetensors")


def test_a_state_nested_deeper_than_a_manifest_may_is_refused_when_saved():
    """Issue 21: the nesting limit a reader applies is refused at save (before anything is
    written), so no job can commit a step it could not read back."""
    value: object = 1
    for _ in range(tree.MAX_SKELETON_DEPTH):
        value = [value]
    skeleton, _ = tree.encode({"deep": value[0]}, "extra")  # type: ignore[index]
    doc = json.dumps({"rank_state": [{"extra": skeleton}]}).encode()
    assert strict_json.nesting_depth(doc) == strict_json.MAX_DEPTH
    with pytest.raises(StateSerializationError, match="nested more than"):
        tree.encode({"deep": value}, "extra")


def test_the_nesting_scan_counts_brackets_outside_strings_only():
    assert strict_json.nesting_depth(b'{"a[[[": ["]]]\\"[", {"b": []}], "c": "\\\\"}') == 4
    assert strict_json.nesting_depth(b'"unterminated [[[') == 0
    assert strict_json.nesting_depth(b"[" * 500, stop_after=128) > 128
