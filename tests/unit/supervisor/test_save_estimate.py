"""The emergency-save estimate and the measurements it is made from (fast, in one process)."""

from __future__ import annotations

import json
import time

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.manifest import Manifest, SaveTiming
from spotrun.control import files as control
from spotrun.errors import ConfigError, ManifestError
from spotrun.storage import LocalStorage
from spotrun.supervisor.estimate import COMMIT_ALLOWANCE_S, decide, estimate_emergency_save

MiB = 2**20


def record(step: int, size_bytes: int, duration_s: float) -> control.SaveRecord:
    return control.SaveRecord(
        step=step, reason="periodic", size_bytes=size_bytes, duration_s=duration_s, committed_unix_s=1000.0 + step
    )


def test_no_measurement_no_estimate():
    assert estimate_emergency_save(None, None, time.time()) is None
    empty = control.SaveStats(in_progress=None, recent=(), step_time_s=0.5)
    assert estimate_emergency_save(empty, None, time.time()) is None


def test_estimate_uses_the_slowest_recent_throughput_and_the_step_boundary():
    stats = control.SaveStats(
        in_progress=None,
        recent=(record(100, 100 * MiB, 10.0), record(200, 100 * MiB, 20.0), record(300, 200 * MiB, 10.0)),
        step_time_s=0.5,
        check_interval_steps=4,
    )
    estimate = estimate_emergency_save(stats, None, time.time())
    # slowest: 5 MiB/s (step 200); the last save wrote 200 MiB -> 40 s; 4 steps of 0.5 s to the boundary
    assert estimate.throughput_bytes_per_s == pytest.approx(5 * MiB)
    assert estimate.save_s == pytest.approx(40.0)
    assert estimate.boundary_s == pytest.approx(2.0)
    assert estimate.in_flight_s == 0.0 and estimate.in_flight_step is None
    assert estimate.total_s == pytest.approx(42.0)
    assert "3 saves of this launch" in estimate.describe() and "42.0 s" in estimate.describe()


def test_a_save_in_progress_adds_what_is_left_of_it():
    now = 5000.0
    stats = control.SaveStats(
        in_progress=control.SaveInProgress(step=400, reason="periodic", started_unix_s=now - 3.0),
        recent=(record(300, 50 * MiB, 10.0),),
        step_time_s=1.0,
    )
    estimate = estimate_emergency_save(stats, None, now)
    assert estimate.in_flight_step == 400
    assert estimate.in_flight_s == pytest.approx(7.0)
    assert estimate.total_s == pytest.approx(7.0 + 1.0 + 10.0)
    assert "save of step 400 in progress" in estimate.describe()
    overdue = control.SaveStats(
        in_progress=control.SaveInProgress(400, "periodic", now - 60.0), recent=stats.recent, step_time_s=1.0
    )
    assert estimate_emergency_save(overdue, None, now).in_flight_s == 0.0  # never negative


def resumed_manifest(write_s: float, step_time_s: float | None) -> Manifest:
    from spotrun.checkpoint.manifest import FileRecord

    return Manifest(
        step=1200,
        world_size=2,
        files=[
            FileRecord("rank-00000.safetensors", 0, 30 * MiB, "0" * 64),
            FileRecord("rank-00001.safetensors", 1, 30 * MiB, "0" * 64),
        ],
        tensors={},
        state={},
        rank_state=[{}, {}],
        timing=SaveTiming(write_s=write_s, step_time_s=step_time_s),
    )


def test_before_this_launch_saved_the_manifest_it_resumed_from_is_used():
    estimate = estimate_emergency_save(None, resumed_manifest(6.0, 0.25), time.time())
    assert estimate.size_bytes == 60 * MiB
    assert estimate.save_s == pytest.approx(6.0 + COMMIT_ALLOWANCE_S)
    assert estimate.boundary_s == pytest.approx(0.25)
    assert "manifest of step 1200" in estimate.describe()
    assert "recorded shard write of 6.0 s + 1.0 s allowed for the commit" in estimate.describe()
    # this launch's own step time wins over the recorded one; its saves win over the manifest
    stats = control.SaveStats(in_progress=None, recent=(), step_time_s=2.0)
    assert estimate_emergency_save(stats, resumed_manifest(6.0, 0.25), time.time()).boundary_s == 2.0
    stats = control.SaveStats(in_progress=None, recent=(record(1300, 60 * MiB, 3.0),), step_time_s=2.0)
    assert estimate_emergency_save(stats, resumed_manifest(6.0, 0.25), time.time()).save_s == pytest.approx(3.0)
    # an older manifest without timing gives nothing to go on
    older = resumed_manifest(6.0, None)
    older.timing = None
    assert estimate_emergency_save(None, older, time.time()) is None


def test_a_manifest_saved_by_more_ranks_than_launched_now_gives_each_rank_a_bigger_share():
    """Saved by 2 ranks, 1 now (an elastic job back on fewer nodes): each rank writes twice as much."""
    fewer = estimate_emergency_save(None, resumed_manifest(6.0, 0.25), time.time(), ranks_now=1)
    assert fewer.save_s == pytest.approx(2 * 6.0 + COMMIT_ALLOWANCE_S)
    assert "recorded shard write of 12.0 s (x 2/1: saved by 2 ranks, 1 rank now) + 1.0 s allowed" in fewer.describe()
    # as many or more ranks now: never scaled down (fewer ranks may have shared a node's bandwidth)
    for ranks_now in (2, 4, None):
        same = estimate_emergency_save(None, resumed_manifest(6.0, 0.25), time.time(), ranks_now=ranks_now)
        assert same.save_s == pytest.approx(6.0 + COMMIT_ALLOWANCE_S) and "ranks now" not in same.describe()
    # this launch's own saves already measured the ranks it has
    stats = control.SaveStats(in_progress=None, recent=(record(1300, 60 * MiB, 3.0),), step_time_s=2.0)
    assert estimate_emergency_save(
        stats, resumed_manifest(6.0, 0.25), time.time(), ranks_now=1
    ).save_s == pytest.approx(3.0)


def test_save_stats_round_trip_and_bad_files(tmp_path):
    directory = str(tmp_path)
    assert control.read_save_stats(directory) is None
    stats = control.SaveStats(
        in_progress=control.SaveInProgress(step=20, reason="periodic", started_unix_s=123.5),
        recent=(record(10, 1234, 0.5),),
        step_time_s=0.05,
        check_interval_steps=2,
    )
    control.write_save_stats(directory, stats)
    assert control.read_save_stats(directory) == stats
    path = tmp_path / control.SAVES_FILE
    for bad in (
        '{"recent": [{"step": "ten"}]}',
        '{"recent": [], "step_time_s": -1}',
        '{"in_progress": {"step": 1}}',
        "{not json",
    ):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="saves.json"):
            control.read_save_stats(directory)


def test_save_request_without_a_save(tmp_path):
    request = control.SaveRequest(reason="SIGTERM", requested_unix_s=1.0, deadline_unix_s=2.0, save=False)
    control.write_save_request(str(tmp_path), request)
    assert control.read_save_request(str(tmp_path)) == request
    (tmp_path / control.SAVE_REQUEST_FILE).write_text(json.dumps({"reason": "old supervisor"}))
    assert control.read_save_request(str(tmp_path)).save is True  # a request without the field saves


def test_manifest_timing_is_optional_and_validated():
    manifest = resumed_manifest(1.5, 0.1)
    assert Manifest.from_json(manifest.to_json()).timing == SaveTiming(1.5, 0.1)
    doc = json.loads(manifest.to_json())
    doc.pop("timing")
    assert Manifest.from_json(json.dumps(doc).encode()).timing is None  # manifests before timing
    doc["timing"] = {"write_s": -3}
    with pytest.raises(ManifestError, match="timing.write_s"):
        Manifest.from_json(json.dumps(doc).encode())


def test_checkpointer_measures_saves_and_steps_for_the_supervisor(tmp_path, monkeypatch):
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(control_dir))
    weights = {"w": torch.arange(1000, dtype=torch.float32)}
    ckpt = spotrun.Checkpointer(
        {"weights": weights}, storage=LocalStorage(str(tmp_path / "ck")), interval_steps=2, handle_signals=False
    )
    for step in range(1, 5):
        time.sleep(0.02)
        assert ckpt.end_of_step(step) is False
    ckpt.wait_for_save()  # the save of step 4 runs in the background
    stats = control.read_save_stats(str(control_dir))
    assert stats.in_progress is None
    assert [r.step for r in stats.recent] == [2, 4]
    manifest = catalog.inspect_step(ckpt.storage, 4).manifest
    assert stats.recent[-1].size_bytes == manifest.size_bytes > 4000
    assert all(r.duration_s > 0 for r in stats.recent)
    # background saves: the time training was blocked (staging, and any wait for the save
    # before) and the whole save, recorded apart
    assert all(r.background and r.stall_s > 0 and r.duration_s > 0 for r in stats.recent)
    assert 0.02 <= stats.step_time_s < 5
    assert manifest.timing.write_s > 0 and manifest.timing.step_time_s == pytest.approx(stats.step_time_s, abs=0.5)


def test_stop_without_save_request_stops_and_saves_nothing(tmp_path, monkeypatch):
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(control_dir))
    ckpt = spotrun.Checkpointer(
        {"weights": {"w": torch.ones(4)}},
        storage=LocalStorage(str(tmp_path / "ck")),
        interval_steps=1,
        handle_signals=False,
    )
    assert ckpt.end_of_step(1) is False  # a periodic save of step 1
    control.write_save_request(str(control_dir), control.SaveRequest("SIGTERM", time.time(), None, save=False))
    assert ckpt.end_of_step(2) is True and ckpt.preempted
    assert [s.step for s in catalog.list_steps(ckpt.storage)] == [1]  # step 2 not saved, not even begun
    assert control.read_stop_report(str(control_dir)) == 2
    assert control.read_commit_report(str(control_dir)) is None


def test_a_save_right_after_a_restore_keeps_the_recorded_step_time(tmp_path):
    """The first step after a restore has no measured duration yet: the step time recorded in
    the restored checkpoint is carried over, so the next manifest still has one."""
    storage = LocalStorage(str(tmp_path / "ck"))
    first = spotrun.Checkpointer({"weights": {"w": torch.ones(4)}}, storage=storage, handle_signals=False)
    first.restore()
    for step in range(1, 4):
        time.sleep(0.02)
        first.end_of_step(step)
    first.save(3)
    recorded = catalog.inspect_step(storage, 3).manifest.timing.step_time_s
    assert recorded >= 0.02
    second = spotrun.Checkpointer({"weights": {"w": torch.ones(4)}}, storage=storage, handle_signals=False)
    assert second.restore() == 3
    second.end_of_step(4)
    second.save(4)
    assert catalog.inspect_step(storage, 4).manifest.timing.step_time_s == pytest.approx(recorded)


def background(step: int, started_unix_s: float, **progress) -> control.SaveInProgress:
    return control.SaveInProgress(
        step=step, reason="periodic", started_unix_s=started_unix_s, background=True, **progress
    )


def test_a_background_save_in_flight_counts_what_its_writer_published():
    """A background save in flight counts what its writer published, and overlaps the boundary."""
    now = 5000.0
    stats = control.SaveStats(
        in_progress=background(
            400, now - 3.0, bytes_total=40 * MiB, bytes_done=10 * MiB, remaining_s=9.0, progress_unix_s=now - 1.0
        ),
        recent=(record(300, 50 * MiB, 10.0),),
        step_time_s=0.5,
        check_interval_steps=4,
    )
    estimate = estimate_emergency_save(stats, None, now)
    assert estimate.in_flight_background and estimate.in_flight_s == pytest.approx(8.0)  # 9 s published 1 s ago
    # training goes on to the boundary (2 s) while it is written: max(8, 2) + 10, not 8 + 2 + 10
    assert estimate.total_s == pytest.approx(18.0)
    assert (
        "8.0 s to finish the background save of step 400 in flight (10.0 MiB of 40.0 MiB written)"
        in estimate.describe()
    )
    # nothing written yet: a whole save (10 s, measured) less the 3 s it has run
    nothing_yet = control.SaveStats(in_progress=background(400, now - 3.0), recent=stats.recent, step_time_s=0.5)
    assert estimate_emergency_save(nothing_yet, None, now).in_flight_s == pytest.approx(7.0)


def test_the_estimate_uses_whole_background_saves_not_their_stalls():
    stats = control.SaveStats(
        in_progress=None,
        recent=(
            control.SaveRecord(
                step=10,
                reason="periodic",
                size_bytes=100 * MiB,
                duration_s=20.0,
                committed_unix_s=1.0,
                stall_s=0.5,
                background=True,
            ),
        ),
        step_time_s=0.1,
    )
    assert estimate_emergency_save(stats, None, time.time()).save_s == pytest.approx(20.0)


@pytest.mark.parametrize(
    "remaining_s, left_s, save, words",
    [
        (2.0, 30.0, True, "emergency checkpoint requested: estimated"),
        (2.0, 8.0, False, "after the save of step 400 in progress commits, at their next step boundary"),
        (40.0, 30.0, True, "the workers abandon it and save the current step"),
        (40.0, 5.0, False, "abandoning the background save of step 400 in flight (it cannot commit in time either)"),
    ],
)
def test_the_supervisor_decides_with_a_background_save_in_flight(remaining_s, left_s, save, words):
    """The same rule as the workers' (spotrun.checkpoint.in_flight): finish it and save; else
    finish it only (no save asked for); else abandon it and save; else no save."""
    now = 5000.0
    stats = control.SaveStats(
        in_progress=background(
            400, now - 1.0, bytes_total=MiB, bytes_done=1, remaining_s=remaining_s, progress_unix_s=now
        ),
        recent=(record(300, 50 * MiB, 10.0),),
        step_time_s=0.5,
    )
    decision = decide(estimate_emergency_save(stats, None, now), left_s)
    assert decision.save is save and words in decision.message
    assert "background save of step 400 in flight" in decision.message


def test_the_supervisor_decides_as_before_without_a_background_save():
    now = 5000.0
    stats = control.SaveStats(
        in_progress=control.SaveInProgress(400, "periodic", now - 3.0),
        recent=(record(300, 50 * MiB, 10.0),),
        step_time_s=1.0,
    )
    estimate = estimate_emergency_save(stats, None, now)  # 7 + 1 + 10 s
    assert (
        decide(estimate, 20.0).save and "fits in the 20.0 s left before the deadline" in decide(estimate, 20.0).message
    )
    refused = decide(estimate, 15.0)
    assert not refused.save and refused.message.startswith("NOT saving: an emergency checkpoint would take 18.0 s")
    assert "after the save of step 400 in progress commits" in refused.message
