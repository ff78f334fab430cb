"""Who writes what: replicated tensors spread across ranks by bytes.

Replicated state (DDP: every rank holds the same model and optimizer) is written once
in total. Every rank computes the same plan from the same names and sizes, so no
communication is needed: largest first, each to the rank with the fewest bytes so far.

Two rules keep the plan good at a thousand ranks (found by the scale model,
``docs/design/scale.md``):

- Small tensors travel together. A 70B model's AdamW state holds hundreds of small replicated
  tensors (a ``step`` scalar per parameter, biases, norms); spread one per rank they made every
  restoring rank read hundreds of index files and headers. Tensors under
  :data:`SMALL_TENSOR_BYTES` are packed in name order into bundles of up to :data:`BUNDLE_BYTES`
  (and no more than a rank's fair share of the state, so a small state still spreads), each
  written by one rank.
- Ties go to ranks far apart. Ranks of one node are numbered together, so the first, largest
  tensors (embeddings and their moments) all landed on node 0's ranks, which then held four
  times the mean node's bytes; ranks of equal load are taken in bit-reversed order
  (0, W/2, W/4, 3W/4, ...), which puts the first picks on different nodes whatever the
  number of ranks per node.
"""

from __future__ import annotations

import heapq

#: Replicated tensors smaller than this are packed into bundles (see the module docstring).
SMALL_TENSOR_BYTES = 2**20
#: Most bytes of one bundle of small tensors.
BUNDLE_BYTES = 64 * 2**20


def assign_by_bytes(sizes_bytes: dict[str, int], world_size: int) -> dict[str, int]:
    """Map each tensor name to the rank that writes it.

    Args:
        sizes_bytes: tensor name -> size in bytes.
        world_size: number of ranks (>= 1).

    Returns:
        name -> rank in ``[0, world_size)``; deterministic for equal inputs.

    Raises:
        ValueError: ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    units = [(size, [name]) for name, size in sizes_bytes.items() if size >= SMALL_TENSOR_BYTES]
    fair_share = -(-sum(sizes_bytes.values()) // world_size)
    small = sorted(name for name, size in sizes_bytes.items() if size < SMALL_TENSOR_BYTES)
    units += _bundles(small, sizes_bytes, min(BUNDLE_BYTES, fair_share))
    spread = _bit_reversed_order(world_size)
    loads = [(0, spread[r], r) for r in range(world_size)]  # (bytes so far, tie order, rank), a min-heap
    heapq.heapify(loads)
    owner: dict[str, int] = {}
    for size, names in sorted(units, key=lambda unit: (-unit[0], unit[1][0])):
        load, order, r = heapq.heappop(loads)
        owner.update((name, r) for name in names)
        heapq.heappush(loads, (load + size, order, r))
    return owner


def _bundles(names: list[str], sizes_bytes: dict[str, int], most_bytes: int) -> list[tuple[int, list[str]]]:
    """Consecutive ``names`` packed into bundles of up to ``most_bytes`` (a tensor larger alone):
    (bytes, names)."""
    bundles: list[tuple[int, list[str]]] = []
    size, members = 0, []
    for name in names:
        if members and size + sizes_bytes[name] > most_bytes:
            bundles.append((size, members))
            size, members = 0, []
        size += sizes_bytes[name]
        members.append(name)
    if members:
        bundles.append((size, members))
    return bundles


def _bit_reversed_order(world_size: int) -> list[int]:
    """Rank -> its tie order: the rank's bits reversed (distinct for every rank, 0 for rank 0)."""
    bits = max(1, (world_size - 1).bit_length())
    return [int(f"{r:0{bits}b}"[::-1], 2) for r in range(world_size)]
