"""Issue 26, point 3: who reads which bytes at a cooperative restore
(spotrun.checkpoint.share_plan), a pure function of every rank's needs and the manifest, checked
on manifests laid out as the save lays them out (no tensors, no processes)."""

from __future__ import annotations

import math

from spotrun.checkpoint.chunks import ChunkLayout, grid_bounds
from spotrun.checkpoint.manifest import Manifest, TensorRecord
from spotrun.checkpoint.plan import assign_by_bytes
from spotrun.checkpoint.share_plan import (
    Need,
    pieces_of,
    plan_from_digests,
    plan_reads,
    segments,
    writers_of,
)

#: Tensor name -> shape: a few layers, AdamW's moments, sizes that do not divide evenly.
SHAPES = {
    **{f"model/layer{i}.weight": [64 + 8 * i, 48] for i in range(5)},
    **{f"model/layer{i}.bias": [64 + 8 * i] for i in range(5)},
    **{f"optimizer/state/{i}/exp_avg": [64 + 8 * i, 48] for i in range(5)},
    **{f"optimizer/state/{i}/step": [] for i in range(5)},
}


def manifest_of(world_size: int, records: dict[str, TensorRecord]) -> Manifest:
    return Manifest(step=1, world_size=world_size, files=[], tensors=records, state={}, rank_state=[{}] * world_size)


def nbytes(shape: list[int]) -> int:
    return math.prod(shape) * 4


def ddp_manifest(world_size: int) -> Manifest:
    """Replicated tensors, each written whole by the rank the save's own plan picks, and each
    rank's own RNG state."""
    owner = assign_by_bytes({n: nbytes(s) for n, s in SHAPES.items()}, world_size)
    records = {
        n: TensorRecord(None, "float32", s, chunks=ChunkLayout(s, grid=[1] * len(s), writers=[owner[n]]))
        for n, s in SHAPES.items()
    }
    for r in range(world_size):
        records[f"rank-{r:05d}/rng/torch"] = TensorRecord(
            None, "uint8", [5056], chunks=ChunkLayout([5056], grid=[1], writers=[r])
        )
    return manifest_of(world_size, records)


def whole(name: str, manifest: Manifest) -> Need:
    record = manifest.tensors[name]
    return Need(
        name,
        (0,) * len(record.shape),
        tuple(record.shape),
        math.prod(record.shape) * (1 if record.dtype == "uint8" else 4),
    )


def ddp_needs(manifest: Manifest, world_size: int) -> list[list[Need]]:
    """Every rank needs every replicated tensor whole, and the RNG state of saved rank r mod N."""
    return [
        [whole(n, manifest) for n in SHAPES] + [whole(f"rank-{r % manifest.world_size:05d}/rng/torch", manifest)]
        for r in range(world_size)
    ]


def test_ddp_ranks_at_the_saved_world_size_each_read_what_they_wrote():
    """At the world size that saved, each rank reads exactly the replicated tensors it wrote
    (so one index, its own) and its own RNG state; the replicated state is read once in total
    and every rank receives the rest."""
    manifest = ddp_manifest(4)
    plan = plan_reads(ddp_needs(manifest, 4), manifest)
    replicated = sum(nbytes(s) for s in SHAPES.values())
    for rank in range(4):
        assert {w for need in plan.reads(rank) for w in writers_of(need, manifest)} == {rank}
        assert plan.bytes_received(rank) == replicated - plan.bytes_read(rank) + 5056
    assert sum(plan.bytes_read(r) for r in range(4)) == replicated + 4 * 5056
    assert [g.ranks for g in plan.groups] == [(0, 1, 2, 3)]
    assert {r: [n.name for n in needs] for r, needs in plan.alone.items()} == {
        r: [f"rank-{r:05d}/rng/torch"] for r in range(4)
    }


def test_ddp_ranks_at_another_world_size_read_each_tensor_once_balanced_by_bytes():
    """Saved on 4 ranks, restored on 3: the three form one group of the replicated tensors, each
    read by one rank, and no rank reads more than a third of them plus the largest."""
    manifest = ddp_manifest(4)
    needs = ddp_needs(manifest, 3)
    plan = plan_reads(needs, manifest)
    [group] = plan.groups
    assert group.ranks == (0, 1, 2) and sorted(group.needs) == sorted(whole(n, manifest) for n in SHAPES)
    total = sum(nbytes(s) for s in SHAPES.values())
    largest = max(nbytes(s) for s in SHAPES.values())
    for rank in range(3):
        assert sum(n.nbytes for n in group.stream(rank)) <= total / 3 + largest


def hsdp_manifest() -> Manifest:
    """A 2 x 2 HSDP save (mesh rows are replicas: ranks 0, 1 and ranks 2, 3; rank r holds shard
    r % 2): each tensor with rows cut in two along dimension 0, both halves written by the replica
    the save picked for it (rows 0 or 1 of the mesh, alternately here); the step counters whole."""
    records = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        if len(shape) == 0:
            records[name] = TensorRecord(None, "float32", shape, chunks=ChunkLayout(shape, grid=[], writers=[i % 4]))
            continue
        replica = i % 2  # the save's hash picks a replica per tensor
        grid = [2] + [1] * (len(shape) - 1)
        records[name] = TensorRecord(
            None, "float32", shape, chunks=ChunkLayout(shape, grid=grid, writers=[2 * replica, 2 * replica + 1])
        )
    return manifest_of(4, records)


def hsdp_needs(manifest: Manifest, rank: int, shards: int) -> list[Need]:
    """Rank ``rank`` of a (2, shards) mesh: its shard's box of each 2-D tensor, every plain one whole."""
    needs = []
    for name, shape in SHAPES.items():
        if len(shape) == 0:
            needs.append(whole(name, manifest))
            continue
        bounds = grid_bounds(shape[0], shards)
        c = rank % shards
        lengths = (bounds[c + 1] - bounds[c], *shape[1:])
        needs.append(Need(name, (bounds[c],) + (0,) * (len(shape) - 1), lengths, math.prod(lengths) * 4))
    return needs


def test_hsdp_replica_groups_read_each_box_once_and_each_rank_reads_what_it_wrote():
    """On the saved 2 x 2 mesh, the ranks holding the same shard form a group, the step counters
    all four; every box is read once, by the replica that wrote it."""
    manifest = hsdp_manifest()
    plan = plan_reads([hsdp_needs(manifest, r, 2) for r in range(4)], manifest)
    assert sorted(g.ranks for g in plan.groups) == [(0, 1, 2, 3), (0, 2), (1, 3)]
    for group in plan.groups:
        for need, reader in zip(group.needs, group.readers):
            assert writers_of(need, manifest) == [reader]
    read = [n for r in range(4) for n in plan.reads(r)]
    assert len(read) == len(set(read))  # no box twice


def test_a_whole_tensor_cut_in_rows_is_shared_in_pieces_each_from_one_writers_file():
    """Restored on 2 ranks (each needs every tensor whole), a tensor saved in two row chunks by
    ranks 2 and 3 is read in two pieces, each by the rank standing in for its writer (2 -> 0,
    3 -> 1), so no file is read by two ranks; the pieces lie back to back in the tensor."""
    manifest = hsdp_manifest()
    plan = plan_reads([hsdp_needs(manifest, r, 1) for r in range(2)], manifest)
    files_read = {r: {w for n in plan.reads(r) for w in writers_of(n, manifest)} for r in range(2)}
    assert files_read == {0: {0, 2}, 1: {1, 3}}
    need = whole("model/layer1.weight", manifest)  # written by ranks 2 and 3
    assert [(p.offsets, p.lengths, offset) for p, offset in pieces_of(need, manifest)] == [
        ((0, 0), (36, 48), 0),
        ((36, 0), (36, 48), 36 * 48 * 4),
    ]


def test_a_box_cut_across_its_rows_is_read_whole_by_one_rank():
    """Chunks that cut a tensor's columns are not one contiguous range of a whole-tensor box:
    the box is not split, and one rank reads it all."""
    shape = [8, 6]
    layout = ChunkLayout(shape, grid=[1, 2], writers=[0, 1])
    manifest = manifest_of(2, {"model/w": TensorRecord(None, "float32", shape, chunks=layout)})
    need = Need("model/w", (0, 0), (8, 6), 8 * 6 * 4)
    assert pieces_of(need, manifest) == [(need, 0)]
    [group] = plan_reads([[need], [need]], manifest).groups
    assert group.needs == (need,)


def test_a_rank_that_knows_only_its_own_segments_finds_the_groups_it_is_in():
    """What a rank computes at restore (every rank's digests, its own needs) gives it the same
    groups, readers and order as the plan made from every rank's needs."""
    manifest = hsdp_manifest()
    needs = [hsdp_needs(manifest, r, 2) for r in range(4)]
    full = plan_reads(needs, manifest)
    digests = [list(segments(n, manifest)) for n in needs]
    for rank in range(4):
        own = plan_from_digests(digests, segments(needs[rank], manifest), manifest)
        assert own.groups_of(rank) == full.groups_of(rank)
        assert own.reads(rank) == full.reads(rank)


def test_ranks_that_share_nothing_read_alone():
    """Four ranks that each hold a quarter of every tensor (FSDP, no step counters): nobody
    shares a box, there is no group, and each rank reads its own boxes."""
    manifest = hsdp_manifest()
    needs = [[n for n in hsdp_needs(manifest, r, 4) if n.lengths] for r in range(4)]
    plan = plan_reads(needs, manifest)
    assert plan.groups == []
    assert all(plan.reads(r) == sorted(needs[r]) for r in range(4))
