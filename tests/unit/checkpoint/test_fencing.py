"""Issue 8, section 1 (a) and (b): a committed step's bytes never change, and a newer
incarnation of the job fences every older writer on the same root.

Two incarnations run here as two Checkpointers in one process on the same local root (the
multi-process version, with a killed supervisor, is in tests/e2e/test_zombie_incarnation.py).
The older one plays the zombie: it keeps training and saving after the newer one started.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import spotrun
import spotrun.control.env
from spotrun.checkpoint import catalog, fencing
from spotrun.checkpoint.layout import parse_manifest_name, step_dir
from spotrun.control import files as control
from spotrun.errors import FencedError
from spotrun.storage import LocalStorage


class HookedStorage(LocalStorage):
    """A local store that runs ``hook(key)`` before each write (to interleave two writers)."""

    def __init__(self, root: str, hook: Callable[[str], None]) -> None:
        super().__init__(root, fsync=False)
        self.hook = hook

    def _put(self, key, data):
        self.hook(key)
        super()._put(key, data)

    def _put_if_absent(self, key, data):
        self.hook(key)
        super()._put_if_absent(key, data)

    def _put_stream(self, key, source, chunk_bytes, on_chunk):
        self.hook(key)
        super()._put_stream(key, source, chunk_bytes, on_chunk)


def make(storage) -> tuple[spotrun.Checkpointer, dict]:
    weights = {"w": torch.zeros(32)}
    return spotrun.Checkpointer({"weights": weights}, storage=storage, handle_signals=False), weights


def train_to(weights: dict, step: int, writer: float) -> None:
    """State at ``step`` of a given writer (so files of two writers differ)."""
    weights["w"] = torch.full((32,), step + writer)


def committed_file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file that a valid manifest references, by path."""
    storage = LocalStorage(str(root))
    hashes = {}
    for info in catalog.list_steps(storage):
        if info.status != catalog.COMPLETE:
            continue
        for record in info.manifest.files:
            path = root / step_dir(info.step) / record.path
            hashes[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        hashes[str(root / info.manifest_key)] = hashlib.sha256((root / info.manifest_key).read_bytes()).hexdigest()
    return hashes


def manifests_of(root: Path, step: int) -> list[str]:
    return sorted(p.name for p in (root / step_dir(step)).iterdir() if parse_manifest_name(p.name)[0])


def test_1_zombie_incarnation_cannot_commit_after_a_newer_start(tmp_path):
    old, old_w = make(LocalStorage(str(tmp_path), fsync=False))
    assert old.restore() == 0 and old.incarnation == 0
    for step in (5, 10):
        train_to(old_w, step, 0.0)
        old.save(step)

    new, new_w = make(LocalStorage(str(tmp_path), fsync=False))
    assert new.restore() == 10 and new.incarnation == 1
    assert torch.equal(new_w["w"], torch.full((32,), 10.0))
    before = committed_file_hashes(tmp_path)

    train_to(old_w, 15, 0.0)
    with pytest.raises(FencedError, match="incarnation 1 .* started"):
        old.save(15)
    assert not (tmp_path / step_dir(15)).exists(), "a fenced writer must not even write shards"

    train_to(new_w, 15, 0.5)
    new.save(15)
    assert committed_file_hashes(tmp_path).items() >= before.items()
    assert {s.step: s.status for s in catalog.list_steps(LocalStorage(str(tmp_path)))} == {
        5: "complete",
        10: "complete",
        15: "complete",
    }
    third, third_w = make(LocalStorage(str(tmp_path), fsync=False))
    assert third.restore() == 15 and torch.equal(third_w["w"], torch.full((32,), 15.5))


def test_1_zombie_commit_racing_a_newer_start_is_fenced(tmp_path):
    """A zombie's commit racing a newer start is fenced, and the newer one commits the same step.

    The zombie's check passes, then the newer start claims, then the zombie's manifest
    lands: readers ignore it (fenced), and the newer incarnation still commits step 15
    under its own names; nothing the newer one committed changes."""
    root = str(tmp_path)
    holder: dict = {}

    def start_new_before_the_old_commit(key: str) -> None:
        if key == f"{step_dir(15)}/manifest.i000000000.json" and "new" not in holder:
            holder["new"] = make(LocalStorage(root, fsync=False))
            assert holder["new"][0].restore() == 10

    old, old_w = make(HookedStorage(root, start_new_before_the_old_commit))
    old.restore()
    for step in (5, 10):
        train_to(old_w, step, 0.0)
        old.save(step)
    train_to(old_w, 15, 0.0)
    old.save(15)  # the race: its check saw no newer incarnation; its manifest is written
    new, new_w = holder["new"]
    assert new.incarnation == 1

    storage = LocalStorage(root)
    info = catalog.inspect_step(storage, 15)
    assert info.status == catalog.FENCED
    assert "committed by incarnation 0 after incarnation 1 started from step 10" in info.problem
    assert catalog.newest_complete(storage).step == 10

    train_to(new_w, 15, 0.5)
    new.save(15)  # never blocked by the zombie's step 15
    hashes = committed_file_hashes(tmp_path)
    assert manifests_of(tmp_path, 15) == ["manifest.i000000000.json", "manifest.i000000001.json"]
    info = catalog.inspect_step(storage, 15)
    assert info.status == catalog.COMPLETE and info.manifest.incarnation == 1

    train_to(old_w, 20, 0.0)
    with pytest.raises(FencedError):
        old.save(20)
    assert committed_file_hashes(tmp_path) == hashes
    reader, weights = make(LocalStorage(root, fsync=False))
    assert reader.restore() == 15 and torch.equal(weights["w"], torch.full((32,), 15.5))


def test_1_slow_zombie_shard_writes_never_replace_a_committed_step(tmp_path):
    """The issue's worst case: the old incarnation's shard writes of step 15 land after the
    new incarnation committed step 15. They go to the old incarnation's own file names, so
    the committed step keeps its bytes and still loads; the old commit is refused."""
    root = str(tmp_path)
    holder: dict = {}

    def new_incarnation_commits_first(key: str) -> None:
        if key.startswith(f"{step_dir(15)}/rank-") and "new" not in holder:
            new, new_w = make(LocalStorage(root, fsync=False))
            holder["new"] = new
            assert new.restore() == 10
            train_to(new_w, 15, 0.5)
            new.save(15)
            holder["hashes"] = committed_file_hashes(tmp_path)

    old, old_w = make(HookedStorage(root, new_incarnation_commits_first))
    old.restore()
    for step in (5, 10):
        train_to(old_w, step, 0.0)
        old.save(step)
    train_to(old_w, 15, 0.0)
    with pytest.raises(FencedError):
        old.save(15)  # its shard lands (under its own name), its commit is refused
    assert len(list((tmp_path / step_dir(15)).glob("rank-00000.*.safetensors"))) == 2  # both incarnations
    assert committed_file_hashes(tmp_path) == holder["hashes"]
    assert manifests_of(tmp_path, 15) == ["manifest.i000000001.json"]
    reader, weights = make(LocalStorage(root, fsync=False))
    assert reader.restore() == 15 and torch.equal(weights["w"], torch.full((32,), 15.5))


def test_1_incarnation_numbers_are_claimed_once_each(tmp_path):
    storage = LocalStorage(str(tmp_path), fsync=False)
    claimed = [fencing.claim(storage, resumed_step=None, run_id="r", at_least=0).incarnation for _ in range(3)]
    assert claimed == [0, 1, 2]
    assert fencing.claim(storage, resumed_step=7, run_id="r", at_least=10).incarnation == 10
    table = fencing.read_fences(storage)
    assert table.resumed == {0: None, 1: None, 2: None, 10: 7}
    record = json.loads((tmp_path / "incarnations" / "incarnation-000000010.json").read_text())
    assert record["resumed"] == {"0": None, "1": None, "2": None, "10": 7}  # one read gives all


@pytest.mark.parametrize(
    "writer, step, fenced_by",
    [
        (0, 10, None),  # at or below every newer start's resume step: valid
        (0, 11, 1),  # past incarnation 1's resume step: a zombie's commit
        (1, 12, None),  # incarnation 1 itself, past its own resume step
        (1, 13, 2),  # incarnation 2 resumed from 12
        (1, 21, 2),  # the first newer start that fences it is named
        (2, 5, None),
        (3, 25, None),  # the newest writes freely
        (None, 10, None),  # a version-1 manifest (no incarnation in its name)
        (None, 11, 0),
    ],
)
def test_1_fencing_rule_table(writer, step, fenced_by):
    fences = fencing.Fences({0: 10, 1: 10, 2: 12, 3: 20})
    assert fences.fenced_by(writer, step) == fenced_by


def test_1_a_fresh_start_fences_later_commits_of_every_older_incarnation(tmp_path):
    """Started over on purpose (the old steps deleted)? Then the old history is gone: a
    zombie of the old job cannot sneak a step back in."""
    storage = LocalStorage(str(tmp_path), fsync=False)
    fencing.claim(storage, resumed_step=None, run_id="r")  # incarnation 0
    fencing.claim(storage, resumed_step=None, run_id="r")  # incarnation 1: a fresh start
    assert fencing.read_fences(storage).fenced_by(0, 1) == 1


def test_a_fenced_worker_tells_its_supervisor_and_its_launch_claims_no_incarnation_again(tmp_path, monkeypatch):
    """C20 (worker side): under `spotrun run` (a control directory), a save that a newer start
    fenced writes `fenced.json` naming that start (number, host, process) before the
    FencedError reaches the script; a restart of the workers within that launch (torchrun's own
    --max-restarts) raises FencedError at restore() instead of claiming an incarnation that
    would fence the newer copy in turn. Without a control directory nothing is written."""
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    root = tmp_path / "root"
    monkeypatch.setenv(spotrun.control.env.CONTROL_DIR, str(control_dir))
    old, old_w = make(LocalStorage(str(root), fsync=False))
    assert old.restore() == 0 and old.incarnation == 0
    monkeypatch.delenv(spotrun.control.env.CONTROL_DIR)
    new, _ = make(LocalStorage(str(root), fsync=False))
    assert new.restore() == 0 and new.incarnation == 1
    assert control.read_fence_report(str(control_dir)) is None

    train_to(old_w, 5, 0.0)
    with pytest.raises(FencedError, match="incarnation 1 .* started"):
        old.save(5)
    report = control.read_fence_report(str(control_dir))
    assert (report.incarnation, report.newer_incarnation, report.newer_host, report.newer_pid) == (
        0,
        1,
        socket.gethostname(),
        os.getpid(),
    )
    assert "incarnation 1 of this job started" in report.message

    monkeypatch.setenv(spotrun.control.env.CONTROL_DIR, str(control_dir))
    restarted, _ = make(LocalStorage(str(root), fsync=False))
    with pytest.raises(FencedError, match="launch was fenced by incarnation 1"):
        restarted.restore()
    assert fencing.read_fences(LocalStorage(str(root))).newest == 1  # nothing claimed
    assert control.read_fence_report(str(control_dir)) == report  # the first report stays

    monkeypatch.delenv(spotrun.control.env.CONTROL_DIR)
    third, _ = make(LocalStorage(str(root), fsync=False))
    assert third.restore() == 0 and third.incarnation == 2
    with pytest.raises(FencedError, match="incarnation 2 .* started"):  # plain torchrun: the error as before
        new.save(5)
