"""Background periodic saves (issue 9, item 3).

In this process: a storage wrapper holds the shard writes of one step until the test lets
them go (``threading.Event``s), so every test knows whether a background write is in
progress without assuming anything about timing. In subprocesses (real processes, real
signals, torchrun with gloo, ``spotrun run``): ``tests/jobs/bg_job.py`` holds the write on
a FIFO the test opens when it wants the write to go on.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.in_flight import Choice, choose
from spotrun.checkpoint.layout import step_dir
from spotrun.checkpoint.save import SaveProgress
from spotrun.control import files as control
from spotrun.errors import CheckpointSaveError, ConfigError, FencedError, StorageError
from spotrun.storage import LocalStorage, open_storage
from spotrun.train.meter import SaveMeter
from tests.support.paths import JOBS
from tests.support.trainrun import kill_tree, start_supervised

WORKER = str(JOBS / "bg_job.py")
#: Upper bound of any wait in these tests (a hang fails instead of blocking the suite).
WAIT_S = 300


class GatedStorage(LocalStorage):
    """Local storage that holds every shard write of ``gate_step`` until :attr:`gate` is set
    (:attr:`blocked` is set when the first one arrives); ``fail`` makes shard writes fail."""

    def __init__(self, root: Path, gate_step: int | None = None) -> None:
        super().__init__(str(root), fsync=False)
        self.gate_step = gate_step
        self.gate = threading.Event()
        self.blocked = threading.Event()
        self.fail = False

    def _hold(self, key: str) -> None:
        if "/rank-" not in key:
            return
        if self.fail:
            raise StorageError(5, f"injected write failure for {key}")
        if self.gate_step is not None and key.startswith(f"{step_dir(self.gate_step)}/"):
            self.blocked.set()
            assert self.gate.wait(WAIT_S), "the test never released the write"

    def put(self, key, data):
        self._hold(key)
        super().put(key, data)

    def put_stream(self, key, source, **kwargs):
        self._hold(key)
        super().put_stream(key, source, **kwargs)


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    loss = (model(x) - x).pow(2).mean() + 1e-3 * torch.randn(()).abs() + 1e-3 * random.random()  # global RNGs
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(model, opt) -> dict:
    """Every tensor of the model and optimizer, and the RNG states, copied."""
    tensors = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, state in opt.state_dict()["state"].items():
        tensors.update({f"optimizer/{index}/{k}": v.clone() for k, v in state.items()})
    return {"tensors": tensors, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}


def same(a: dict, b: dict) -> bool:
    return (
        a["tensors"].keys() == b["tensors"].keys()
        and all(
            torch.equal(a["tensors"][k].reshape(-1).view(torch.uint8), b["tensors"][k].reshape(-1).view(torch.uint8))
            for k in a["tensors"]
        )
        and torch.equal(a["torch_rng"], b["torch_rng"])
        and a["python_rng"] == b["python_rng"]
    )


def checkpointer(storage, model, opt, **options) -> spotrun.Checkpointer:
    return spotrun.Checkpointer({"model": model, "optimizer": opt}, storage=storage, handle_signals=False, **options)


def open_root(root: Path | str):
    return open_storage(str(root)) if str(root).startswith("s3://") else LocalStorage(str(root))


def statuses(root: Path | str) -> dict[int, str]:
    return {s.step: s.status for s in catalog.list_steps(open_root(root))}


def committed_statuses(root: Path) -> dict[int, str]:
    """:func:`statuses` without incomplete steps: an abandoned save stops at its next chunk,
    so whether any of its files exists depends on where the abandon found it."""
    return {step: status for step, status in statuses(root).items() if status != "incomplete"}


def without_incomplete(expected: dict[int, str]) -> dict[int, str]:
    return {step: status for step, status in expected.items() if status != "incomplete"}


def in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


# --- exact resume -------------------------------------------------------------------------


def test_exact_resume_from_a_background_checkpoint_staged_while_training(tmp_path):
    """Exact resume from a background checkpoint staged while training changed the parameters."""
    storage = GatedStorage(tmp_path, gate_step=3)
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=3)
    assert ckpt.restore() == 0
    for step in (1, 2, 3):
        train_step(model, opt, step)
        if step == 3:
            at_boundary = snapshot(model, opt)
        assert ckpt.end_of_step(step) is False  # step 3: staged, returns; the write is held
    assert storage.blocked.wait(WAIT_S)
    for step in (4, 5):  # training goes on while nothing of step 3 is written yet
        train_step(model, opt, step)
        assert ckpt.end_of_step(step) is False
    assert not same(snapshot(model, opt), at_boundary)
    assert ckpt.save_in_flight == 3 and ckpt.last_saved_step is None
    storage.gate.set()
    ckpt.wait_for_save()
    assert ckpt.save_in_flight is None and ckpt.last_saved_step == 3
    assert statuses(tmp_path) == {3: "complete"}

    model2, opt2 = build(seed=1)
    random.seed(99)
    assert checkpointer(LocalStorage(str(tmp_path)), model2, opt2).restore() == 3
    assert same(snapshot(model2, opt2), at_boundary)  # bit-identical to the staged boundary


def test_staging_buffers_are_allocated_once_and_reused(tmp_path):
    model, opt = build()
    ckpt = checkpointer(LocalStorage(str(tmp_path)), model, opt, interval_steps=1)
    pointers = []
    for step in (1, 2, 3):
        train_step(model, opt, step)
        ckpt.end_of_step(step)
        ckpt.wait_for_save()
        pointers.append({n: b.data_ptr() for n, (b, _pinned) in ckpt._background._staging._buffers.items()})
    assert pointers[0] and pointers[0] == pointers[1] == pointers[2]
    assert statuses(tmp_path) == {1: "complete", 2: "complete", 3: "complete"}


def test_a_failure_before_the_write_is_logged_and_the_save_still_commits(tmp_path, caplog):
    """What runs on the save's thread before its write (the fast tier's pruning) runs on one rank:
    raising there would leave the other ranks waiting for it in the save's first collective."""
    model, opt = build()
    ckpt = checkpointer(LocalStorage(str(tmp_path)), model, opt)
    ran_on = []

    def failing_prune() -> None:
        ran_on.append(threading.current_thread().name)
        raise OSError(28, "No space left on device")

    with caplog.at_level(logging.ERROR, logger="spotrun"):
        assert ckpt._saves.due(1, "periodic", None, before_write=failing_prune)
        ckpt.wait_for_save()
    assert ran_on == ["spotrun-background-save"]
    assert "before writing the background save of step 1" in caplog.text
    assert statuses(tmp_path) == {1: "complete"}
    ckpt.close()


# --- failures, policies, close ------------------------------------------------------------


def test_a_failed_background_save_is_reported_at_the_next_end_of_step(tmp_path, caplog):
    """A failed background save is reported at the next end of step and counts as a failed
    periodic save."""
    storage = GatedStorage(tmp_path)
    storage.fail = True
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=1, max_failed_periodic_saves=1)
    ckpt.restore()
    assert ckpt.end_of_step(1) is False  # staged; its write fails in the background
    with caplog.at_level(logging.ERROR, logger="spotrun.checkpointer"):
        assert ckpt.end_of_step(2) is False  # reports step 1's failure (1 in a row: tolerated)
    assert "periodic save of step 1 failed (1 in a row)" in caplog.text
    assert "injected write failure" in caplog.text
    with pytest.raises(CheckpointSaveError, match="save of step 2 failed"):
        ckpt.end_of_step(3)  # step 2's failure: 2 in a row, more than max_failed_periodic_saves
    assert ckpt.last_saved_step is None and statuses(tmp_path) == {}  # nothing of either was written


def test_a_fenced_background_save_raises_at_the_next_end_of_step(tmp_path):
    storage = GatedStorage(tmp_path, gate_step=1)
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=1)
    ckpt.restore()
    assert ckpt.end_of_step(1) is False
    assert storage.blocked.wait(WAIT_S)
    newer = checkpointer(LocalStorage(str(tmp_path)), *build())
    newer.restore()  # a newer start claims the root while step 1 is being written
    storage.gate.set()
    with pytest.raises(FencedError):
        ckpt.end_of_step(2)
    assert 1 not in {s for s, status in statuses(tmp_path).items() if status == "complete"}


def test_skip_policy_skips_due_saves_while_one_is_in_flight(tmp_path, caplog):
    storage = GatedStorage(tmp_path, gate_step=2)
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=1, on_save_in_flight="skip")
    ckpt.end_of_step(1)
    ckpt.wait_for_save()
    ckpt.end_of_step(2)
    assert storage.blocked.wait(WAIT_S)
    with caplog.at_level(logging.WARNING, logger="spotrun.checkpointer"):
        assert ckpt.end_of_step(3) is False and ckpt.end_of_step(4) is False
    assert "periodic save of step 3 skipped: the background save of step 2 is still in flight" in caplog.text
    assert "periodic save of step 4 skipped" in caplog.text
    storage.gate.set()
    ckpt.wait_for_save()
    ckpt.end_of_step(5)
    ckpt.close()
    assert statuses(tmp_path) == {1: "complete", 2: "complete", 5: "complete"}


def test_wait_policy_waits_for_the_save_in_flight(tmp_path, caplog):
    storage = GatedStorage(tmp_path, gate_step=2)
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=1)  # on_save_in_flight="wait", the default
    ckpt.end_of_step(1)
    ckpt.wait_for_save()
    ckpt.end_of_step(2)
    assert storage.blocked.wait(WAIT_S)
    with caplog.at_level(logging.INFO, logger="spotrun.checkpoint.background"):
        step_3 = in_thread(lambda: ckpt.end_of_step(3))
        step_3.join(0.2)
        assert step_3.is_alive()  # it cannot return before the held write of step 2 goes on
        storage.gate.set()
        step_3.join(WAIT_S)
    assert "periodic save of step 3 waited" in caplog.text and "background save of step 2" in caplog.text
    ckpt.close()
    assert statuses(tmp_path) == {1: "complete", 2: "complete", 3: "complete"}


def test_close_waits_for_the_save_in_flight(tmp_path):
    storage = GatedStorage(tmp_path, gate_step=1)
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=1)
    ckpt.end_of_step(1)
    assert storage.blocked.wait(WAIT_S)
    closing = in_thread(ckpt.close)
    closing.join(0.2)
    assert closing.is_alive()  # held with the write
    storage.gate.set()
    closing.join(WAIT_S)
    assert not closing.is_alive()
    assert statuses(tmp_path) == {1: "complete"}  # committed when close() returned


def test_close_leaves_no_background_thread_and_saving_again_starts_one(tmp_path):
    """Nothing of a background save outlives close() (a thread or gloo group left to the
    interpreter's exit can abort the process there); a later save starts them again."""
    earlier = set(threading.enumerate())  # other tests' checkpointers may still hold threads

    def spotrun_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("spotrun-") and t not in earlier]

    storage = GatedStorage(tmp_path)
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=1)
    ckpt.end_of_step(1)
    ckpt.wait_for_save()
    assert "spotrun-background-save" in spotrun_threads()
    ckpt.close()
    ckpt.close()  # twice is fine
    assert spotrun_threads() == []
    ckpt.end_of_step(2)
    ckpt.close()
    assert statuses(tmp_path) == {1: "complete", 2: "complete"} and spotrun_threads() == []


def test_a_script_that_exits_without_close_still_commits_the_save_in_flight(tmp_path):
    """The script ends right after end_of_step started a background save (no close()), and
    the save's shard write only begins once the interpreter is exiting (the storage waits for
    threading's shutdown flag): the exit waits for the save, says so, and the step commits."""
    script = tmp_path / "noclose.py"
    script.write_text(
        "import sys, threading, time, torch, spotrun\n"
        "from spotrun.storage import LocalStorage\n"
        "class WritesDuringExit(LocalStorage):\n"
        "    def put_stream(self, key, source, **kwargs):\n"
        "        while not threading._SHUTTING_DOWN:  # set as the interpreter starts to exit\n"
        "            time.sleep(0.01)\n"
        "        super().put_stream(key, source, **kwargs)\n"
        "model = torch.nn.Linear(1024, 4096)  # 16 MiB: a shard of several chunks\n"
        "ckpt = spotrun.Checkpointer({'model': model}, storage=WritesDuringExit(sys.argv[1]), interval_steps=1)\n"
        "ckpt.restore()\n"
        "ckpt.end_of_step(1)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "still being written: waiting for it (call Checkpointer.close() before exiting)" in done.stderr
    assert statuses(tmp_path / "ck") == {1: "complete"}


def test_wait_for_save_re_raises_the_failure(tmp_path):
    storage = GatedStorage(tmp_path)
    storage.fail = True
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=1)
    ckpt.end_of_step(1)
    with pytest.raises(CheckpointSaveError, match="injected write failure"):
        ckpt.wait_for_save()
    ckpt.wait_for_save()  # reported once; nothing is in flight any more


def test_on_save_in_flight_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="on_save_in_flight must be one of"):
        checkpointer(LocalStorage(str(tmp_path)), *build(), on_save_in_flight="queue")


def test_synchronous_periodic_saves_when_background_saves_are_off(tmp_path):
    storage = GatedStorage(tmp_path)
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=2, background_saves=False)
    for step in (1, 2):
        ckpt.end_of_step(step)
    assert ckpt.save_in_flight is None and statuses(tmp_path) == {2: "complete"}  # committed on return


def test_the_meter_records_stall_and_whole_save_apart(tmp_path, monkeypatch):
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(control_dir))
    storage = GatedStorage(tmp_path / "ck", gate_step=1)
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=1)
    ckpt.end_of_step(1)
    assert storage.blocked.wait(WAIT_S)
    in_flight = control.read_save_stats(str(control_dir)).in_progress
    assert in_flight.step == 1 and in_flight.background
    storage.gate.set()
    ckpt.wait_for_save()
    stats = control.read_save_stats(str(control_dir))
    assert stats.in_progress is None
    (record,) = stats.recent
    assert record.background and 0 < record.stall_s < record.duration_s  # held: the write outlasted the stall


# --- an emergency request while a background save is in flight ----------------------------


def test_choose_follows_the_order_of_preference():
    assert choose(2.0, 3.0, 10.0) is Choice.FINISH_THEN_SAVE
    assert choose(8.0, 3.0, 10.0) is Choice.FINISH_ONLY
    assert choose(12.0, 3.0, 10.0) is Choice.ABANDON_AND_SAVE
    assert choose(12.0, 11.0, 10.0) is Choice.FINISH_ANYWAY
    assert choose(None, None, 10.0) is Choice.FINISH_THEN_SAVE  # nothing measured: counts as fitting
    # the save in flight goes on while the workers reach the step boundary
    assert choose(6.0, 3.0, 10.0, boundary_s=5.0) is Choice.FINISH_THEN_SAVE  # overlap: 6 + 3, not 6 + 5 + 3
    assert choose(2.0, 3.0, 10.0, boundary_s=8.0) is Choice.FINISH_ONLY
    assert choose(12.0, 3.0, 10.0, boundary_s=8.0) is Choice.FINISH_ANYWAY
    assert choose(8.0, None, 10.0, may_save=False) is Choice.FINISH_ONLY
    assert choose(12.0, None, 10.0, may_save=False) is Choice.ABANDON


def _gate_opens_on_the_decision(storage: GatedStorage):
    """A log handler that lets the held write go on once the decision is logged (the abort
    event, when chosen, is set before that line)."""

    class Opener(logging.Handler):
        def emit(self, record):
            if "in flight" in record.getMessage():
                storage.gate.set()

    handler = Opener()
    logging.getLogger("spotrun.checkpoint.in_flight").addHandler(handler)
    return handler


@pytest.mark.parametrize(
    "remaining_s, full_save_s, left_s, save, choice, expected, resume_step",
    [
        (None, None, 600, True, "finishing it, then saving step 3", {1: "complete", 2: "complete", 3: "complete"}, 3),
        (100.0, 50.0, 120, True, "finishing it; step 3 is NOT saved", {1: "complete", 2: "complete"}, 2),
        (
            1e6,
            None,
            600,
            True,
            "abandoning it (it would not commit in time) and saving step 3",
            {1: "complete", 2: "incomplete", 3: "complete"},
            3,
        ),
        (
            1e6,
            1e6,
            600,
            True,
            "neither fits; finishing it anyway: step 3 is NOT saved",
            {1: "complete", 2: "complete"},
            2,
        ),
        (
            None,
            None,
            600,
            False,
            "finishing it, then stopping without a save of step 3",
            {1: "complete", 2: "complete"},
            2,
        ),
        (
            1e6,
            None,
            600,
            False,
            "abandoning it (it would not commit in time) and stopping without a save",
            {1: "complete", 2: "incomplete"},
            1,
        ),
    ],
    ids=["finish-then-save", "finish-only", "abandon-and-save", "finish-anyway", "no-save-finish", "no-save-abandon"],
)
def test_emergency_request_with_a_background_save_in_flight(
    tmp_path, monkeypatch, caplog, remaining_s, full_save_s, left_s, save, choice, expected, resume_step
):
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(control_dir))
    if remaining_s is not None:  # the save in flight reports how long its write still needs
        monkeypatch.setattr(SaveProgress, "remaining_s", lambda self: remaining_s)
    if full_save_s is not None:  # what this launch measured a full save to take
        monkeypatch.setattr(SaveMeter, "full_save_s", lambda self: full_save_s)
    storage = GatedStorage(tmp_path / "ck", gate_step=2)
    model, opt = build()
    ckpt = checkpointer(storage, model, opt, interval_steps=1)
    ckpt.restore()
    ckpt.end_of_step(1)
    ckpt.wait_for_save()
    ckpt.end_of_step(2)
    assert storage.blocked.wait(WAIT_S)  # step 2 is being written in the background
    now_s = time.time()
    control.write_save_request(str(control_dir), control.SaveRequest("SIGTERM", now_s, now_s + left_s, save=save))
    handler = _gate_opens_on_the_decision(storage)
    try:
        with caplog.at_level(logging.WARNING):
            assert ckpt.end_of_step(3) is True and ckpt.preempted
    finally:
        logging.getLogger("spotrun.checkpoint.in_flight").removeHandler(handler)
    assert "with the background save of step 2 in flight" in caplog.text and choice in caplog.text
    assert committed_statuses(tmp_path / "ck") == without_incomplete(expected)
    assert ckpt.last_saved_step == resume_step
    report = control.read_commit_report(str(control_dir))
    if 3 in expected:
        assert report.step == 3
    else:  # the supervisor is told that this step was not saved
        assert report is None and control.read_stop_report(str(control_dir)) == 3
    if "abandoning" in choice:
        assert "background save of step 2 abandoned: nothing of it was committed" in caplog.text
    assert checkpointer(LocalStorage(str(tmp_path / "ck")), *build(seed=1)).restore() == resume_step


# --- real processes -----------------------------------------------------------------------


def _wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    give_up = time.monotonic() + WAIT_S
    while not path.exists():
        assert proc.poll() is None, f"the job exited ({proc.returncode}) before {what}"
        assert time.monotonic() < give_up, f"no {what} after {WAIT_S} s"
        time.sleep(0.02)


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen) -> None:
    give_up = time.monotonic() + WAIT_S
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert proc.poll() is None, f"the job exited ({proc.returncode}) before logging {text!r}"
        assert time.monotonic() < give_up, f"{text!r} not logged after {WAIT_S} s"
        time.sleep(0.02)


def _release(out: Path, rank: int, proc: subprocess.Popen) -> None:
    """Let rank ``rank``'s held write go on: open its FIFO for writing once the worker reads it."""
    give_up = time.monotonic() + WAIT_S
    while True:
        try:
            fd = os.open(out / f"release-rank-{rank}", os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:  # ENXIO: the worker has not opened it yet
            assert proc.poll() is None and time.monotonic() < give_up
            time.sleep(0.02)
    os.close(fd)


def _out_dir(tmp_path: Path, ranks: int) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    for rank in range(ranks):
        os.mkfifo(out / f"release-rank-{rank}")
    return out


def test_sigkill_mid_background_write_leaves_the_previous_step_as_the_resume_point(tmp_path):
    """SIGKILL in the middle of a background write leaves the previous step as the resume point."""
    out, ck = _out_dir(tmp_path, 1), tmp_path / "ck"
    # small files: every save writes many parts; the first of step 4 is written, the second held
    proc = subprocess.Popen(
        [
            sys.executable,
            WORKER,
            str(ck),
            str(out),
            "--steps",
            "1000",
            "--interval",
            "2",
            "--gate-from",
            "4",
            "--gate-parts-from",
            "1",
            "--max-file-bytes",
            "4096",
            "--dump-at",
            "2",
        ],
        stderr=open(tmp_path / "job.log", "wb"),
    )
    try:
        _wait_for(out / "blocked-rank-0", proc, "the held write of step 4")
        assert (out / "blocked-rank-0").read_text() == "4"
        written = sorted(p.name for p in (ck / step_dir(4)).iterdir() if not p.name.startswith("."))
        assert written and not any("manifest" in name for name in written)  # in the middle of the write
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(WAIT_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert statuses(ck) == {2: "complete", 4: "incomplete"}
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert checkpointer(LocalStorage(str(ck)), model, opt).restore() == 2
    at_step_2 = load_file(str(out / "state-2-rank-0.safetensors"))
    restored = snapshot(model, opt)["tensors"]
    assert sorted(restored) == sorted(k for k in at_step_2 if k != "rng")
    assert all(torch.equal(restored[k], at_step_2[k]) for k in restored)
    assert torch.equal(torch.get_rng_state(), at_step_2["rng"])


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER, *args]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sigterm_during_a_background_write_under_spotrun_run_ends_with_the_logged_decision(
    tmp_path, processes, backend, request
):
    """The save of step 6 is held on both ranks while training goes on to step 7, where the
    workers wait for the supervisor's request (so every rank sees it at step 7). On S3 the
    held write is the background upload of the step's shards (moto on 127.0.0.1)."""
    out, log_path = _out_dir(tmp_path, 2), tmp_path / "supervisor.log"
    ck = f"{request.getfixturevalue('s3_bucket').uri}/ck" if backend == "s3" else tmp_path / "ck"
    proc = start_supervised(
        str(ck),
        _torchrun(str(ck), str(out), "--steps", "1000", "--interval", "3", "--gate-from", "6", "--hold-at", "7"),
        extra_options=["--notice", "none"],
        log_path=log_path,
    )
    processes.append(proc)
    for rank in (0, 1):
        _wait_for(out / f"blocked-rank-{rank}", proc, f"rank {rank}'s held write of step 6")
    os.kill(proc.pid, signal.SIGTERM)
    _wait_for_text(log_path, "with the background save of step 6 in flight", proc)  # the workers' decision
    for rank in (0, 1):
        _release(out, rank, proc)
    assert proc.wait(WAIT_S) == 143, log_path.read_text()[-4000:]
    text = log_path.read_text()
    assert "emergency checkpoint requested: estimated" in text  # the supervisor's decision, with its figures
    assert "to finish the background save of step 6 in flight" in text
    assert "emergency checkpoint with the background save of step 6 in flight" in text
    assert "finishing it, then saving step 7" in text
    assert "emergency checkpoint of step 7 is complete: exiting 143" in text
    assert statuses(ck) == {3: "complete", 6: "complete", 7: "complete"}
    reasons = {s.step: s.reason for s in catalog.list_steps(open_root(ck))}
    assert reasons == {3: "periodic", 6: "periodic", 7: "emergency"}


@pytest.mark.slow
def test_abandoned_background_save_on_two_ranks_commits_nothing_and_the_current_step_is_saved(tmp_path):
    """2 gloo ranks: the save of step 6 reports that it needs 1e6 s more, a full save was
    measured (step 3) to fit: every rank abandons step 6 and saves step 7."""
    out, ck, control_dir = _out_dir(tmp_path, 2), tmp_path / "ck", tmp_path / "control"
    control_dir.mkdir()
    log_path = tmp_path / "job.log"
    proc = subprocess.Popen(
        _torchrun(
            str(ck),
            str(out),
            "--steps",
            "1000",
            "--interval",
            "3",
            "--gate-from",
            "6",
            "--hold-at",
            "7",
            "--slow-progress",
        ),
        env={**os.environ, "SPOTRUN_CONTROL_DIR": str(control_dir)},
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        for rank in (0, 1):
            _wait_for(out / f"blocked-rank-{rank}", proc, f"rank {rank}'s held write of step 6")
        now_s = time.time()
        control.write_save_request(str(control_dir), control.SaveRequest("test", now_s, now_s + 600))
        _wait_for_text(log_path, "abandoning it (it would not commit in time) and saving step 7", proc)
        for rank in (0, 1):
            _release(out, rank, proc)
        assert proc.wait(WAIT_S) == 0, log_path.read_text()[-4000:]
    finally:
        kill_tree(proc)
    text = log_path.read_text()
    assert "background save of step 6 abandoned: nothing of it was committed" in text
    assert committed_statuses(ck) == {3: "complete", 7: "complete"}  # nothing of step 6 committed
    for rank in (0, 1):
        result = json.loads((out / f"result-rank-{rank}.json").read_text())
        assert result == {"resumed": 0, "stopped_at": 7, "last_saved_step": 7, "preempted": True}
    assert control.read_commit_report(str(control_dir)).step == 7
