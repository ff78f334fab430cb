"""Issue 13: jobs that checkpoint with their own framework (examples/: plain DCP, HF Trainer,
Lightning) under `spotrun run` in foreign-saver mode, where the supervisor passes the notice on
as a signal to the worker processes (or the job polls spotrun.preemption_notice()): every rank
saves the same step and exits 0, spotrun exits 143, and the restart resumes and finishes."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from spotrun.control import files as control
from spotrun.control.listeners import read_listeners
from spotrun.supervisor.config import option_specs
from spotrun.supervisor.foreign import oldest_age_s
from spotrun.supervisor.process import proc_info
from tests.support.foreign_jobs import (
    DCP_SCRIPT,
    HF_SCRIPT,
    LIGHTNING_SCRIPT,
    WAIT_S,
    accelerate_launch,
    assert_resumed_and_finished,
    events,
    saved_step,
    start,
    torchrun,
    wait_for_training,
)
from tests.support.trainrun import start_supervised

DCP_STEPS = 40
HF_STEPS = 30
LIGHTNING_STEPS = 40
PREEMPTED = 143
#: Foreign-saver mode: the supervisor passes a notice on to the workers as a signal (issue 13, item 2).
#: `spotrun run --announce-timeout-s`'s default: silent workers younger than this may still be starting.
ANNOUNCE_TIMEOUT_S = next(spec.default for spec in option_specs() if spec.name == "announce_timeout_s")
SINGLE_THREAD = {"OMP_NUM_THREADS": "1"}  # torchrun sets it per worker; a plain process would oversubscribe


def dcp_command(tmp_path, *extra: object) -> list[str]:
    return torchrun(
        DCP_SCRIPT, "--ckpt-dir", tmp_path / "dcp", "--steps", DCP_STEPS, "--log-file", tmp_path / "log.jsonl", *extra
    )


def finish_run(
    command: list[str], tmp_path, name: str, processes, *, supervised: bool = False, options=()
) -> list[dict]:
    """Run ``command`` again to its end (exit 0); returns the events it logged."""
    log_file = tmp_path / "log.jsonl"
    before = len(events(log_file))
    if supervised:
        proc = start_supervised(
            str(tmp_path / "spotrun-ck"),
            command,
            grace_period_s=20,
            extra_options=["--notice", "none", *options],
            log_path=tmp_path / f"{name}.out",
            env=SINGLE_THREAD,
        )
    else:
        proc = start(command, tmp_path / f"{name}.out", env=SINGLE_THREAD)
    processes.append(proc)
    assert proc.wait(timeout=WAIT_S) == 0, (tmp_path / f"{name}.out").read_text()[-3000:]
    return events(log_file)[before:]


@pytest.mark.slow
def test_dcp_recipe_polling_saves_on_the_save_request_and_announces_itself(tmp_path, processes):
    """--notice poll: spotrun.preemption_notice() sees the save request that `spotrun run`
    writes (here written by the test) on each rank, both save the same step and exit 0;
    each worker announced itself as a "poll" listener."""
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    proc = start(
        [*dcp_command(tmp_path, "--notice", "poll"), "--step-sleep-s", "0.02"],
        tmp_path / "first.out",
        env={"SPOTRUN_CONTROL_DIR": str(control_dir)},
    )
    processes.append(proc)
    pids = wait_for_training(tmp_path / "log.jsonl", proc, ranks=2, step=3)
    requested_unix_s = time.time()
    control.write_save_request(
        str(control_dir),
        control.SaveRequest(reason="SIGTERM", requested_unix_s=requested_unix_s, deadline_unix_s=requested_unix_s + 15),
    )
    assert proc.wait(timeout=WAIT_S) == 0, (tmp_path / "first.out").read_text()[-3000:]
    logged = events(tmp_path / "log.jsonl")
    step = saved_step(logged, ranks=2)
    notices = {e["rank"]: e for e in logged if e["event"] == "notice"}
    assert sorted(notices) == [0, 1] and all(n["reason"] == "SIGTERM" for n in notices.values())
    assert all(0 < n["seconds_left"] <= 15 for n in notices.values())
    assert (tmp_path / "dcp" / f"step-{step:09d}" / "COMPLETE").exists()
    announced = read_listeners(str(control_dir))
    assert sorted((x.kind, x.rank, x.pid) for x in announced) == sorted(
        ("poll", e["rank"], e["pid"]) for e in logged if e["event"] == "start"
    )
    assert sorted(pids) == sorted(x.pid for x in announced)


# --- under `spotrun run` (foreign-saver mode) --------------------------------------------------


#: Slow steps: the job must still be training once its workers are ANNOUNCE_TIMEOUT_S old.
SUPERVISED_STEP_SLEEP_S = "0.5"


def notice_to_supervisor(
    tmp_path, processes, command: list[str], options: list[str], *, ranks: int
) -> tuple[float, int]:
    """Run ``command`` under `spotrun run --grace-period-s 20 --notice none OPTIONS`, SIGTERM the
    supervisor once training runs: it must exit 143 with no traceback in its output, every
    rank having saved the same step. Returns (when the notice was sent, the saved step)."""
    proc = start_supervised(
        str(tmp_path / "spotrun-ck"),
        command,
        grace_period_s=20,
        extra_options=["--notice", "none", *options],
        log_path=tmp_path / "first.out",
        env=SINGLE_THREAD,
    )
    processes.append(proc)
    pids = wait_for_training(tmp_path / "log.jsonl", proc, ranks=ranks, step=3)
    # A job that has run for a while (the field report): its silent workers are past the age
    # at which spotrun stops taking them for a job still starting (the default setting).
    if "--notify-signal" not in options:  # (with it, the signal goes out at once whatever their age)
        age_s = oldest_age_s([info for info in map(proc_info, pids) if info is not None])
        time.sleep(max(0.0, ANNOUNCE_TIMEOUT_S - age_s + 0.1))
    sent_unix_s = time.time()
    proc.send_signal(signal.SIGTERM)
    output = tmp_path / "first.out"
    assert proc.wait(timeout=WAIT_S) == PREEMPTED, output.read_text()[-3000:]
    assert "Traceback" not in output.read_text() and "SignalException" not in output.read_text()
    return sent_unix_s, saved_step(events(tmp_path / "log.jsonl"), ranks=ranks)


def assert_signalled_within_1_s(logged: list[dict], sent_unix_s: float, signame: str, ranks: int) -> None:
    got = {e["rank"]: e for e in logged if e["event"] == "signal"}
    assert sorted(got) == list(range(ranks)), f"ranks that got a signal: {sorted(got)}"
    for rank, e in got.items():
        assert e["signal"] == signame
        assert 0 <= e["received_unix_s"] - sent_unix_s < 1.0, (
            f"rank {rank} got {signame} {e['received_unix_s'] - sent_unix_s:.2f} s after the notice"
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "signame, options",
    [("SIGTERM", []), ("SIGUSR1", ["--notify-signal", "SIGUSR1"])],
    ids=["unannounced-job-gets-SIGTERM", "notify-signal-SIGUSR1"],
)
def test_dcp_job_under_spotrun_gets_the_signal_within_1_s_saves_and_exits_143(tmp_path, processes, signame, options):
    """Acceptance 1 and 2: the workers (which never announce themselves) get the signal within
    1 s of the notice, save their own DCP checkpoint and exit 0; spotrun exits 143; the restart
    under spotrun resumes from that checkpoint and finishes."""
    command = dcp_command(tmp_path, "--save-signal", signame)
    sent_unix_s, step = notice_to_supervisor(
        tmp_path, processes, [*command, "--step-sleep-s", SUPERVISED_STEP_SLEEP_S], options, ranks=2
    )
    assert_signalled_within_1_s(events(tmp_path / "log.jsonl"), sent_unix_s, signame, ranks=2)
    assert (tmp_path / "dcp" / f"step-{step:09d}" / "COMPLETE").exists()

    assert_resumed_and_finished(
        finish_run(command, tmp_path, "second", processes, supervised=True, options=options),
        from_step=step,
        last_step=DCP_STEPS,
        ranks=2,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "signame, options",
    [("SIGTERM", []), ("SIGUSR1", ["--notify-signal", "SIGUSR1"])],
    ids=["unannounced-job-gets-SIGTERM", "notify-signal-SIGUSR1"],
)
def test_dcp_job_under_accelerate_launch_gets_the_signal_on_its_workers_saves_and_exits_143(
    tmp_path, processes, signame, options
):
    """C19: `accelerate launch --multi_gpu` runs torch's elastic agent in its own process (no
    torchrun anywhere): the workers, not accelerate, get the signal within 1 s, save their DCP
    checkpoint and exit 0, so accelerate exits 0 and spotrun 143; the rerun resumes and finishes."""
    command = accelerate_launch(
        DCP_SCRIPT,
        "--ckpt-dir",
        tmp_path / "dcp",
        "--steps",
        DCP_STEPS,
        "--log-file",
        tmp_path / "log.jsonl",
        "--save-signal",
        signame,
    )
    sent_unix_s, step = notice_to_supervisor(
        tmp_path, processes, [*command, "--step-sleep-s", SUPERVISED_STEP_SLEEP_S], options, ranks=2
    )
    assert_signalled_within_1_s(events(tmp_path / "log.jsonl"), sent_unix_s, signame, ranks=2)
    assert f"sent {signame} to 2 worker process(es)" in (tmp_path / "first.out").read_text()
    assert (tmp_path / "dcp" / f"step-{step:09d}" / "COMPLETE").exists()

    assert_resumed_and_finished(
        finish_run(command, tmp_path, "second", processes, supervised=True, options=options),
        from_step=step,
        last_step=DCP_STEPS,
        ranks=2,
    )


@pytest.mark.slow
def test_polling_dcp_job_under_spotrun_gets_no_signal_saves_and_exits_143(tmp_path, processes):
    """A job that polls spotrun.preemption_notice() announced itself: no signal (it has no
    handler, so one would kill it), it saves on the save request within 1 s and exits 0;
    spotrun exits 143."""
    command = dcp_command(tmp_path, "--notice", "poll")
    sent_unix_s, step = notice_to_supervisor(
        tmp_path, processes, [*command, "--step-sleep-s", SUPERVISED_STEP_SLEEP_S], [], ranks=2
    )
    logged = events(tmp_path / "log.jsonl")
    assert not [e for e in logged if e["event"] == "signal"]
    seen = {e["rank"]: e["seen_unix_s"] - sent_unix_s for e in logged if e["event"] == "notice"}
    assert sorted(seen) == [0, 1] and all(0 <= s < 1.0 for s in seen.values()), seen
    assert (tmp_path / "dcp" / f"step-{step:09d}" / "COMPLETE").exists()


@pytest.mark.slow
def test_hf_trainer_under_spotrun_saves_exits_143_and_global_step_continues(tmp_path, processes):
    """Acceptance 3: the Trainer recipe in one CPU process (the command is the worker, no
    torchrun): SIGTERM within 1 s of the notice, checkpoint-<N>, spotrun exits 143; the restart
    resumes at global_step N + 1 and finishes."""
    command = [
        sys.executable,
        str(HF_SCRIPT),
        "--output-dir",
        str(tmp_path / "hf"),
        "--max-steps",
        str(HF_STEPS),
        "--log-file",
        str(tmp_path / "log.jsonl"),
    ]
    sent_unix_s, step = notice_to_supervisor(
        tmp_path, processes, [*command, "--step-sleep-s", SUPERVISED_STEP_SLEEP_S], [], ranks=1
    )
    assert_signalled_within_1_s(events(tmp_path / "log.jsonl"), sent_unix_s, "SIGTERM", ranks=1)
    assert (tmp_path / "hf" / f"checkpoint-{step}" / "COMPLETE").exists()

    assert_resumed_and_finished(
        finish_run(command, tmp_path, "second", processes, supervised=True), from_step=step, last_step=HF_STEPS, ranks=1
    )


@pytest.mark.slow
def test_lightning_job_under_spotrun_with_notify_signal_sigusr1_saves_and_exits_143(tmp_path, processes):
    """The Lightning recipe under `spotrun run --notify-signal SIGUSR1`: SIGUSR1 within 1 s,
    step-<N>.ckpt, spotrun exits 143; the restart resumes at global_step N + 1 and finishes."""
    options = ["--notify-signal", "SIGUSR1"]
    command = torchrun(
        LIGHTNING_SCRIPT,
        "--ckpt-dir",
        tmp_path / "pl",
        "--max-steps",
        LIGHTNING_STEPS,
        "--log-file",
        tmp_path / "log.jsonl",
    )
    sent_unix_s, step = notice_to_supervisor(
        tmp_path, processes, [*command, "--step-sleep-s", SUPERVISED_STEP_SLEEP_S], options, ranks=2
    )
    assert_signalled_within_1_s(events(tmp_path / "log.jsonl"), sent_unix_s, "SIGUSR1", ranks=2)
    assert (tmp_path / "pl" / f"step-{step}.ckpt").exists()

    assert_resumed_and_finished(
        finish_run(command, tmp_path, "second", processes, supervised=True, options=options),
        from_step=step,
        last_step=LIGHTNING_STEPS,
        ranks=2,
    )
