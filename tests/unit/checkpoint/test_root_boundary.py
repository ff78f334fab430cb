"""The checkpoint root is a boundary (issue 21, item 4): a symbolic link below a local root is
never followed, by a restore, `spotrun ls`, `verify`, `export` or `gc`.

Each case replaces one thing of the newest step (a data file, a rank index, the manifest, the
whole step directory) by a link to a copy elsewhere with identical bytes, so only the boundary
can refuse it: the step is corrupt with a one-line reason naming it, a restore resumes the
previous step bit-exactly, `export --step` refuses it, and `gc` deletes nothing outside the
root. A FIFO in place of a data file is refused the same way, without blocking.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.retention import delete_step
from spotrun.cli import main
from spotrun.errors import UnsafeObjectError
from spotrun.storage import LocalStorage
from tests.support.paths import REPO

ROOT = REPO
STEP_DIR = "step-000000002"


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 48)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> tuple[pathlib.Path, dict, dict]:
    """A root with steps 1 and 2 (different weights), and each step's weights."""
    root = tmp_path_factory.mktemp("boundary") / "ck"
    model = net()
    ckpt = spotrun.Checkpointer(
        {"model": model}, storage=LocalStorage(str(root), fsync=False), handle_signals=False, background_saves=False
    )
    ckpt.restore()
    ckpt.save(1)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.save(2)
    ckpt.close()
    return root, first, {k: v.clone() for k, v in model.state_dict().items()}


def one_file(step_dir: pathlib.Path, pattern: str) -> pathlib.Path:
    [found] = step_dir.glob(pattern)
    return found


def linked_away(root: pathlib.Path, outside: pathlib.Path, what: str) -> pathlib.Path:
    """Replace ``what`` of step 2 by a link to an identical copy in ``outside``; the copy's path."""
    step_dir = root / STEP_DIR
    if what == "step directory":
        copy = outside / STEP_DIR
        shutil.copytree(step_dir, copy)
        shutil.rmtree(step_dir)
        step_dir.symlink_to(copy, target_is_directory=True)
        return copy
    pattern = {
        "data file": "rank-*[0-9].safetensors",
        "index file": "rank-*.index.json",
        "manifest": "manifest.*.json",
    }[what]
    original = one_file(step_dir, pattern)
    copy = outside / original.name
    shutil.copy2(original, copy)
    original.unlink()
    original.symlink_to(copy)
    return copy


def tree(path: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def cli(capsys, *args: str) -> tuple[int, list[str], list[str]]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("what", ["data file", "index file", "manifest", "step directory"])
def test_a_link_leaving_the_root_makes_the_step_corrupt_for_every_tool_and_the_restore(
    two_steps, tmp_path, capsys, caplog, what
):
    """Issue 21 item 4: a data file, an index, the manifest or the step directory linked to an
    identical copy outside the root is not followed: ls and verify say the step is corrupt with
    one line naming it, export --step refuses it, gc deletes nothing outside, and a restore
    resumes step 1 bit-exactly, saying once why it skipped step 2."""
    saved_root, first, _second = two_steps
    root = pathlib.Path(shutil.copytree(saved_root, tmp_path / "ck"))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    linked_away(root, outside, what)
    outside_before = tree(outside)

    code, out, err = cli(capsys, "ls", str(root), "--json")
    assert (code, err) == (0, [])
    listed = {s["step"]: s for s in json.loads("\n".join(out))}
    assert listed[1]["status"] == "complete"
    assert listed[2]["status"] == "corrupt"
    assert "symbolic link" in listed[2]["problem"] and "\n" not in listed[2]["problem"]

    code, out, err = cli(capsys, "verify", str(root))
    assert code == 1 and err == []
    problem = [line for line in out if line.startswith("step 2: ")]
    assert problem and "symbolic link" in problem[0] and STEP_DIR in problem[0]

    code, out, err = cli(capsys, "export", str(root), str(tmp_path / "hf"), "--step", "2")
    assert code == 2 and len(err) == 1 and "symbolic link" in err[0]
    code, out, err = cli(capsys, "export", str(root), str(tmp_path / "hf"))  # the newest complete: step 1
    assert code == 0 and out[0].startswith("exported step 1,")

    code, out, err = cli(capsys, "gc", str(root), "--keep-last", "1", "--incomplete-older-than-s", "0")
    assert code == 0 and all("WARNING --incomplete-older-than-s 0" in line for line in err)
    assert any(line.startswith("step 2 ") and "corrupt" in line and "kept" in line for line in out)
    assert tree(outside) == outside_before

    model = net()
    ckpt = spotrun.Checkpointer(
        {"model": model}, storage=LocalStorage(str(root), fsync=False), handle_signals=False, background_saves=False
    )
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        assert ckpt.restore() == 1
    ckpt.close()
    assert same_bits(model.state_dict(), first)
    assert tree(outside) == outside_before
    # The in-process CLI calls above gave spotrun's logger its own stderr handler.
    said = [
        line
        for line in capsys.readouterr().err.splitlines() + [r.getMessage() for r in caplog.records]
        if "step 2" in line
    ]
    assert len(said) == 1 and "corrupt" in said[0] and "symbolic link" in said[0], said


def test_a_deletion_through_a_linked_step_directory_is_refused_and_deletes_nothing_outside(two_steps, tmp_path):
    """Issue 21 item 4: gc's and retention's deletion (delete_step, Storage.delete) never
    reaches a file outside the root through a step directory that is a link."""
    root = pathlib.Path(shutil.copytree(two_steps[0], tmp_path / "ck"))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    copy = linked_away(root, outside, "step directory")
    before = tree(outside)
    storage = LocalStorage(str(root), fsync=False)
    name = one_file(copy, "rank-*[0-9].safetensors").name
    with pytest.raises(UnsafeObjectError, match="symbolic link"):
        storage.delete(f"{STEP_DIR}/{name}")
    with pytest.raises(UnsafeObjectError, match="symbolic link"):
        delete_step(storage, 2, why="test")
    with pytest.raises(UnsafeObjectError, match="symbolic link"):
        storage.put(f"{STEP_DIR}/planted", b"x")  # nor does a write go through it
    assert tree(outside) == before


def test_a_fifo_in_place_of_a_data_file_is_refused_without_blocking(two_steps, tmp_path):
    """Issue 21 item 4: a FIFO where a shard file should be (opening it for reading would wait
    for a writer forever) makes the step corrupt; a restore in a subprocess, bounded, resumes
    step 1."""
    root = pathlib.Path(shutil.copytree(two_steps[0], tmp_path / "ck"))
    data = one_file(root / STEP_DIR, "rank-*[0-9].safetensors")
    data.unlink()
    os.mkfifo(data)
    script = (
        "import sys, spotrun, torch\n"
        "from spotrun.storage import LocalStorage\n"
        "torch.manual_seed(0); m = torch.nn.Linear(64, 48)\n"
        "c = spotrun.Checkpointer({'model': m}, storage=LocalStorage(sys.argv[1], fsync=False),"
        " handle_signals=False, background_saves=False)\n"
        "print('restored', c.restore()); c.close()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restored 1" in proc.stdout
    info = catalog.inspect_step(LocalStorage(str(root)), 2)
    assert info is not None and info.status == "corrupt" and "not a regular file" in info.problem


def test_the_local_backend_lists_links_as_refused_entries_and_opens_none(tmp_path):
    """Issue 21 item 4, at the storage interface: a listing shows a link (to a file or to a
    directory) as one refused entry without descending into it, and get, read_into, stat
    and exists refuse every key reached through one; the root's own path may be a link."""
    outside = tmp_path / "elsewhere"
    (outside / "sub").mkdir(parents=True)
    (outside / "secret").write_bytes(b"not yours")
    (outside / "sub" / "deep").write_bytes(b"nor this")
    real_root = tmp_path / "real-root"
    storage = LocalStorage(str(real_root), fsync=False)
    storage.put("step-000000001/ok", b"fine")
    (real_root / "step-000000001" / "file-link").symlink_to(outside / "secret")
    (real_root / "dir-link").symlink_to(outside / "sub", target_is_directory=True)
    linked_root = tmp_path / "root-by-link"
    linked_root.symlink_to(real_root, target_is_directory=True)

    listed = {o.key: o.refused for o in LocalStorage(str(linked_root)).list()}
    assert listed.keys() == {"step-000000001/ok", "step-000000001/file-link", "dir-link"}
    assert listed["step-000000001/ok"] is None
    assert "symbolic link" in listed["step-000000001/file-link"] and "symbolic link" in listed["dir-link"]
    assert [o.key for o in storage.list("dir-link/")] == ["dir-link"]  # the link on the way, not what it holds
    for key in ("step-000000001/file-link", "dir-link/deep"):
        with pytest.raises(UnsafeObjectError, match="symbolic link"):
            storage.get(key)
        with pytest.raises(UnsafeObjectError, match="symbolic link"):
            storage.read_into(key, 0, [memoryview(bytearray(4))])
        with pytest.raises(UnsafeObjectError, match="symbolic link"):
            storage.stat(key)
    assert storage.get("step-000000001/ok") == b"fine"
    storage.delete("step-000000001/file-link")  # the link itself goes; what it pointed at stays
    assert (outside / "secret").read_bytes() == b"not yours"
