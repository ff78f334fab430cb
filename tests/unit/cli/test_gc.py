"""``spotrun gc``: the retention rule offline, dead saves and abandoned uploads by age, never a
save that may still be running; and a SIGKILL at every point of a deletion (gc's, which is
the Checkpointer's too: :func:`spotrun.checkpoint.retention.delete_step`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import data_file_key, shard_name, step_dir
from spotrun.cli import main
from spotrun.storage import LocalStorage, open_storage
from tests.support.crash_roots import Scenario, copy_root
from tests.support.fault_proxy import FaultProxy
from tests.support.paths import JOBS
from tests.support.s3_server import make_client

WORKER = JOBS / "gc_killed.py"
HOUR_S = 3600.0


def statuses(storage) -> dict[int, str]:
    return {s.step: s.status for s in catalog.list_steps(storage)}


def save_steps(storage, steps: list[int], *, restore: bool = False) -> None:
    """Save ``steps`` (the tiny state holds the step number), after a restore if asked."""
    state = {"model": {"w": torch.zeros(4)}}
    ckpt = spotrun.Checkpointer(state, storage=storage, handle_signals=False)
    if restore:
        ckpt.restore()
    for step in steps:
        state["model"]["w"].fill_(float(step))
        ckpt.save(step)
    ckpt.close()


def restored(storage) -> tuple[int, torch.Tensor]:
    state = {"model": {"w": torch.zeros(4)}}
    step = spotrun.Checkpointer(state, storage=storage, handle_signals=False).restore()
    return step, state["model"]["w"]


def gc(*args: str) -> tuple[int, list[str], str]:
    """``spotrun gc ARGS`` in a process of its own: (exit code, stdout lines, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "gc", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPOTRUN_PROGRESS": "0"},
    )
    return done.returncode, done.stdout.splitlines(), done.stderr


def backdate(path: Path, age_s: float) -> None:
    at = time.time() - age_s
    os.utime(path, (at, at))


# --- what gc deletes -------------------------------------------------------------------------


def test_gc_deletes_by_the_rule_and_by_age_and_keeps_what_must_stay(tmp_path):
    """gc deletes by the rule and by age, and keeps the resume source, young saves and corrupt
    steps."""
    root = tmp_path / "ck"
    storage = LocalStorage(str(root))
    save_steps(storage, [10, 20, 30])
    save_steps(storage, [40, 50, 60, 70], restore=True)  # the newest start resumed from 30
    shard_70 = root / data_file_key(70, 0, shard_name(0, 1), None)
    shard_70.write_bytes(shard_70.read_bytes()[:-1])  # a truncated file: step 70 is corrupt
    for step, age_s in ((80, 2 * HOUR_S), (90, 10.0)):  # a dead save and one that may still be running
        (root / step_dir(step)).mkdir()
        for name in ("rank-00000.i000000002.safetensors", ".rank-00001.i000000002.safetensors.tmp-77-abcdef01"):
            (root / step_dir(step) / name).write_bytes(b"partial")
            backdate(root / step_dir(step) / name, age_s)  # 2 h, or 10 s (a few more by the time gc runs)

    code, lines, stderr = gc(str(root), "--keep-last", "2", "--keep-every", "20")
    assert code == 0, stderr
    size = shard_70.stat().st_size
    expected = [  # regular expressions: the ages are seconds measured by gc
        r"step 10        complete   deleted       not one of the 2 newest, not divisible by 20",
        r"step 20        complete   kept          divisible by 20",
        r"step 30        complete   kept          the step the newest start \(incarnation 1\) resumed from",
        r"step 40        complete   kept          divisible by 20",
        r"step 50        complete   kept          one of the 2 newest",
        r"step 60        complete   kept          the newest complete step; divisible by 20",
        rf"step 70        corrupt    kept          rank-00000.i000000001.safetensors has {size} bytes, manifest "
        rf"recorded {size + 1}; reported, never deleted by gc",
        r"step 80        incomplete deleted       no manifest: the save never committed; newest object 72\d\d s old "
        r"\(threshold 3600 s\)",
        r"step 90        incomplete kept          newest object \d\d s old, under the 3600 s threshold: a save may "
        r"still be writing it",
        rf"temporary file {step_dir(80)}/.rank-00001.i000000002.safetensors.tmp-77-abcdef01: removed, 72\d\d s old "
        r"\(threshold 3600 s\)",
        rf"temporary file {step_dir(90)}/.rank-00001.i000000002.safetensors.tmp-77-abcdef01: kept, \d\d s old, "
        r"under the 3600 s threshold: a save may still be writing it",
    ]
    assert len(lines) == len(expected) + 1, lines
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    assert lines[-1].startswith("deleted 2 step(s) (4 objects, ")
    assert lines[-1].endswith(
        f" and 1 unfinished write(s); kept 7 step(s) and 1 unfinished write(s) under {root}; "
        "corrupt, look at them: step(s) 70"
    )
    assert statuses(storage) == {
        20: "complete",
        30: "complete",
        40: "complete",
        50: "complete",
        60: "complete",
        70: "corrupt",
        90: "incomplete",
    }
    assert not (root / step_dir(80)).exists() and not (root / step_dir(10)).exists()
    assert sorted(p.name for p in (root / step_dir(90)).iterdir()) == [
        ".rank-00001.i000000002.safetensors.tmp-77-abcdef01",
        "rank-00000.i000000002.safetensors",
    ]


def test_gc_dry_run_says_what_it_would_delete_and_deletes_nothing(tmp_path):
    storage = LocalStorage(str(tmp_path / "ck"))
    save_steps(storage, [1, 2, 3])
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    code, lines, stderr = gc(str(tmp_path / "ck"), "--keep-last", "1", "--dry-run")
    assert code == 0, stderr
    assert [line.split()[3] for line in lines[:3]] == ["would", "would", "kept"]
    assert lines[-1].startswith("would delete 2 step(s) (6 objects, ")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--keep-every", "5"], "keep_every=5 needs keep_last"),
        (["--keep-last", "2", "--incomplete-older-than-s", "-1"], "--incomplete-older-than-s must be >= 0"),
    ],
)
def test_gc_refuses_bad_options_and_deletes_nothing(tmp_path, args, message):
    storage = LocalStorage(str(tmp_path / "ck"))
    save_steps(storage, [1, 2])
    code, lines, stderr = gc(str(tmp_path / "ck"), *args)
    assert code == 2 and lines == []
    assert stderr.strip().splitlines()[-1].startswith(f"spotrun: error: {message}")
    assert statuses(storage) == {1: "complete", 2: "complete"}
    code, _, stderr = gc(str(tmp_path / "nowhere"))
    assert code == 2 and "no such directory" in stderr


def test_gc_on_s3_aborts_abandoned_uploads_and_deletes_old_incomplete_steps(s3_bucket, monkeypatch):
    """gc on S3 aborts an abandoned upload and deletes an old incomplete step, but not a save in
    progress.

    Through the fault proxy, which gives each upload the time it was initiated (moto
    answers 2010-11-10 for all of them) and makes step 30's objects and uploads 2 h old."""
    client = make_client(s3_bucket.endpoint_url)
    with FaultProxy(s3_bucket.endpoint_url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        uri = f"{s3_bucket.uri}/job"
        storage = open_storage(uri)
        save_steps(storage, [10, 20])
        proxied = make_client(proxy.url)
        for step in (30, 40):  # 30: a save that died 2 h ago; 40: one still writing its shards now
            key = f"job/{step_dir(step)}/rank-00000.i000000001.safetensors"
            proxied.put_object(Bucket=s3_bucket.name, Key=key.replace("rank-00000", "rank-00001"), Body=b"partial")
            upload = proxied.create_multipart_upload(Bucket=s3_bucket.name, Key=key)
            proxied.upload_part(
                Bucket=s3_bucket.name, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024
            )
        proxy.backdate(2 * HOUR_S, lambda key: key.startswith(f"job/{step_dir(30)}/"))

        code, lines, stderr = gc(uri)
        assert code == 0, stderr
    expected = [  # regular expressions: the ages are seconds measured by gc
        r"step 10        complete   kept          no keep_last: every complete step is kept",
        r"step 20        complete   kept          no keep_last: every complete step is kept",
        r"step 30        incomplete deleted       no manifest: the save never committed; newest object 72\d\d s "
        r"old \(threshold 3600 s\)",
        r"step 40        incomplete kept          newest object \d+ s old, under the 3600 s threshold: a save may "
        r"still be writing it",
        rf"multipart upload {step_dir(30)}/rank-00000.i000000001.safetensors: aborted, 72\d\d s old "
        r"\(threshold 3600 s\)",
        rf"multipart upload {step_dir(40)}/rank-00000.i000000001.safetensors: kept, \d+ s old, under the 3600 s "
        r"threshold: a save may still be writing it",
        r"deleted 1 step\(s\) \(1 objects, 7 B\) and 1 unfinished write\(s\); kept 3 step\(s\) and 1 "
        rf"unfinished write\(s\) under {uri}",
    ]
    assert len(lines) == len(expected), lines
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_bucket.endpoint_url)  # the proxy is gone: straight to moto
    uploads = client.list_multipart_uploads(Bucket=s3_bucket.name, Prefix="job/").get("Uploads", [])
    assert [u["Key"] for u in uploads] == [f"job/{step_dir(40)}/rank-00000.i000000001.safetensors"]
    assert statuses(open_storage(uri)) == {10: "complete", 20: "complete", 40: "incomplete"}


# --- a kill in the middle of a deletion --------------------------------------------------------


def _killed_gc(points_file: Path, kill_at: int | None, backend: str, where: str, uri: str) -> int:
    done = subprocess.run(
        [
            sys.executable,
            str(WORKER),
            str(points_file),
            "none" if kill_at is None else str(kill_at),
            backend,
            where,
            "--",
            uri,
            "--keep-last",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPOTRUN_PROGRESS": "0"},
    )
    assert kill_at is not None or done.returncode == 0, done.stderr
    return done.returncode


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_kill_at_any_point_of_a_deletion_leaves_no_corrupt_step(tmp_path, request, backend):
    """A kill at any point of a deletion leaves complete or clearly incomplete steps, and the next
    start resumes.

    ``spotrun gc --keep-last 1`` deletes step 10 of (10, 20), SIGKILLed at each persistence
    point in turn (every file-system call under the root; after every S3 request that changes
    the bucket: the states a kill before one leaves are those after the one before, or the
    untouched root), each time on a fresh copy of the root. After each kill: step 20
    is complete, step 10 is complete or lists as incomplete (being deleted), nothing is
    corrupt; a start resumes from step 20 exactly; the next gc finishes the deletion."""
    bucket = request.getfixturevalue("s3_bucket").name if backend == "s3" else None
    scenario = Scenario(backend, "sync", str(tmp_path), bucket)  # where roots live, for copy_root
    base = f"s3://{bucket}/base" if backend == "s3" else str(tmp_path / "base")

    def fresh(index: str) -> str:
        copy = f"s3://{bucket}/copy-{index}" if backend == "s3" else str(tmp_path / f"copy-{index}")
        copy_root(scenario, base, copy)
        return copy

    save_steps(open_storage(base), [10, 20])

    def hooked_root(uri: str) -> str:
        return uri.split("/", 3)[3] if backend == "s3" else uri

    dry = fresh("dry")
    assert _killed_gc(tmp_path / "points.json", None, backend, hooked_root(dry), dry) == 0
    points = json.loads((tmp_path / "points.json").read_text())
    assert statuses(open_storage(dry)) == {20: "complete"}
    assert any("deleting.json" in p for p in points) and any("manifest" in p for p in points)
    if backend == "s3":  # a kill before a request leaves what the kill after the one before it left
        points = [(i, p) for i, p in enumerate(points) if p.startswith("after ")]
    else:
        points = list(enumerate(points))
    seen: dict[str, int] = {}
    for index, point in points:
        uri = fresh(str(index))
        assert _killed_gc(tmp_path / "unused.json", index, backend, hooked_root(uri), uri) == -9, point
        storage = open_storage(uri)
        steps = {s.step: s for s in catalog.list_steps(storage)}
        assert steps[20].status == "complete", point
        if 10 in steps:
            assert steps[10].status in ("complete", "incomplete"), (point, steps[10])
            if steps[10].status == "incomplete":
                assert steps[10].being_deleted and steps[10].problem.startswith("being deleted"), (point, steps[10])
        state = steps[10].status if 10 in steps else "absent"
        seen[state] = seen.get(state, 0) + 1
        step, w = restored(storage)
        assert step == 20 and torch.equal(w, torch.full((4,), 20.0)), point
        assert main(["gc", uri, "--keep-last", "1"]) == 0
        assert statuses(storage) == {20: "complete"}, point
    assert seen.get("complete") and seen.get("incomplete")  # the kills landed on both sides of the manifest
    print(f"\n{backend}: {len(points)} points, step 10 after the kill: {seen}")
