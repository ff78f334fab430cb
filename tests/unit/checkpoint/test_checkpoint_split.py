"""Issue 8, section 5: a state of very many tensors is split over several shard files, by a
maximum file size and a header budget, and restores exactly.

Single process, no process group, local storage in ``tmp_path`` (as tests/unit/checkpoint/test_checkpoint.py).
"""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors import safe_open

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import data_file_key, file_key, shard_name, shard_part_name
from spotrun.checkpoint.shard import SAFETENSORS_MAX_HEADER_BYTES
from spotrun.errors import ConfigError
from tests.support.ckpt_files import chunk_files, storage_at


def header_bytes(path) -> int:
    """Length of a safetensors file's JSON header (its first 8 bytes, little-endian)."""
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def many_tensors(count: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {f"block.{i}.w": torch.randn(3 + i % 5, generator=gen) for i in range(count)}
    state.update(
        {f"block.{i}.scale": torch.randn(2, generator=gen).to(torch.float8_e8m0fnu) for i in range(0, count, 7)}
    )  # some stored as raw bytes
    state["big"] = torch.randn(40_000, generator=gen)  # 160 kB: more than one file may hold
    return state


def test_5_many_tensors_split_into_files(tmp_path):
    """A small max file size and header budget force several files per rank: each file
    keeps to both limits (a tensor larger than a file gets a file of its own), every file
    is an ordinary safetensors file, and restore reads them all back exactly."""
    max_file_size_bytes, max_header_bytes = 64 * 1024, 16 * 1024
    state = many_tensors(2_000, seed=0)
    ckpt = spotrun.Checkpointer(
        {"model": state},
        storage=storage_at(tmp_path),
        handle_signals=False,
        max_file_size_bytes=max_file_size_bytes,
        max_header_bytes=max_header_bytes,
    )
    ckpt.save(3)

    manifest = catalog.committed(storage_at(tmp_path), 3).manifest
    paths = [f.path for f in manifest.files if f.path.endswith(".safetensors")]
    records = {f.path: f for f in manifest.files}
    assert len(paths) > 5
    assert paths == [shard_part_name(0, ckpt.incarnation, k) for k in range(len(paths))]
    assert paths[0] == shard_name(0, ckpt.incarnation)
    stored_in: dict[str, str] = {}
    for path in paths:
        local = tmp_path / file_key(3, records[path], manifest)
        assert header_bytes(local) <= max_header_bytes
        with safe_open(str(local), framework="pt") as f:
            names = list(f.keys())
        stored_in.update({n: path for n in names})
        if "model/big" in names:
            assert names == ["model/big"]  # alone, the only file over the size limit
        else:
            assert local.stat().st_size <= max_file_size_bytes
    assert {n: {p} for n, p in stored_in.items()} == chunk_files(tmp_path, 3)  # each tensor once
    assert set(stored_in) == set(manifest.tensors)
    assert catalog.inspect_step(storage_at(tmp_path), 3).status == "complete"

    restored = many_tensors(2_000, seed=1)
    ckpt2 = spotrun.Checkpointer({"model": restored}, storage=storage_at(tmp_path), handle_signals=False)
    assert ckpt2.restore() == 3
    assert restored.keys() == state.keys()
    for name, value in state.items():
        assert restored[name].dtype == value.dtype
        assert torch.equal(restored[name].view(torch.uint8), value.view(torch.uint8)), name


def test_5_a_missing_part_marks_the_step_corrupt(tmp_path):
    """Every part is a file of the step: without one, the step is not complete."""
    state = many_tensors(300, seed=0)
    ckpt = spotrun.Checkpointer(
        {"model": state}, storage=storage_at(tmp_path), handle_signals=False, max_file_size_bytes=8 * 1024
    )
    ckpt.save(1)
    (tmp_path / data_file_key(1, 0, shard_part_name(0, ckpt.incarnation, 2), None)).unlink()
    info = catalog.inspect_step(storage_at(tmp_path), 1)
    assert info.status == "corrupt" and shard_part_name(0, ckpt.incarnation, 2) in info.problem


@pytest.mark.parametrize(
    "kwargs",
    [{"max_file_size_bytes": 0}, {"max_header_bytes": 100}, {"max_header_bytes": SAFETENSORS_MAX_HEADER_BYTES + 1}],
)
def test_5_shard_limits_out_of_range_are_refused(tmp_path, kwargs):
    with pytest.raises(ConfigError):
        spotrun.Checkpointer({"model": {}}, storage=storage_at(tmp_path), handle_signals=False, **kwargs)


@pytest.mark.slow
def test_5_state_past_safetensors_header_limit_saves_and_restores(tmp_path):
    """With the default limits, a state whose tensor index alone is larger than safetensors'
    100 MB header limit (100,000 tensors with 1,000-character names) saves in several files
    and restores exactly. (1.3 million tensors with short names: benchmarks/many_tensors.py.)"""
    count, name_length = 100_000, 1_000

    def build(fill: bool) -> dict[str, torch.Tensor]:
        state = {}
        for i in range(count):
            name = f"layer.{i:06d}.".ljust(name_length, "x")
            state[name] = torch.full((2,), float(i)) if fill else torch.zeros(2)
        return state

    state = build(fill=True)
    assert sum(len(n) + 60 for n in state) > SAFETENSORS_MAX_HEADER_BYTES  # one file could not hold it
    spotrun.Checkpointer({"m": state}, storage=storage_at(tmp_path), handle_signals=False).save(1)
    manifest = catalog.committed(storage_at(tmp_path), 1).manifest
    shards = [f for f in manifest.files if f.path.endswith(".safetensors")]
    assert len(shards) > 1
    assert all(header_bytes(tmp_path / file_key(1, f, manifest)) < SAFETENSORS_MAX_HEADER_BYTES for f in shards)
    del state
    restored = build(fill=False)
    assert spotrun.Checkpointer({"m": restored}, storage=storage_at(tmp_path), handle_signals=False).restore() == 1
    assert all(v[0].item() == i for i, v in enumerate(restored.values()))
