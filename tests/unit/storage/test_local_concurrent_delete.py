"""A write into a directory that another writer's delete empties and removes at the same moment
still lands (two supervisors' preflight probes on one root: a `spotrun run` per node)."""

from __future__ import annotations

import os
import threading

from spotrun.storage import LocalStorage, local


def test_a_write_whose_directory_a_concurrent_delete_removes_still_lands(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path), fsync=False)
    real_close_all = local.beneath.close_all
    removed = []

    def close_all_then_the_other_writer_deletes(fds):
        real_close_all(fds)
        if not removed:  # between making the directories and creating the file
            os.rmdir(tmp_path / ".spotrun-preflight")
            removed.append(True)

    monkeypatch.setattr(local.beneath, "close_all", close_all_then_the_other_writer_deletes)
    storage.put(".spotrun-preflight/probe-node-1", b"probe")
    assert removed and storage.get(".spotrun-preflight/probe-node-1") == b"probe"


def test_two_writers_probing_and_deleting_in_one_directory_never_fail(tmp_path):
    storage = LocalStorage(str(tmp_path), fsync=False)
    errors: list[Exception] = []

    def probe(name: str) -> None:
        try:
            for i in range(300):
                key = f".spotrun-preflight/{name}-{i}"
                storage.put(key, b"x")
                storage.delete(key)  # removes the directory when it empties
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    writers = [threading.Thread(target=probe, args=(n,)) for n in ("node0", "node1")]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert errors == []
