"""The event log kept with the checkpoints (spotrun.eventlog.records): the writer, rank 0's records
from a real Checkpointer, the supervisor's observer, and `spotrun report` on local and S3 roots."""

import json
import logging
import subprocess
import sys
import time

import torch

import spotrun
from spotrun.errors import StorageError
from spotrun.eventlog.records import EventLog, rank_key, read_events
from spotrun.storage import LocalStorage, open_storage
from spotrun.supervisor.event_log import EventLogObserver


def spotrun_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotrun", *args], capture_output=True, text=True, timeout=120)


def stored(storage, key):
    return [json.loads(line) for line in storage.get(key).decode().splitlines()]


def test_records_are_json_lines_with_one_progress_record_replaced_not_appended(tmp_path):
    storage = LocalStorage(str(tmp_path))
    log = EventLog(storage, "events/x.jsonl", progress_interval_s=3600)
    log.append("start", resumed_step=None)
    for step in range(1, 6):
        log.progress(step)
    log.append("save", step=5)
    log.close()
    records = stored(storage, "events/x.jsonl")
    assert [(r["event"], r.get("step")) for r in records] == [("start", None), ("save", 5), ("progress", 5)]
    assert all(isinstance(r["time_unix_s"], float) for r in records)


def test_progress_alone_is_written_after_the_interval(tmp_path):
    storage = LocalStorage(str(tmp_path))
    log = EventLog(storage, "events/x.jsonl", progress_interval_s=0.05)
    log.append("start")
    log.progress(7)  # no record follows: only the interval writes it
    deadline = time.monotonic() + 60
    while not storage.exists("events/x.jsonl") or stored(storage, "events/x.jsonl")[-1].get("step") != 7:
        assert time.monotonic() < deadline, "progress of step 7 never written"
        time.sleep(0.02)
    log.close()


class FlakyStorage(LocalStorage):
    failing = True

    def put(self, key, data):
        if self.failing:
            raise StorageError(5, "injected: the store is down")
        super().put(key, data)


def test_a_failing_store_never_reaches_the_caller_and_the_log_catches_up(tmp_path, caplog):
    storage = FlakyStorage(str(tmp_path))
    log = EventLog(storage, "events/x.jsonl", progress_interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="spotrun.eventlog.records"):
        log.append("start")
        log.progress(3)
        log.close(timeout_s=30)
    assert not storage.exists("events/x.jsonl")
    assert [r.message for r in caplog.records].count(
        f"cannot write the event log {storage.uri}/events/x.jsonl: injected: the store is down "
        "(tried again at the next record)"
    ) == 1
    storage.failing = False
    log.append("exit", step=3)
    log.close()
    assert [r["event"] for r in stored(storage, "events/x.jsonl")] == ["start", "exit", "progress"]


def test_rank_0_records_its_start_saves_and_exit_and_the_next_start_its_resume_point(tmp_path):
    storage = LocalStorage(str(tmp_path))
    state = {"weights": {"w": torch.zeros(4)}}
    ckpt = spotrun.Checkpointer(state=state, storage=storage, interval_steps=2, handle_signals=False)
    assert ckpt.restore() == 0
    for step in range(1, 6):
        ckpt.end_of_step(step)
    ckpt.close()
    records = stored(storage, rank_key(0, 0))
    assert [(r["event"], r.get("step")) for r in records] == [
        ("start", None),
        ("save", 2),
        ("save", 4),
        ("exit", 5),
        ("progress", 5),
    ]
    start = records[0]
    assert (
        start["incarnation"],
        start["resumed_step"],
        start["world_size"],
        start["interval_steps"],
        start["launch_incarnation"],
    ) == (0, None, 1, 2, None)
    assert all(
        r["committed"]
        and r["background"]
        and r["reason"] == "periodic"
        and r["size_bytes"] > 0
        and r["stall_s"] >= 0
        and r["duration_s"] > 0
        for r in records[1:3]
    )

    again = spotrun.Checkpointer(state=state, storage=storage, interval_steps=2, handle_signals=False)
    assert again.restore() == 4
    again.close()
    start = stored(storage, rank_key(1, 0))[0]
    assert (start["resumed_step"], start["restore_bytes_read"] > 0) == (4, True)


def test_the_supervisor_keeps_one_object_per_launch_with_its_start_in_the_first(tmp_path):
    storage = LocalStorage(str(tmp_path))
    observer = EventLogObserver(lambda: storage, host="node a", started_unix_s=0.5)
    observer.event("start", {"time_unix_s": 1.0, "pid": 1})
    observer.event("launch", {"time_unix_s": 2.0, "attempt": 0, "incarnation": 3})
    observer.event("command_exit", {"time_unix_s": 3.0, "code": 1, "incarnation": 3})
    observer.event("restart", {"time_unix_s": 3.5, "attempt": 1, "code": 1, "delay_s": 1.0})
    observer.event("launch", {"time_unix_s": 5.0, "attempt": 1, "incarnation": 4})
    observer.event("exit", {"time_unix_s": 6.0, "code": 0, "reason": "finished"})
    observer.close()
    objects = read_events(storage)
    assert [(o.incarnation, o.rank, [r["event"] for r in o.records]) for o in objects] == [
        (3, None, ["start", "launch", "command_exit", "restart"]),
        (4, None, ["launch", "exit"]),
    ]
    assert objects[0].writer == objects[1].writer and objects[0].writer.startswith("supervisor-node_a-")
    assert objects[0].records[0]["spotrun_started_unix_s"] == 0.5


def test_report_of_a_root_without_an_event_log_is_one_error_line_and_exit_2(tmp_path):
    (tmp_path / "ck").mkdir()
    done = spotrun_cli("report", str(tmp_path / "ck"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"spotrun: error: no event log under {tmp_path / 'ck'} (nothing in events/: "
        "spotrun run and the Checkpointer's rank 0 write it)"
    ]
    assert spotrun_cli("report", str(tmp_path / "missing")).returncode == 2


def test_report_reads_the_event_log_of_an_s3_root(s3_bucket):
    uri = f"{s3_bucket.uri}/job"
    ckpt = spotrun.Checkpointer(
        state={"weights": {"w": torch.zeros(4)}}, storage=open_storage(uri), handle_signals=False
    )
    ckpt.restore()
    for step in range(1, 4):
        ckpt.end_of_step(step)
    ckpt.save(3, reason="final")
    ckpt.close()
    done = spotrun_cli("report", uri, "--json", "--s3-endpoint-url", s3_bucket.endpoint_url)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [(r["number"], r["resumed_step"], r["last_step"], r["ended"]) for r in report["incarnations"]] == [
        (0, 0, 3, "exited")
    ]
    done = spotrun_cli("report", uri)  # the endpoint from AWS_ENDPOINT_URL
    assert done.returncode == 0 and "goodput" in done.stdout, done.stderr


def test_fast_tier_saves_are_recorded_with_their_tier_and_a_restore_from_memory_with_its_tier(tmp_path):
    storage = LocalStorage(str(tmp_path / "ck"))
    state = {"weights": {"w": torch.zeros(4)}}
    tier = {"memory_interval_steps": 2, "memory_dir": str(tmp_path / "mem")}
    ckpt = spotrun.Checkpointer(state=state, storage=storage, interval_steps=4, handle_signals=False, **tier)
    assert ckpt.restore() == 0
    for step in range(1, 4):  # one fast-tier save (step 2), nothing in flight before it: never skipped
        ckpt.end_of_step(step)
    ckpt.close()
    saves = [r for r in stored(storage, rank_key(0, 0)) if r["event"] == "save"]
    assert [(r["step"], r["tier"], r["reason"], r["committed"]) for r in saves] == [(2, "memory", "memory", True)]
    assert saves[0]["size_bytes"] > 0

    again = spotrun.Checkpointer(state=state, storage=storage, interval_steps=4, handle_signals=False, **tier)
    assert again.restore() == 2
    for step in range(3, 5):
        again.end_of_step(step)
    again.close()
    records = stored(storage, rank_key(1, 0))
    assert (records[0]["resumed_step"], records[0]["restore_tier"]) == (2, "memory")
    saved = sorted((r["step"], r["tier"]) for r in records if r["event"] == "save")
    assert saved == [(4, "memory"), (4, "storage")]  # each tier's own save, on threads of their own
