"""Chunk layouts and byte runs (format 4), and the manifest's size at 1,024 ranks."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch

from spotrun.checkpoint.chunks import Chunk, ChunkLayout, byte_runs, grid_bounds, overlap
from spotrun.checkpoint.manifest import Manifest
from spotrun.checkpoint.manifest_build import build_manifest
from spotrun.checkpoint.save import SaveContext


def fsdp_chunks(shape: list[int], ranks: int) -> list[Chunk]:
    """The chunks FSDP2 writes: dimension 0 cut as torch.chunk cuts it, one part per rank."""
    bounds = grid_bounds(shape[0], ranks)
    return [
        Chunk((bounds[r],) + (0,) * (len(shape) - 1), (bounds[r + 1] - bounds[r],) + tuple(shape[1:]), r)
        for r in range(ranks)
        if bounds[r + 1] > bounds[r]
    ]


@pytest.mark.parametrize("rows,ranks", [(8, 2), (7, 3), (5, 4), (1, 4), (1024, 1024)])
def test_fsdp_sharding_is_stored_as_a_grid_and_expands_to_the_same_chunks(rows, ranks):
    chunks = fsdp_chunks([rows, 3], ranks)
    layout = ChunkLayout.of([rows, 3], chunks)
    assert "grid" in layout.to_json()
    parsed = ChunkLayout.from_json([rows, 3], json.loads(json.dumps(layout.to_json())))
    assert parsed.chunks() == chunks


def test_irregular_chunks_are_listed_one_by_one():
    chunks = [Chunk((0,), (2,), 0), Chunk((2,), (3,), 1), Chunk((5,), (2,), 2)]  # not torch.chunk's cut
    layout = ChunkLayout.of([7], chunks)
    assert "chunks" in layout.to_json()
    assert ChunkLayout.from_json([7], layout.to_json()).chunks() == chunks


def test_overlapping_finds_exactly_the_chunks_sharing_elements_with_a_box():
    layout = ChunkLayout.of(
        [10, 6], [Chunk((r0, c0), (5, 3), 2 * (r0 // 5) + c0 // 3) for r0 in (0, 5) for c0 in (0, 3)]
    )
    for box in [((0, 0), (10, 6)), ((4, 2), (2, 2)), ((5, 3), (5, 3)), ((9, 0), (1, 1))]:
        expected = [c for c in layout.chunks() if overlap((c.offsets, c.lengths), box) is not None]
        assert layout.overlapping(box) == expected


@pytest.mark.parametrize(
    "shape,box",
    [
        ((4, 6), ((1, 2), (2, 3))),  # a block inside: one run per row
        ((4, 6), ((1, 0), (2, 6))),  # whole rows: one run
        ((3, 4, 5), ((0, 1, 0), (3, 2, 5))),  # whole innermost rows
        ((3, 4, 5), ((1, 1, 1), (2, 3, 3))),
        ((), ((), ())),  # a scalar
    ],
)
def test_byte_runs_concatenated_are_the_box_in_row_major_order(shape, box):
    chunk = torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)
    run_bytes, starts = byte_runs(tuple(shape), box, chunk.element_size())
    raw = chunk.reshape(-1).view(torch.uint8)
    got = torch.cat([raw[s : s + run_bytes] for s in starts]).view(torch.int32)
    index = tuple(slice(o, o + n) for o, n in zip(*box))
    assert torch.equal(got, chunk[index].reshape(-1))


def test_writers_that_form_a_progression_are_written_in_two_numbers():
    layout = ChunkLayout.of([8, 4], [Chunk((r, 0), (1, 4), 2 * r + 1) for r in range(8)])
    assert layout.to_json()["writers"] == {"first": 1, "step": 2}


def test_malformed_chunk_lists_are_refused():
    with pytest.raises(ValueError):
        ChunkLayout.from_json([4], {"chunks": [[[3], [2], 0]]})  # past the end
    with pytest.raises(ValueError):
        ChunkLayout.from_json([4], {"grid": [2], "writers": [0]})  # one writer for two cells


def test_manifest_of_a_1024_rank_fsdp_job_stays_under_10_mb():
    """The design's scale case, without processes: ~1,000 tensors x 3 (parameter, AdamW's two
    moments) FSDP-sharded over 1,024 ranks, each rank's own RNG state and an index file per
    rank. Rank 0 derives each sharded tensor's grid from its placements (no rank reports those
    chunks: spotrun.checkpoint.sharded.predicted_grid) and the manifest describes it by that
    grid, not by 1,024 chunks."""
    from torch.distributed.tensor import Shard

    ranks, tensors = 1024, 1000
    mesh = SimpleNamespace(shape=(ranks,), mesh=torch.arange(ranks), mesh_dim_names=("dp",))
    shapes = {f"model/layers.{i}.weight": [4096 + i % 7, 512] for i in range(tensors)}
    # stand-ins for DTensors: the manifest reads their dtype, global shape, mesh and placements
    sharded = {
        f"{kind}/{n}": SimpleNamespace(dtype=torch.float32, shape=shape, device_mesh=mesh, placements=(Shard(0),))
        for n, shape in shapes.items()
        for kind in ("m", "optimizer/exp_avg", "optimizer/exp_avg_sq")
    }
    reports = []
    for rank in range(ranks):
        rng = {
            f"rank-{rank:05d}/rng/{k}": {"dtype": "int64", "shape": [624], "stored_as": None}
            for k in ("numpy", "python", "torch_cpu")
        }
        reports.append(
            {
                "chunks": [[n, [0], [624]] for n in rng],
                "rank_tensors": rng,
                "write_s": 1.0,
                "rank_state": {
                    "rng": {k: {"__tensor__": n} for k, n in zip(("numpy", "python", "torch_cpu"), rng)},
                    "numerics": {"intra_op_threads": 8, "torch_version": "2.13.0"},
                },
                "files": [
                    {
                        "path": f"rank-{rank:05d}.i000000001.safetensors",
                        "rank": rank,
                        "size_bytes": 2**30,
                        "digest": "0" * 64,
                        "algorithm": "blake3-chunks",
                        "chunk_bytes": 2**20,
                    },
                    {
                        "path": f"rank-{rank:05d}.i000000001.index.json",
                        "rank": rank,
                        "size_bytes": 2**20,
                        "digest": "0" * 64,
                        "algorithm": "sha256",
                        "chunk_bytes": None,
                    },
                ],
            }
        )
    encoded = SimpleNamespace(tensors={}, sharded=sharded, skeleton={"m": {}}, aliases={})
    manifest = build_manifest(7, encoded, reports, SaveContext("periodic", "run", 1), ranks)
    data = manifest.to_json()
    assert len(data) < 10 * 2**20, f"{len(data) / 2**20:.1f} MiB"
    parsed = Manifest.from_json(data)
    some = "optimizer/exp_avg/model/layers.3.weight"
    assert parsed.tensors[some].chunks.chunks() == fsdp_chunks(shapes["model/layers.3.weight"], ranks)
    assert parsed.tensors["rank-01000/rng/numpy"].chunks.chunks() == [Chunk((0,), (624,), 1000)]


def test_grid_bounds_cut_as_torch_chunk_cuts():
    for size, parts in itertools.product(range(0, 12), range(1, 6)):
        pieces = torch.arange(size).chunk(parts) if size else ()
        bounds = grid_bounds(size, parts)
        cut = [bounds[i + 1] - bounds[i] for i in range(parts) if bounds[i + 1] > bounds[i]]
        assert cut == [len(p) for p in pieces]
