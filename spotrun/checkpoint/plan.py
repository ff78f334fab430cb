"""Who writes what: replicated tensors spread across ranks by bytes.

Replicated state (DDP: every rank holds the same model and optimizer) is written once
in total. Every rank computes the same plan from the same names and sizes, so no
communication is needed: largest tensors first, each to the rank with the fewest
bytes so far (ties to the lowest rank).
"""

from __future__ import annotations

import heapq


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
    loads = [(0, r) for r in range(world_size)]  # (bytes so far, rank), a min-heap
    owner: dict[str, int] = {}
    for name in sorted(sizes_bytes, key=lambda n: (-sizes_bytes[n], n)):
        load, r = heapq.heappop(loads)
        owner[name] = r
        heapq.heappush(loads, (load + sizes_bytes[name], r))
    return owner
