"""Write real (tiny) checkpoint steps with spotrun's storage and manifest types.

Used by the fake workers (imported as ``fakeckpt``, from their own directory) and by the
tests (``tests.jobs.fakeckpt``). The shard bytes are not safetensors: the catalog
checks only presence and sizes, which is all these tests need.
"""

from __future__ import annotations

import time

from spotrun.checkpoint.layout import data_file_key, manifest_key, shard_name
from spotrun.checkpoint.manifest import FileRecord, Manifest
from spotrun.storage import LocalStorage, open_storage


def write_step(
    root: str,
    step: int,
    *,
    commit: bool = True,
    corrupt: bool = False,
    world_size: int = 1,
    reason: str = "periodic",
    run_id: str = "",
    incarnation: int = 0,
    created_unix_s: float | None = None,
    shard_bytes: int = 100,
    meshes: list[dict] | None = None,
) -> None:
    """Write ``step`` under ``root``: one shard per rank, then (if ``commit``) the manifest.

    ``root`` is a local directory or any URI ``open_storage`` takes (``s3://...``).
    ``corrupt`` records a wrong size for rank 0's shard in the manifest. ``meshes``: the
    manifest's device meshes (``[{"shape": [2, 2], "dim_names": [...] or None}]``; default none).
    """
    storage = open_storage(root) if "://" in root else LocalStorage(root, fsync=False)
    records = []
    for rank in range(world_size):
        data = bytes([rank % 256]) * (shard_bytes + rank)
        storage.put(data_file_key(step, rank, shard_name(rank, incarnation), None), data)
        recorded = len(data) + (1 if corrupt and rank == 0 else 0)
        records.append(FileRecord(path=shard_name(rank, incarnation), rank=rank, size_bytes=recorded, digest="0" * 64))
    if not commit:
        return
    manifest = Manifest(
        step=step,
        world_size=world_size,
        files=records,
        tensors={},
        state={},
        rank_state=[{} for _ in range(world_size)],
        reason=reason,
        created_unix_s=time.time() if created_unix_s is None else created_unix_s,
        run_id=run_id,
        incarnation=incarnation,
        meshes=list(meshes or []),
    )
    storage.put_if_absent(manifest_key(step, incarnation), manifest.to_json())
