"""The drill's reference run's checkpoint root (:class:`ScratchRoot`, :func:`open_scratch_root`)
and the step it starts from (:func:`copy_step`)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import file_key
from spotrun.errors import ConfigError
from spotrun.storage import Storage, StorageLocation, parse_location

#: Names the reference run's root beside the checkpoint root (:meth:`StorageLocation.scratch_sibling`).
REFERENCE_LABEL = "drill-reference"


@dataclass
class ScratchRoot:
    """The reference run's checkpoint root.

    Attributes:
        uri: the root URI, as given to ``spotrun run --checkpoint-uri``.
        storage: the storage under it.
        temporary_dir: the local temporary directory created for it, if any (deleted whole).
    """

    uri: str
    storage: Storage
    temporary_dir: str | None = None

    def delete(self) -> int:
        """Delete every object under the root (the temporary directory with it); returns how
        many objects were deleted.

        Raises:
            StorageError: listing or deleting failed.
        """
        count = len(self.storage.list(""))
        if self.temporary_dir is not None:
            shutil.rmtree(self.temporary_dir, ignore_errors=True)
            return count
        for info in self.storage.list(""):
            self.storage.delete(info.key)
        return count


def open_scratch_root(location: StorageLocation, override_uri: str | None) -> ScratchRoot:
    """Choose and open the reference run's root beside the checkpoint root ``location``.

    ``override_uri`` when given (it must hold no objects yet; same endpoint as ``location``);
    else a new root beside it (:meth:`~spotrun.storage.StorageLocation.scratch_sibling`: a new
    temporary directory for a local root, ``s3://bucket/prefix-drill-reference/<random>`` for
    ``s3://bucket/prefix``).

    Raises:
        ConfigError: ``override_uri`` is malformed or already holds objects.
        StorageError: listing ``override_uri`` failed.
    """
    if override_uri is not None:
        scratch = parse_location(override_uri, endpoint_url=location.endpoint_url).open()
        if scratch.list(""):
            raise ConfigError(f"the reference root {override_uri} already holds objects; give an empty one")
        return ScratchRoot(uri=override_uri, storage=scratch)
    sibling = location.scratch_sibling(REFERENCE_LABEL)
    return ScratchRoot(uri=sibling.location.uri, storage=sibling.location.open(), temporary_dir=sibling.temporary_dir)


def copy_step(source: Storage, target: Storage, step: int) -> int:
    """Copy the files and the valid manifest of ``step`` from ``source`` to ``target``, the manifest last (so the
    step commits in ``target`` only once its shards are there); returns the number of objects.

    Each object is read whole into memory (one shard at a time).

    Raises:
        ObjectNotFoundError: ``source`` has no manifest for ``step``.
        ObjectExistsError: ``target`` already has a manifest for ``step``.
        StorageError: a read or write failed.
    """
    info = catalog.committed(source, step)
    keys = [file_key(step, record, info.manifest) for record in info.manifest.files]
    for key in keys:
        target.put(key, source.get(key))
    target.put_if_absent(info.manifest_key, source.get(info.manifest_key))
    return len(keys) + 1
