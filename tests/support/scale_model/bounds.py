"""The bounds the scale model's figures must stay within, derived from the job (ranks, tensors,
bytes, layout) and the product's rules (part sizes, read units, key layout), not from the figures
themselves. Derivations: ``docs/design/scale.md`` ("The bounds") and the docstring of
``tests/unit/checkpoint/test_scale_plan.py``.
"""

from __future__ import annotations

from spotrun.checkpoint.layout import SPREAD_DIGITS
from spotrun.storage.options import SPREAD_FROM_WORLD_SIZE
from spotrun.storage.s3_config import S3Options

MIB = 2**20
#: A rank's part of the manifest: two file records (< 250 B each), its own state's skeleton
#: (RNGs, numerics: < 700 B) and its own tensors' records (4 RNG tensors, < 150 B each).
MANIFEST_BYTES_PER_RANK = 2048
#: A tensor's record (name, dtype, shape, a grid and its writers as a progression: < 300 B plus its
#: name) and its place in the state's skeleton (its name again, the optimizer's parameter list).
MANIFEST_BYTES_PER_TENSOR = 1024
MANIFEST_BYTES_FIXED = MIB
#: The design contract (../shared/docs/design.md): a 70B model on 1,024 FSDP ranks.
MANIFEST_CONTRACT_BYTES = 10 * 10**6
#: An index entry per chunk (its key: name and offsets, < 200 B; its file and bytes, < 40 B), a
#: digest per MiB block (64 hex digits, quotes, a comma), and its files' records.
INDEX_BYTES_PER_CHUNK = 256
INDEX_BYTES_PER_BLOCK = 67
INDEX_BYTES_FIXED = 1024
#: The S3 backend's defaults: parts (and read units) in flight per rank, and the largest part
#: (and read unit): ``spotrun.storage.part_sizes``.
STREAMS = S3Options().max_concurrency
LARGEST_PART_BYTES = S3Options().max_part_size_bytes
#: The issue's target (issue 26, point 2): a 1 TB save at 1,024 ranks in under 20,000 requests.
ISSUE_SAVE_REQUESTS = 20_000


def job_facts(result: dict) -> dict:
    """What the bounds are derived from: the job's shape and layout, not its plan's figures."""
    model, layout = result["model"], result["layout"]["save"]
    ranks = result["config"]["ranks"]
    replicas = ranks if layout == "ddp" else result["layout"]["mesh"][0] if layout.startswith("hsdp") else 1
    tp = result["layout"]["mesh"][1] if layout.startswith("fsdp+tp") else 1
    return {
        "ranks": ranks,
        "tensors": model["tensors"],
        "state_bytes": model["state_bytes"],
        "replicas": replicas,
        # a rank's shard of the state (all of it under DDP): what it restores
        "bytes_per_rank": model["state_bytes"] * replicas // ranks,
        # the tensor-parallel peers that wrote the boxes a rank reads but did not write: the
        # boxes of tensors that tensor parallelism replicates (norms), each written by one peer
        "writers_per_rank": tp,
        "pieces_from_peers": model["replicated_placement_tensors"] if tp > 1 else 0,
        "spread": ranks >= SPREAD_FROM_WORLD_SIZE,
    }


def _parts_per_rank(f: dict) -> int:
    """Parts (or read units) of a rank's fair share of the state, plus one for a rank that
    holds more than its share: at least one per stream, at most the largest part each."""
    fair_bytes = -(-f["state_bytes"] // f["ranks"])
    return max(STREAMS, -(-fair_bytes // LARGEST_PART_BYTES) + 1)


def bounds(result: dict) -> dict[str, int | float]:
    """Each checked figure's bound for ``result``'s job (a cooperative restore at the saved layout)."""
    f = job_facts(result)
    ranks, parts = f["ranks"], _parts_per_rank(f)
    # a prefix holds the files of ceil(R / 100) ranks; those may make twice the mean requests
    per_prefix = -(-ranks // 10**SPREAD_DIGITS)
    return {
        "manifest_bytes": MANIFEST_BYTES_PER_RANK * ranks
        + MANIFEST_BYTES_PER_TENSOR * f["tensors"]
        + MANIFEST_BYTES_FIXED,
        # a rank's chunks: one per sharded tensor at most, its own tensors, its share of the replicated
        "index_bytes_per_rank_max": INDEX_BYTES_PER_CHUNK * (f["tensors"] + 8)
        + INDEX_BYTES_PER_BLOCK * -(-f["bytes_per_rank"] // MIB)
        + INDEX_BYTES_FIXED,
        # per rank: its index (one PUT), its shard file (a create, its parts, a complete); the manifest
        "save_requests": ranks * (3 + parts) + 1,
        # the manifest once (rank 0, relayed); per rank: each writer's index and two header reads,
        # its units (as the save's parts), and one more unit per piece read from a peer's file
        "restore_get_requests": 1 + ranks * (3 * f["writers_per_rank"] + parts + f["pieces_from_peers"]),
        # cooperative: every byte read once, plus the whole 1 MiB blocks around a piece from a peer
        "restore_bytes_per_rank_mean": -(-f["state_bytes"] // ranks) + (f["pieces_from_peers"] * 2 + 1) * MIB,
        "busiest_prefix_request_share": min(1.0, 2 * per_prefix / ranks) if f["spread"] else 1.0,
    }


def save_requests_bound(ranks: int, state_bytes: int) -> int:
    """The save's request bound for ``state_bytes`` over ``ranks`` (as :func:`bounds`)."""
    return ranks * (3 + _parts_per_rank({"ranks": ranks, "state_bytes": state_bytes})) + 1


def misses(result: dict) -> list[str]:
    """The figures of ``result`` over their bounds (empty: all within)."""
    found = []
    limits = bounds(result)
    figures = {
        "manifest_bytes": result["manifest_bytes"],
        "index_bytes_per_rank_max": result["index_bytes_per_rank_max"],
        "save_requests": result["save_requests"]["total"],
        "busiest_prefix_request_share": max(result["busiest_prefix_request_share"].values()),
    }
    if "restore_get_requests" in result:  # a run with its restore
        figures["restore_get_requests"] = result["restore_get_requests"]["total"]
        figures["restore_bytes_per_rank_mean"] = result["restore_bytes_per_rank"]["mean"]
    for name, value in figures.items():
        if value > limits[name]:
            found.append(f"{name} {value} > {limits[name]}")
    return found
