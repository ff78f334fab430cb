"""The bounds the scale model's figures must stay within, derived from the job (ranks, tensors,
bytes) and the format, not from the figures themselves. Derivations: ``docs/design/scale.md``
("The bounds") and the docstring of ``tests/unit/checkpoint/test_scale_plan.py``.
"""

from __future__ import annotations

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
#: S3's default part size (``S3Options.part_size_bytes``): a part holds at least this much.
PART_BYTES = 16 * MIB
#: A read unit (``ChunkReader._units``): at most 8 MiB of whole blocks.
UNIT_BYTES = 8 * MIB


def job_facts(result: dict) -> dict:
    """What the bounds are derived from: the job's shape, not its plan's figures."""
    model, layout = result["model"], result["layout"]["save"]
    ranks = result["config"]["ranks"]
    replicas = ranks if layout == "ddp" else result["layout"]["mesh"][0] if layout.startswith("hsdp") else 1
    return {
        "ranks": ranks,
        "tensors": model["tensors"],
        # AdamW: a parameter, its two moments and its step; the step is a plain tensor, written whole
        "replicated_tensors": model["tensors"] if layout == "ddp" else model["tensors"] // 4,
        "state_bytes": model["state_bytes"],
        "replicas": replicas,
        # what a rank restores: its shard's share of the state (all of it under DDP)
        "bytes_per_rank": model["state_bytes"] * replicas // ranks,
    }


def bounds(result: dict) -> dict[str, int | float]:
    """Each checked figure's bound for ``result``'s job."""
    f = job_facts(result)
    objects = 2 * f["ranks"] + 1  # a shard file and an index per rank (files under 4 GiB), the manifest
    # a restoring rank reads from itself, its replicas' files and the owners of the replicated tensors
    writers = min(f["ranks"], 1 + f["replicas"] + f["replicated_tensors"])
    per_restoring_rank = (
        1  # the manifest
        + writers * (1 + 2 + 2)  # each writer's index, a file's two header reads, the partial units at its ends
        + -(-f["bytes_per_rank"] // UNIT_BYTES)  # the full units
    )
    return {
        "manifest_bytes": MANIFEST_BYTES_PER_RANK * f["ranks"]
        + MANIFEST_BYTES_PER_TENSOR * f["tensors"]
        + MANIFEST_BYTES_FIXED,
        # a rank's chunks: one per sharded tensor at most, its own tensors, its share of the replicated
        "index_bytes_per_rank_max": INDEX_BYTES_PER_CHUNK * (f["tensors"] + 8)
        + INDEX_BYTES_PER_BLOCK * -(-f["bytes_per_rank"] // MIB)
        + INDEX_BYTES_FIXED,
        # each object: a create, its parts, a complete (or one PUT)
        "save_requests": 3 * objects + -(-f["state_bytes"] // PART_BYTES),
        "restore_get_requests": f["ranks"] * per_restoring_rank,
        # today every key of a step lies under one prefix, step-N/
        "busiest_prefix_request_share": 1.0,
    }


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
    for name, value in figures.items():
        if value > limits[name]:
            found.append(f"{name} {value} > {limits[name]}")
    return found
