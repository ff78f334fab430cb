"""Issue 13, item 1: worker processes announce in the control directory that they listen."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from spotrun.control.listeners import Listener, announce, read_listeners


@pytest.fixture
def control_dir(tmp_path):
    path = tmp_path / "control"
    path.mkdir()
    return path


def test_announce_outside_spotrun_run_writes_nothing(tmp_path):
    assert announce("checkpointer", env={"RANK": "0"}) is None
    assert list(tmp_path.iterdir()) == []


def test_announcement_names_kind_pid_and_ranks(control_dir):
    env = {"SPOTRUN_CONTROL_DIR": str(control_dir), "RANK": "3", "LOCAL_RANK": "1"}
    path = announce("checkpointer", env=env)
    assert path == str(control_dir / "listeners" / f"checkpointer-pid-{os.getpid()}.json")
    [listener] = read_listeners(str(control_dir))
    assert (listener.kind, listener.pid, listener.rank, listener.local_rank) == ("checkpointer", os.getpid(), 3, 1)
    assert listener.announced_unix_s == json.loads(open(path).read())["announced_unix_s"]


def test_announcing_twice_writes_once_and_each_kind_has_its_file(control_dir):
    env = {"SPOTRUN_CONTROL_DIR": str(control_dir)}
    first = announce("poll", env=env)
    os.utime(first, ns=(0, 0))
    assert announce("poll", env=env) == first
    assert os.stat(first).st_mtime_ns == 0, "the second call must not rewrite the file"
    announce("checkpointer", env=env)
    assert sorted(x.kind for x in read_listeners(str(control_dir))) == ["checkpointer", "poll"]
    assert {x.rank for x in read_listeners(str(control_dir))} == {None}


def test_unknown_kind_is_refused(control_dir):
    with pytest.raises(ValueError, match="unknown listener kind"):
        announce("saver", env={"SPOTRUN_CONTROL_DIR": str(control_dir)})


def test_unwritable_control_dir_is_a_warning_and_retried(tmp_path, caplog):
    missing = tmp_path / "not-a-dir"
    missing.write_text("a file where the directory should be")
    env = {"SPOTRUN_CONTROL_DIR": str(missing)}
    with caplog.at_level(logging.WARNING, logger="spotrun.control.listeners"):
        assert announce("poll", env=env) is None
    assert "could not announce" in caplog.text
    missing.unlink()
    missing.mkdir()
    assert announce("poll", env=env) is not None, "a failed announcement is tried again"
    assert [x.kind for x in read_listeners(str(missing))] == ["poll"]


def test_reader_skips_what_is_not_a_whole_announcement(control_dir, caplog):
    env = {"SPOTRUN_CONTROL_DIR": str(control_dir), "RANK": "0"}
    announce("checkpointer", env=env)
    folder = control_dir / "listeners"
    (folder / "poll-pid-7.json").write_text('{"kind": "poll", "pid": 7, "ra')  # cut short
    (folder / "poll-pid-8.json.tmp").write_text("{}")  # a write in progress
    (folder / "poll-pid-9.json").write_text('["poll", 9]')
    (folder / "other-pid-10.json").write_text(
        json.dumps({"kind": "other", "pid": 10, "rank": 0, "local_rank": 0, "announced_unix_s": 1.0})
    )
    (folder / "poll-pid-11.json").write_text(
        json.dumps({"kind": "poll", "pid": "11", "rank": 0, "local_rank": 0, "announced_unix_s": 1.0})
    )
    (folder / "poll-pid-12.json").write_text(
        json.dumps({"kind": "poll", "pid": 12, "rank": None, "local_rank": None, "announced_unix_s": 5.0})
    )
    with caplog.at_level(logging.DEBUG, logger="spotrun.control.listeners"):
        found = read_listeners(str(control_dir))
    assert found[0] == Listener(kind="poll", pid=12, rank=None, local_rank=None, announced_unix_s=5.0)
    assert [(x.kind, x.pid) for x in found] == [("poll", 12), ("checkpointer", os.getpid())]
    assert caplog.text.count("ignoring listener file") == 4


def test_no_listeners_directory_means_no_listener(control_dir):
    assert read_listeners(str(control_dir)) == []
    assert read_listeners(str(control_dir / "gone")) == []


def test_a_polling_worker_process_announces_itself(control_dir):
    """A plain script's first spotrun.preemption_notice() call is its announcement."""
    env = {**os.environ, "SPOTRUN_CONTROL_DIR": str(control_dir), "RANK": "1", "LOCAL_RANK": "0"}
    done = subprocess.run(
        [sys.executable, "-c", "import os, spotrun; spotrun.preemption_notice(); print(os.getpid())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    [listener] = read_listeners(str(control_dir))
    assert (listener.kind, listener.pid, listener.rank, listener.local_rank) == ("poll", int(done.stdout), 1, 0)
