"""The Checkpointer's per-step decision and the emergency save's time bound, table-tested
from plain inputs; what a rank was asked, read once per check (one process, no torchrun)."""

from __future__ import annotations

import time

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.control import files as control
from spotrun.control.env import WorkerEnv
from spotrun.storage import LocalStorage
from spotrun.train.decision import Action, Decision, StepContext, decide, emergency_timeout_s
from spotrun.train.requests import Asked, StopRequests

CONTINUE, SAVE, SAVE_AND_STOP, STOP_WITHOUT_SAVE = (
    Action.CONTINUE,
    Action.SAVE,
    Action.SAVE_AND_STOP,
    Action.STOP_WITHOUT_SAVE,
)

# (name, StepContext fields, expected Decision)
DECISIONS = [
    ("nothing asked, no interval", dict(step=7), Decision(CONTINUE)),
    ("interval 0 never saves", dict(step=100, interval_steps=0), Decision(CONTINUE)),
    ("periodic save at a multiple of the interval", dict(step=20, interval_steps=10), Decision(SAVE, "periodic")),
    ("no save between two periodic ones", dict(step=21, interval_steps=10), Decision(CONTINUE)),
    (
        "a requested checkpoint at any step",
        dict(step=21, interval_steps=10, checkpoint_requested=True),
        Decision(SAVE, "requested"),
    ),
    (
        "a requested checkpoint at a periodic step is the requested one",
        dict(step=20, interval_steps=10, checkpoint_requested=True),
        Decision(SAVE, "requested"),
    ),
    (
        "notice with time to save: emergency checkpoint",
        dict(step=23, interval_steps=10, save_and_stop=True),
        Decision(SAVE_AND_STOP),
    ),
    (
        "notice at a periodic step: the emergency checkpoint replaces the periodic one",
        dict(step=20, interval_steps=10, save_and_stop=True),
        Decision(SAVE_AND_STOP),
    ),
    (
        "notice without time to commit before the deadline: stop without saving",
        dict(step=23, interval_steps=10, stop_without_save=True),
        Decision(STOP_WITHOUT_SAVE),
    ),
    (
        "one node has no time, another asks for a save: nobody saves",
        dict(step=23, save_and_stop=True, stop_without_save=True),
        Decision(STOP_WITHOUT_SAVE),
    ),
    (
        "stop without a save beats a requested checkpoint",
        dict(step=23, stop_without_save=True, checkpoint_requested=True),
        Decision(STOP_WITHOUT_SAVE),
    ),
    (
        "a notice too short for storage, time for the fast tier: the emergency checkpoint goes there",
        dict(step=23, interval_steps=10, save_and_stop=True, save_to_memory=True),
        Decision(Action.SAVE_TO_MEMORY_AND_STOP),
    ),
    (
        "one node has no time at all, another asks for the fast tier: nobody saves",
        dict(step=23, save_and_stop=True, save_to_memory=True, stop_without_save=True),
        Decision(STOP_WITHOUT_SAVE),
    ),
    (
        "the fast tier beats the final step",
        dict(step=8, stop_at_step=8, save_and_stop=True, save_to_memory=True),
        Decision(Action.SAVE_TO_MEMORY_AND_STOP),
    ),
    (
        "final step: SPOTRUN_STOP_AT_STEP reached",
        dict(step=8, stop_at_step=8),
        Decision(SAVE_AND_STOP, why="SPOTRUN_STOP_AT_STEP=8"),
    ),
    (
        "SPOTRUN_STOP_AT_STEP already passed (resumed beyond it)",
        dict(step=12, stop_at_step=8),
        Decision(SAVE_AND_STOP, why="SPOTRUN_STOP_AT_STEP=8"),
    ),
    (
        "before SPOTRUN_STOP_AT_STEP training goes on",
        dict(step=7, interval_steps=7, stop_at_step=8),
        Decision(SAVE, "periodic"),
    ),
    (
        "a notice at the final step is logged as the notice",
        dict(step=8, stop_at_step=8, save_and_stop=True),
        Decision(SAVE_AND_STOP),
    ),
    (
        "no time to save at the final step: stop without saving",
        dict(step=8, stop_at_step=8, stop_without_save=True),
        Decision(STOP_WITHOUT_SAVE),
    ),
    (
        "the final step beats a requested checkpoint",
        dict(step=8, stop_at_step=8, checkpoint_requested=True),
        Decision(SAVE_AND_STOP, why="SPOTRUN_STOP_AT_STEP=8"),
    ),
]


@pytest.mark.parametrize("fields, expected", [case[1:] for case in DECISIONS], ids=[case[0] for case in DECISIONS])
def test_decide_answers_each_case_of_the_table(fields, expected):
    decision = decide(StepContext(**fields))
    assert decision == expected
    assert decision.stops is (expected.action in (SAVE_AND_STOP, Action.SAVE_TO_MEMORY_AND_STOP, STOP_WITHOUT_SAVE))


NOW = 1_000_000.0
# (name, emergency_timeout_s keywords, expected seconds)
TIMEOUTS = [
    ("no deadline, supervisor running: save_timeout_s", dict(), 300.0),
    ("a deadline later than save_timeout_s", dict(deadline_unix_s=NOW + 900), 300.0),
    ("the request's deadline", dict(deadline_unix_s=NOW + 20), 20.0),
    ("a deadline already passed: no time", dict(deadline_unix_s=NOW - 1), -1.0),
    (
        "supervisor gone: killed at the end of the grace period, less the margin",
        dict(kill_unix_s=NOW + 30, safety_margin_s=5),
        25.0,
    ),
    (
        "the earlier of the deadline and the kill",
        dict(deadline_unix_s=NOW + 40, kill_unix_s=NOW + 30, safety_margin_s=5),
        25.0,
    ),
]


@pytest.mark.parametrize("bounds, expected_s", [case[1:] for case in TIMEOUTS], ids=[case[0] for case in TIMEOUTS])
def test_emergency_timeout_is_the_tightest_bound(bounds, expected_s):
    assert emergency_timeout_s(300.0, NOW, **bounds) == pytest.approx(expected_s)


def request(save: bool) -> control.SaveRequest:
    return control.SaveRequest("aws spot instance-action", NOW, NOW + 60, save=save)


# (name, Asked, save_and_stop, stop_without_save, describe())
ASKED = [
    ("nothing", Asked(), False, False, "another rank"),
    ("a signal", Asked(signal_name="SIGTERM"), True, False, "SIGTERM"),
    (
        "the supervisor's request to save",
        Asked(request=request(True)),
        True,
        False,
        "supervisor: aws spot instance-action",
    ),
    (
        "the supervisor's request to stop without a save outranks a signal",
        Asked(request=request(False), signal_name="SIGTERM"),
        False,
        True,
        "SIGTERM",
    ),
    ("a supervisor that is gone", Asked(gone_supervisor_pid=42), True, False, "the supervisor (pid 42) is gone"),
]


@pytest.mark.parametrize(
    "asked, save_and_stop, stop_without_save, who", [case[1:] for case in ASKED], ids=[case[0] for case in ASKED]
)
def test_what_a_rank_was_asked(asked, save_and_stop, stop_without_save, who):
    assert (asked.save_and_stop, asked.stop_without_save, asked.describe()) == (save_and_stop, stop_without_save, who)


def test_a_request_for_the_fast_tier_is_a_save_and_stop_to_memory_and_survives_the_file(tmp_path):
    memory = control.SaveRequest("gcp preempted", NOW, NOW + 20, save=True, tier="memory")
    control.write_save_request(str(tmp_path), memory)
    read = control.read_save_request(str(tmp_path))
    assert read == memory
    asked = Asked(request=read)
    assert (asked.save_and_stop, asked.save_to_memory, asked.stop_without_save) == (True, True, False)
    assert not Asked(request=request(True)).save_to_memory  # storage, as before
    assert not Asked(request=control.SaveRequest("x", NOW, NOW, save=False, tier="memory")).save_to_memory
    control.write_commit_report(str(tmp_path), 26, "memory")
    assert control.read_commit_report(str(tmp_path)).tier == "memory"


def count_request_reads(monkeypatch) -> list[int]:
    reads = [0]
    real = control.read_save_request

    def counting(control_dir):
        reads[0] += 1
        return real(control_dir)

    monkeypatch.setattr(control, "read_save_request", counting)
    return reads


@pytest.mark.parametrize("save", [True, False], ids=["save-and-stop", "stop-without-save"])
def test_a_check_that_stops_reads_the_request_file_once(tmp_path, monkeypatch, save):
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(control_dir))
    ckpt = spotrun.Checkpointer(
        {"weights": {"w": torch.ones(4)}}, storage=LocalStorage(str(tmp_path / "ck")), handle_signals=False
    )
    reads = count_request_reads(monkeypatch)
    assert ckpt.end_of_step(1) is False and reads[0] == 0  # no file: a stat, nothing read
    control.write_save_request(
        str(control_dir), control.SaveRequest("SIGTERM", time.time(), time.time() + 60, save=save)
    )
    assert ckpt.end_of_step(2) is True and ckpt.preempted
    assert reads[0] == 1
    assert [s.step for s in catalog.list_steps(ckpt.storage)] == ([2] if save else [])
    ckpt.close()


def test_a_damaged_request_file_is_taken_as_a_save_request_without_a_deadline(tmp_path, monkeypatch, caplog):
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(control_dir))
    (control_dir / control.SAVE_REQUEST_FILE).write_text("{not json")
    requests = StopRequests(WorkerEnv.from_environ(), handle_signals=False)
    asked = requests.read()
    assert asked.save_and_stop and "unreadable" in asked.describe()
    assert requests.emergency_timeout_s(asked, 123.0) == 123.0
    assert "taking it as a save request" in caplog.text
    ckpt = spotrun.Checkpointer(
        {"weights": {"w": torch.ones(4)}}, storage=LocalStorage(str(tmp_path / "ck")), handle_signals=False
    )
    assert ckpt.end_of_step(1) is True
    assert [s.step for s in catalog.list_steps(ckpt.storage)] == [1]
    assert control.read_commit_report(str(control_dir)).step == 1
    ckpt.close()


def test_a_rank_that_looked_before_the_request_appeared_still_saves_by_its_deadline(tmp_path, monkeypatch):
    """Another rank's request won the agreement, this rank's check saw no file yet: its save
    is bounded by the deadline in the file all the same (field case C10 on rank 1)."""
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(control_dir))
    requests = StopRequests(WorkerEnv.from_environ(), handle_signals=False)
    asked = requests.read()
    assert asked.request is None
    now_s = time.time()
    control.write_save_request(str(control_dir), control.SaveRequest("SIGTERM", now_s, now_s + 25.0))
    assert 20.0 < requests.emergency_timeout_s(asked, 300.0) <= 25.0
