"""Where a committed step's files are (their names carry the writer's incarnation)."""

from __future__ import annotations

from pathlib import Path

from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import file_key
from spotrun.storage import LocalStorage, Storage


def storage_at(path: Path | str) -> LocalStorage:
    """A local root without fsync: a test's checkpoints need not outlive a power cut."""
    return LocalStorage(str(path), fsync=False)


def shard_key(storage: Storage, step: int, rank: int = 0) -> str:
    """Storage key of the (first) shard file that ``rank`` wrote for a complete step."""
    info = catalog.committed(storage, step)
    return file_key(step, next(f for f in info.manifest.files if f.rank == rank), info.manifest)


def manifest_path(root: Path | str, step: int) -> Path:
    """The valid manifest of a complete step under a local root."""
    return Path(root) / catalog.committed(LocalStorage(str(root)), step).manifest_key


def shard_path(root: Path | str, step: int, rank: int = 0) -> Path:
    """The (first) shard file that ``rank`` wrote for a complete step under a local root."""
    return Path(root) / shard_key(LocalStorage(str(root)), step, rank)


def has_manifest(storage: Storage, step: int) -> bool:
    """Whether any manifest (valid or not, of any incarnation) exists for ``step``."""
    from spotrun.checkpoint.layout import parse_manifest_name, step_dir

    prefix = f"{step_dir(step)}/"
    return any(parse_manifest_name(o.key[len(prefix) :])[0] for o in storage.list(prefix))


def chunk_files(root: Path | str, step: int) -> dict[str, set[str]]:
    """Tensor name -> the shard files holding its chunks, read from the writers' index files
    of ``step`` (format 4) under a local checkpoint ``root``."""
    import json

    step_dir = Path(root) / f"step-{step:09d}"
    found: dict[str, set[str]] = {}
    for index_file in step_dir.glob("rank-*.index.json"):
        index = json.loads(index_file.read_text())
        for key, (file_index, _begin, _end) in index["chunks"].items():
            found.setdefault(key.split("@")[0], set()).add(index["files"][file_index]["path"])
    return found


def data_files(manifest_doc: dict) -> list[dict]:
    """The records of a manifest's shard files (format 4 also lists one index file per rank)."""
    return [f for f in manifest_doc["files"] if f["path"].endswith(".safetensors")]
