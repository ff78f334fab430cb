"""Who writes the replicated tensors (spotrun.checkpoint.plan): every tensor once, balanced by
bytes, small tensors together, the largest on ranks far apart (issue 26: found by the scale model)."""

from __future__ import annotations

import math

import pytest

from spotrun.checkpoint.plan import BUNDLE_BYTES, SMALL_TENSOR_BYTES, assign_by_bytes

GIB = 2**30


def llama_like_adamw(layers: int = 80) -> dict[str, int]:
    """Sizes of a 70B-like model's replicated AdamW state: embeddings and layers, each with two
    moments, a 4-byte ``step`` per parameter, and small norms."""
    sizes = {}
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        sizes[f"{kind}/embed"] = sizes[f"{kind}/head"] = 128256 * 8192 * 4
        for layer in range(layers):
            sizes[f"{kind}/l{layer}.mlp"] = 8192 * 28672 * 4
            sizes[f"{kind}/l{layer}.norm"] = 8192 * 4
    for name in [n for n in sizes if n.startswith("param/")]:
        sizes[f"step/{name}"] = 4
    return sizes


@pytest.mark.parametrize("world_size", [1, 2, 3, 1024])
def test_every_tensor_has_one_writer_and_the_plan_is_the_same_for_the_same_input(world_size):
    sizes = llama_like_adamw(4)
    owner = assign_by_bytes(sizes, world_size)
    assert set(owner) == set(sizes)
    assert all(0 <= rank < world_size for rank in owner.values())
    assert assign_by_bytes(dict(reversed(list(sizes.items()))), world_size) == owner


def test_small_tensors_are_written_by_few_ranks_so_a_restore_reads_few_indexes():
    """A ``step`` scalar per parameter and the norms (and their moments) used to go to as many
    different ranks (723 ``step`` tensors in a 70B model): every restoring rank then read hundreds
    of index files. Packed, they take as many writers as bundles."""
    sizes = llama_like_adamw()
    owner = assign_by_bytes(sizes, 1024)
    small = [n for n, s in sizes.items() if s < SMALL_TENSOR_BYTES]
    assert len(small) == 3 * 80 + (2 + 2 * 80)  # the norms with their moments, a step per parameter
    bundles = math.ceil(sum(sizes[n] for n in small) / BUNDLE_BYTES)
    assert len({owner[n] for n in small}) <= bundles + 1


def test_the_largest_tensors_land_on_different_nodes():
    """Ranks of one node are numbered together (8 per node here): the six largest tensors
    (embeddings, heads and their moments) used to land on ranks 0-5, one node holding four
    times the mean node's bytes."""
    sizes = llama_like_adamw()
    owner = assign_by_bytes(sizes, 1024)
    largest = sorted(sizes, key=lambda n: -sizes[n])[:6]
    assert len({owner[n] // 8 for n in largest}) == 6
    node_bytes = [0] * 128
    for name, rank in owner.items():
        node_bytes[rank // 8] += sizes[name]
    largest_tensor = max(sizes.values())
    assert max(node_bytes) <= sum(node_bytes) / 128 + 2 * largest_tensor


def test_loads_differ_by_at_most_the_largest_tensor():
    sizes = {f"t{i}": (i % 17 + 1) * 3 * 2**20 for i in range(300)}
    owner = assign_by_bytes(sizes, 7)
    loads = [sum(sizes[n] for n, r in owner.items() if r == rank) for rank in range(7)]
    assert max(loads) - min(loads) <= max(sizes.values())


def test_a_world_size_below_one_is_refused():
    with pytest.raises(ValueError):
        assign_by_bytes({"a": 1}, 0)
