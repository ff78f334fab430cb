"""A local checkpoint root: a directory given as a path or a ``file://`` URI."""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Any

from spotrun.errors import ObjectNotFoundError
from spotrun.storage.local import LocalStorage
from spotrun.storage.location import ScratchSibling, StorageLocation


class LocalLocation(StorageLocation):
    """A directory (created on the first write); an endpoint is ignored."""

    @property
    def uri(self) -> str:
        return os.path.abspath(os.path.expanduser(self.given_uri.removeprefix("file://")))

    def open(self, *, timeout_s: float | None = None, **options: Any) -> LocalStorage:
        # A local filesystem has no request timeouts to shorten: timeout_s does not apply.
        return LocalStorage(self.given_uri.removeprefix("file://"), **options)

    def scratch_sibling(self, label: str) -> ScratchSibling:
        directory = tempfile.mkdtemp(prefix=f"spotrun-{label}-")
        return ScratchSibling(location=LocalLocation(directory), temporary_dir=directory)

    def blocked_by_file(self) -> bool:
        return os.path.exists(self.uri) and not os.path.isdir(self.uri)

    def _check_exists(self) -> None:
        if not os.path.isdir(self.uri):
            what = "not a directory" if os.path.exists(self.uri) else "no such directory"
            raise ObjectNotFoundError(errno.ENOENT, f"{what}: {self.uri}")
