"""The fast tier's directory (issue 23): made and owned by one ``spotrun run``, removed when its
owner is gone (by pid and the pid's start time: a reused pid is not the owner), and released at
the end of the job."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from spotrun.storage.tier_dir import (
    ORPHAN_AGE_S,
    OWNER_FILE,
    create_tier,
    free_bytes,
    list_tiers,
    release_tier,
    remove_stale_tiers,
)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def rewrite_owner(path: str, **fields) -> None:
    owner_file = os.path.join(path, OWNER_FILE)
    with open(owner_file) as file:
        doc = json.load(file)
    doc.update(fields)
    with open(owner_file, "w") as file:
        json.dump(doc, file)


def test_a_new_tier_is_owned_by_this_process_and_holds_an_empty_steps_root(tmp_path):
    memory_dir = tmp_path / "mem"
    tier = create_tier(str(memory_dir), "s3://bucket/job")
    assert os.listdir(tier.steps_root) == []
    assert (tier.pid, tier.checkpoint_uri) == (os.getpid(), "s3://bucket/job") and tier.alive()
    [listed] = list_tiers(str(memory_dir))
    assert listed == tier
    assert oct(os.stat(tier.path).st_mode & 0o777) == "0o700"  # other users' processes cannot read the state


def test_two_tiers_in_one_memory_directory_are_distinct_and_listed_oldest_first(tmp_path):
    first = create_tier(str(tmp_path), "ck")
    second = create_tier(str(tmp_path), "ck")
    assert first.path != second.path
    assert [t.path for t in list_tiers(str(tmp_path))] == [first.path, second.path]


def test_a_missing_memory_directory_has_no_tiers_and_nothing_to_remove(tmp_path):
    assert list_tiers(str(tmp_path / "absent")) == []
    assert remove_stale_tiers(str(tmp_path / "absent")) == []


def test_a_tier_whose_owner_runs_is_kept(tmp_path):
    tier = create_tier(str(tmp_path), "ck")
    assert remove_stale_tiers(str(tmp_path)) == []
    assert os.path.isdir(tier.steps_root)


def test_a_tier_whose_owner_is_gone_is_removed_and_said(tmp_path, caplog):
    tier = create_tier(str(tmp_path), "ck")
    (tmp_path / "unrelated").mkdir()  # not a tier: never touched
    pid = dead_pid()
    rewrite_owner(tier.path, pid=pid)
    with caplog.at_level(logging.WARNING):
        assert remove_stale_tiers(str(tmp_path)) == [tier.path]
    assert not os.path.exists(tier.path) and (tmp_path / "unrelated").is_dir()
    assert f"removed the stale fast tier {tier.path} (its spotrun run, pid {pid}, is gone; never read)" in caplog.text


def test_a_tier_whose_pid_was_reused_by_another_process_is_removed(tmp_path):
    """The owner's pid runs, but it is another process (its start time differs)."""
    tier = create_tier(str(tmp_path), "ck")
    rewrite_owner(tier.path, pid_start_ticks=tier.pid_start_ticks - 1)
    [listed] = list_tiers(str(tmp_path))
    assert listed.pid == os.getpid() and not listed.alive()
    assert remove_stale_tiers(str(tmp_path)) == [tier.path]


def test_a_tier_without_an_owner_file_is_removed_only_once_old(tmp_path):
    """A supervisor making its tier right now writes the owner file next: a young tier without
    one is left alone; an old one is an orphan (its creator died in between)."""
    tier = create_tier(str(tmp_path), "ck")
    os.remove(os.path.join(tier.path, OWNER_FILE))
    assert remove_stale_tiers(str(tmp_path)) == []
    old_s = time.time() - ORPHAN_AGE_S - 1
    os.utime(tier.path, (old_s, old_s))
    assert remove_stale_tiers(str(tmp_path)) == [tier.path]
    assert not os.path.exists(tier.path)


@pytest.mark.parametrize("content", ["{", '{"pid": "x"}', "[]"], ids=["cut", "bad-pid", "not-an-object"])
def test_a_damaged_owner_file_makes_an_orphan(tmp_path, content):
    tier = create_tier(str(tmp_path), "ck")
    with open(os.path.join(tier.path, OWNER_FILE), "w") as file:
        file.write(content)
    [listed] = list_tiers(str(tmp_path))
    assert listed.pid < 0
    old_s = time.time() - ORPHAN_AGE_S - 1
    os.utime(tier.path, (old_s, old_s))
    assert remove_stale_tiers(str(tmp_path)) == [tier.path]


def test_release_removes_the_tier_with_its_steps(tmp_path):
    tier = create_tier(str(tmp_path), "ck")
    step = os.path.join(tier.steps_root, "step-000000002")
    os.mkdir(step)
    with open(os.path.join(step, "rank-0.safetensors"), "wb") as file:
        file.write(b"\0" * 1024)
    release_tier(tier)
    assert os.listdir(tmp_path) == []
    release_tier(tier)  # twice: nothing left, no error


def test_free_bytes_of_a_root_not_made_yet_is_that_of_its_parent(tmp_path):
    assert free_bytes(str(tmp_path / "mem" / "steps")) > 0


def test_the_file_system_of_a_tier_is_told_so_that_one_on_disk_is_warned_about():
    from spotrun.storage.tier_dir import MEMORY_FILESYSTEMS, filesystem_type

    assert filesystem_type("/dev/shm/not-made-yet") in MEMORY_FILESYSTEMS
    assert filesystem_type("/proc/self") == "proc"
