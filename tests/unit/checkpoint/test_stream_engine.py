"""The streaming checkpoint engine (issue 9, items 1, 2 and 5): shard files streamed from
the tensors' memory and checksummed chunk by chunk, restores read straight into the live
tensors, and format-2 checkpoints (whole-file SHA-256) still load."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import blake3
import pytest
import torch
from safetensors.torch import load_file

import spotrun
from spotrun.checkpoint.stream import CHECKSUM_BLOCK_BYTES, CHECKSUM_CHUNK_BYTES, ChunkDigests, ShardSource
from spotrun.errors import CorruptShardError, NoCheckpointError
from spotrun.storage import LocalStorage
from tests.support.ckpt_files import manifest_path, shard_path
from tests.support.paths import GOLDEN

GOLDEN_V2 = GOLDEN / "golden-v2"


def odd_tensors() -> dict[str, torch.Tensor]:
    """Tensors that exercise every path of the stream: bigger than a chunk, not contiguous,
    empty, 0-d, bfloat16, bool, and a tail that is not a multiple of 4 KiB."""
    gen = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(CHECKSUM_CHUNK_BYTES // 4 * 2 + 1001, generator=gen),
        "transposed": torch.randn(33, 17, generator=gen).t(),
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(2.5),
        "bf": torch.randn(77, generator=gen).to(torch.bfloat16),
        "mask": torch.rand(13, generator=gen) > 0.5,
        "ids": torch.arange(7, dtype=torch.int64),
    }


@pytest.mark.parametrize("direct_io", [True, False])
def test_streamed_shard_is_a_safetensors_file_with_exact_bytes(tmp_path, direct_io):
    tensors = odd_tensors()
    storage = LocalStorage(str(tmp_path), direct_io=direct_io)
    source = ShardSource(tensors, {"step": 3})
    digests = ChunkDigests(source.size_bytes, CHECKSUM_CHUNK_BYTES)
    storage.put_stream("f.safetensors", source, chunk_bytes=CHECKSUM_CHUNK_BYTES, on_chunk=digests)
    assert os.path.getsize(tmp_path / "f.safetensors") == source.size_bytes
    back = load_file(str(tmp_path / "f.safetensors"))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    # the chunked digest is BLAKE3 over the BLAKE3 of each 8 MiB piece of the file
    data = (tmp_path / "f.safetensors").read_bytes()
    leaves = b"".join(
        blake3.blake3(data[i : i + CHECKSUM_CHUNK_BYTES]).digest() for i in range(0, len(data), CHECKSUM_CHUNK_BYTES)
    )
    assert digests.hexdigest() == blake3.blake3(leaves).hexdigest()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_stream_to_a_filesystem_without_o_direct(tmp_path):
    """/dev/shm (tmpfs) refuses O_DIRECT on many kernels: the write falls back to buffered."""
    root = pathlib.Path("/dev/shm") / f"spotrun-test-{os.getpid()}"
    if not pathlib.Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    try:
        storage = LocalStorage(str(root))
        tensors = {"big": torch.randn(3 * 2**20)}
        storage.put_stream("f.safetensors", ShardSource(tensors, {}), chunk_bytes=CHECKSUM_CHUNK_BYTES)
        assert torch.equal(load_file(str(root / "f.safetensors"))["big"], tensors["big"])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def make(tmp_path, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 4096))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = {"bf": torch.randn(100).to(torch.bfloat16), "scales": torch.rand(9).to(torch.float8_e8m0fnu)}
    ckpt = spotrun.Checkpointer(
        {"model": model, "optimizer": opt, "extra": extra},
        storage=LocalStorage(str(tmp_path / "ck")),
        handle_signals=False,
    )
    return ckpt, model, opt, extra


def train(model, opt, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_restore_reads_into_the_live_tensors_bit_exactly(tmp_path):
    ckpt, model, opt, extra = make(tmp_path, 0)
    ckpt.restore()
    train(model, opt, 2)
    ckpt.save(2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    saved_extra = {k: v.clone() for k, v in extra.items()}
    ckpt.close()

    other, model2, opt2, extra2 = make(tmp_path, 1)
    train(model2, opt2, 1)  # the optimizer has state: it is filled in place
    pointers = {k: v.data_ptr() for k, v in model2.state_dict().items()}
    opt_pointers = {k: v.data_ptr() for k, v in opt2.state_dict()["state"][0].items()}
    assert other.restore() == 2
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved[k]) and v.data_ptr() == pointers[k], k
    for k, v in opt2.state_dict()["state"][0].items():
        assert torch.equal(v, saved_opt[k]) and v.data_ptr() == opt_pointers[k], k
    for k, v in extra2.items():
        assert v.dtype == saved_extra[k].dtype and torch.equal(v.view(torch.uint8), saved_extra[k].view(torch.uint8))
    other.close()


def test_manifest_records_the_block_checksum_per_file_and_an_index_per_rank(tmp_path):
    ckpt, model, opt, _ = make(tmp_path, 0)
    ckpt.restore()
    ckpt.save(1)
    doc = json.loads(manifest_path(tmp_path / "ck", 1).read_text())
    assert doc["format_version"] == 4
    data_files = [r for r in doc["files"] if r["path"].endswith(".safetensors")]
    index_files = [r for r in doc["files"] if r["path"].endswith(".index.json")]
    assert data_files and len(index_files) == 1  # one index per rank
    for record in data_files:  # hashed in blocks, so that a partial (resharding) read is verified too
        assert record["algorithm"] == "blake3-chunks" and record["chunk_bytes"] == CHECKSUM_BLOCK_BYTES
        assert len(record["digest"]) == 64 and "sha256" not in record
    assert len(index_files[0]["sha256"]) == 64  # a small JSON file: SHA-256 of the whole


@pytest.mark.parametrize("where", ["header", "first chunk", "last chunk"])
def test_a_changed_byte_in_any_chunk_fails_verification(tmp_path, where):
    ckpt, model, opt, _ = make(tmp_path, 0)
    ckpt.restore()
    ckpt.save(1)
    ckpt.close()
    shard = shard_path(tmp_path / "ck", 1, 0)
    data = bytearray(shard.read_bytes())
    assert len(data) > CHECKSUM_CHUNK_BYTES  # several chunks
    index = {"header": 20, "first chunk": CHECKSUM_CHUNK_BYTES - 3, "last chunk": len(data) - 2}[where]
    data[index] ^= 0x01
    shard.write_bytes(bytes(data))
    other, *_ = make(tmp_path, 1)
    with pytest.raises(NoCheckpointError):
        other.restore()
    rejected = list((tmp_path / "ck" / "step-000000001").glob("rejected-*"))
    assert rejected and shard.name in json.loads(rejected[0].read_text())["reason"]  # names the bad file


def test_golden_format_2_checkpoint_still_loads_and_is_still_verified(tmp_path):
    """Written by spotrun before format 3 (whole-file SHA-256 records): loads bit-exactly,
    bfloat16 and a byte-stored float8_e8m0fnu included; a changed byte is still caught."""
    shutil.copytree(GOLDEN_V2, tmp_path / "ck")
    model = torch.nn.Linear(3, 2)
    extra: dict = {"bf": torch.zeros(2, dtype=torch.bfloat16), "scales": torch.zeros(3).to(torch.float8_e8m0fnu)}
    ckpt = spotrun.Checkpointer(
        {"model": model, "extra": extra}, storage=LocalStorage(str(tmp_path / "ck")), handle_signals=False
    )
    assert ckpt.restore() == 7
    assert torch.equal(model.weight, torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    assert torch.equal(extra["bf"], torch.tensor([1.5, -2.25], dtype=torch.bfloat16))
    assert torch.equal(extra["scales"].float(), torch.tensor([1.0, 2.0, 4.0])) and extra["epoch"] == 3
    ckpt.close()

    shutil.rmtree(tmp_path / "ck")
    shutil.copytree(GOLDEN_V2, tmp_path / "ck")
    shard = next((tmp_path / "ck" / "step-000000007").glob("rank-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    other = spotrun.Checkpointer(
        {"model": torch.nn.Linear(3, 2), "extra": {}}, storage=LocalStorage(str(tmp_path / "ck")), handle_signals=False
    )
    with pytest.raises(NoCheckpointError):
        other.restore()


def test_a_shard_shorter_than_recorded_is_corrupt_not_a_crash(tmp_path):
    from spotrun.checkpoint.manifest import FileRecord, TensorRecord
    from spotrun.checkpoint.reader import read_shard_into

    storage = LocalStorage(str(tmp_path))
    source = ShardSource({"w": torch.ones(10)}, {})
    digests = ChunkDigests(source.size_bytes, CHECKSUM_CHUNK_BYTES)
    storage.put_stream("f", source, chunk_bytes=CHECKSUM_CHUNK_BYTES, on_chunk=digests)
    record = FileRecord("f", 0, source.size_bytes + 4, digests.hexdigest(), "sha256-chunks", CHECKSUM_CHUNK_BYTES)
    with pytest.raises(CorruptShardError, match="header describes|shorter"):
        read_shard_into(storage, "f", record, {"w": TensorRecord("f", "float32", [10])}, {}, where="f")


def test_a_sha256_chunked_record_is_verified_too(tmp_path):
    """The chunked construction with SHA-256 (format 3 allows it): read and verified."""
    import hashlib

    from spotrun.checkpoint.manifest import FileRecord, TensorRecord
    from spotrun.checkpoint.reader import read_shard_into

    storage = LocalStorage(str(tmp_path))
    tensors = {"w": torch.randn(3 * 2**20)}
    source = ShardSource(tensors, {})
    storage.put_stream("f", source, chunk_bytes=CHECKSUM_CHUNK_BYTES)
    data = (tmp_path / "f").read_bytes()
    leaves = b"".join(
        hashlib.sha256(data[i : i + CHECKSUM_CHUNK_BYTES]).digest() for i in range(0, len(data), CHECKSUM_CHUNK_BYTES)
    )
    good = FileRecord("f", 0, len(data), hashlib.sha256(leaves).hexdigest(), "sha256-chunks", CHECKSUM_CHUNK_BYTES)
    wanted = {"w": TensorRecord("f", "float32", [3 * 2**20])}
    assert torch.equal(read_shard_into(storage, "f", good, wanted, {}, where="f")["w"], tensors["w"])
    bad = FileRecord("f", 0, len(data), "0" * 64, "sha256-chunks", CHECKSUM_CHUNK_BYTES)
    with pytest.raises(CorruptShardError, match="checksum"):
        read_shard_into(storage, "f", bad, wanted, {}, where="f")
