"""Issue 23, acceptance: the fast tier at its limits.

* The supervisor SIGKILLed while its tier holds a step newer than storage's: the next
  ``spotrun run`` on the same ``--memory-dir`` removes the stale tier (says so), never reads it,
  resumes from storage, and ends bit-identical to an uninterrupted run.
* FSDP2 on 2 ranks: a worker SIGKILLed after step 27 (fast tier every 2 steps, storage every 20):
  the restart resumes from the fast tier's step 26, bit-identical to an uninterrupted FSDP2 run.
* A tier that does not fit its budget: a clear error naming the sizes at the first fast-tier save,
  then a storage-only run to the end (exit 0, nothing in the tier).
* A background save to storage and a fast-tier save both held in flight (``tests/jobs/bg_job.py``
  gates both writes on FIFOs), then SIGTERM: the emergency step commits within the deadline and
  the supervisor's decision is logged as without a fast tier.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from spotrun.checkpoint import catalog
from spotrun.storage import LocalStorage
from spotrun.storage.tier_dir import TierOwner, list_tiers
from spotrun.supervisor import process
from tests.support.fast_tier_kill import kill_rank_0_frozen
from tests.support.paths import JOBS
from tests.support.trainrun import (
    REFERENCE_SAVE_INTERVAL,
    REFERENCE_STEPS,
    assert_same_as_reference,
    final_tensors,
    last_loss_per_step,
    ls_json,
    read_log,
    start_supervised,
    tails,
    torchrun_command,
    wait_for_step,
)

pytestmark = pytest.mark.slow

#: Upper bound of any wait (a hang fails instead of blocking the suite).
WAIT_S = 300


def tier_options(memory_dir: Path, interval_steps: int = 2, *extra: str) -> list[str]:
    return ["--notice", "none", "--memory-interval-steps", str(interval_steps), "--memory-dir", str(memory_dir), *extra]


def wait_until(condition, what: str, proc, outputs: tuple[Path, ...] = ()):
    """Poll ``condition`` until it returns something truthy (returned) while ``proc`` runs."""
    give_up = time.monotonic() + WAIT_S
    while True:
        found = condition()
        if found:
            return found
        assert proc.poll() is None, f"spotrun run exited ({proc.returncode}) before {what}" + tails(outputs)
        assert time.monotonic() < give_up, f"no {what} after {WAIT_S} s" + tails(outputs)
        time.sleep(0.05)


def the_tier(memory_dir: Path, proc, outputs=()) -> TierOwner:
    """The one tier directory under ``memory_dir``, once ``spotrun run`` made it."""
    [tier] = wait_until(lambda: list_tiers(str(memory_dir)), "fast tier directory", proc, outputs)
    return tier


def complete_steps(storage) -> list[int]:
    return [s.step for s in catalog.list_steps(storage) if s.status == catalog.COMPLETE]


def workers_of(proc) -> list[process.ProcInfo]:
    """The example trainer's worker processes under ``proc`` (not torchrun itself)."""
    return [p for p in process.descendants(proc.pid) if "train_gpt" in _cmdline(p.pid) and p.ppid != proc.pid]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def first_step_of_restart(log_file: Path) -> int:
    """The first step the restarted run logged: the first row whose step does not go forward."""
    steps = [row["step"] for row in read_log(log_file)]
    [restart] = [b for a, b in zip(steps, steps[1:]) if b <= a]
    return restart


# --- the supervisor SIGKILLed: its tier is stale --------------------------------------------


def test_after_a_sigkilled_supervisor_the_next_run_removes_its_tier_and_resumes_from_storage(
    reference, tmp_path, processes
):
    """Storage every 10 steps, the fast tier every 2. Once the tier holds a step newer than
    storage's, the whole job dies at once (spotrun run SIGKILLed, its workers frozen first and
    then SIGKILLed: were they left to notice the lost supervisor they would commit an emergency
    step on storage, newer than the tier's). The next ``spotrun run`` on the same memory directory
    removes the dead run's tier and resumes from storage's step, never from the tier."""
    ck, memory_dir, log_file = str(tmp_path / "ck"), tmp_path / "mem", tmp_path / "train.jsonl"
    command = torchrun_command(REFERENCE_STEPS, REFERENCE_SAVE_INTERVAL, log_file, "--step-sleep-s", "0.2")
    outputs = (tmp_path / "first.log",)
    first = start_supervised(ck, command, extra_options=tier_options(memory_dir), log_path=outputs[0])
    processes.append(first)
    tier = the_tier(memory_dir, first, outputs)
    in_memory = LocalStorage(tier.steps_root)
    wait_until(
        lambda: any(s > REFERENCE_SAVE_INTERVAL for s in complete_steps(in_memory)),
        f"fast-tier step after step {REFERENCE_SAVE_INTERVAL}",
        first,
        outputs,
    )
    job = process.descendants(first.pid)
    for p in job:
        os.kill(p.pid, signal.SIGSTOP)
    first.kill()
    assert first.wait(timeout=60) == -signal.SIGKILL
    for p in job:
        os.kill(p.pid, signal.SIGKILL)
    on_storage = max(row["step"] for row in ls_json(ck) if row["status"] == "complete")
    assert on_storage == REFERENCE_SAVE_INTERVAL
    assert max(complete_steps(in_memory)) > on_storage  # the stale tier holds the newer step

    second = start_supervised(ck, command, extra_options=tier_options(memory_dir), log_path=tmp_path / "second.log")
    processes.append(second)
    assert second.wait(timeout=WAIT_S) == 0, tails((tmp_path / "second.log",))
    text = (tmp_path / "second.log").read_text(errors="replace")
    assert f"removed the stale fast tier {tier.path}" in text
    assert not os.path.exists(tier.path)
    assert "in the fast tier" not in text and "(the fast tier, in memory)" not in text
    assert f"restored step {on_storage} from" in text
    assert first_step_of_restart(log_file) == on_storage + 1
    assert_same_as_reference(reference, ck, log_file)
    assert list_tiers(str(memory_dir)) == []  # the second run's own tier released at its end


# --- FSDP2: a worker SIGKILLed, resumed from the fast tier ---------------------------------

FSDP_STEPS, FSDP_SAVE_INTERVAL, KILL_AFTER_STEP = 30, 20, 27
FSDP_ARGS = ("--fsdp", "--intra-op-threads", "1")


def test_fsdp2_worker_sigkilled_resumes_from_the_fast_tier_bit_identically(tmp_path, processes):
    """FSDP2 on 2 ranks, storage every 20 steps, the fast tier every 2: one worker SIGKILLed
    after step 27; spotrun restarts the job, which resumes from the fast tier's step 26 (not
    storage's 20), read from memory, and ends bit-identical to an uninterrupted FSDP2 run
    (every step's loss, every model and optimizer tensor of the last step)."""
    ref_ck, ref_log = tmp_path / "ref-ck", tmp_path / "ref.jsonl"
    uninterrupted = start_supervised(
        str(ref_ck),
        torchrun_command(FSDP_STEPS, FSDP_SAVE_INTERVAL, ref_log, *FSDP_ARGS),
        extra_options=["--notice", "none"],
        log_path=tmp_path / "ref.log",
    )
    processes.append(uninterrupted)
    assert uninterrupted.wait(timeout=WAIT_S) == 0, tails((tmp_path / "ref.log",))

    ck, memory_dir, log_file, log_path = (
        tmp_path / "ck",
        tmp_path / "mem",
        tmp_path / "train.jsonl",
        tmp_path / "run.log",
    )
    command = torchrun_command(FSDP_STEPS, FSDP_SAVE_INTERVAL, log_file, *FSDP_ARGS, "--step-sleep-s", "0.3")
    options = tier_options(memory_dir, 2, "--max-restarts", "1", "--restart-backoff-s", "0")
    proc = start_supervised(str(ck), command, extra_options=options, log_path=log_path)
    processes.append(proc)
    wait_for_step(log_file, KILL_AFTER_STEP, proc, outputs=(log_path,))
    # frozen first: the tier's newest step at the kill is known (26, or 28 on a slow machine)
    newest = kill_rank_0_frozen(proc.pid, memory_dir)
    assert newest is not None and newest >= KILL_AFTER_STEP - 1 > FSDP_SAVE_INTERVAL
    assert proc.wait(timeout=WAIT_S) == 0, tails((log_path,))

    text = log_path.read_text(errors="replace")
    assert f"resuming from step {newest} in the fast tier" in text
    assert f"restored step {newest} from" in text and "(the fast tier, in memory)" in text
    assert first_step_of_restart(log_file) == newest + 1
    assert last_loss_per_step(log_file) == last_loss_per_step(ref_log)
    got, expected = final_tensors(str(ck), FSDP_STEPS, world_size=1), final_tensors(str(ref_ck), FSDP_STEPS, 1)
    assert sorted(got) == sorted(expected) and any(name.startswith("optimizer/") for name in expected)
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []


# --- a tier over its budget: storage only ----------------------------------------------------


def test_a_fast_tier_over_its_budget_is_refused_with_the_sizes_and_the_job_runs_storage_only(tmp_path, processes):
    """``--memory-budget-bytes 1000``: the first fast-tier save says that two steps do not fit,
    with both sizes; no step ever lands in the tier; the job saves on storage to the end and
    exits 0."""
    ck, memory_dir, log_file, log_path = (
        tmp_path / "ck",
        tmp_path / "mem",
        tmp_path / "train.jsonl",
        tmp_path / "run.log",
    )
    proc = start_supervised(
        str(ck),
        torchrun_command(8, 4, log_file, "--step-sleep-s", "0.1"),
        extra_options=tier_options(memory_dir, 2, "--memory-budget-bytes", "1000"),
        log_path=log_path,
    )
    processes.append(proc)
    tier = the_tier(memory_dir, proc, (log_path,))
    wait_for_step(log_file, 5, proc, outputs=(log_path,))  # fast-tier saves were due at steps 2 and 4
    assert catalog.list_steps(LocalStorage(tier.steps_root)) == []
    assert proc.wait(timeout=WAIT_S) == 0, tails((log_path,))

    text = log_path.read_text(errors="replace")
    [line] = [line for line in text.splitlines() if "the fast tier does not fit" in line]
    assert "running with storage only" in line
    assert "the budget allows 1000 B (budget 1000 B" in line  # as given, not rounded to 0.0 MiB
    assert "KiB" in line or "MiB" in line  # what two steps need
    assert "fast tier failed" not in text and "Traceback" not in text
    assert {row["step"]: row["status"] for row in ls_json(str(ck))} == {4: "complete", 8: "complete"}
    assert sorted(last_loss_per_step(log_file)) == list(range(1, 9))
    assert list_tiers(str(memory_dir)) == []


# --- an emergency with a storage save and a fast-tier save in flight -----------------------

BG_JOB = str(JOBS / "bg_job.py")


def _release(fifo: Path, proc) -> None:
    """Let a held write go on: open its FIFO for writing once the worker reads it."""
    give_up = time.monotonic() + WAIT_S
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:  # ENXIO: the worker has not opened it yet
            assert proc.poll() is None and time.monotonic() < give_up
            time.sleep(0.02)
    os.close(fd)


def test_emergency_during_a_storage_save_and_a_fast_tier_save_commits_within_the_deadline(tmp_path, processes):
    """2 ranks; storage saves every 3 steps, the fast tier every 6: at step 6 both saves start
    and both writes are held on every rank (the job's gates), so both are in flight at once.
    SIGTERM to spotrun run; at step 7 the workers decide (the fast-tier write is abandoned, the
    storage one finished), the held writes go on, and the emergency step 7 commits: exit 143,
    the supervisor's decision and the workers' logged as without a fast tier."""
    out, ck, memory_dir, log_path = tmp_path / "out", tmp_path / "ck", tmp_path / "mem", tmp_path / "run.log"
    out.mkdir()
    fifos = [out / f"release-{tier}rank-{rank}" for tier in ("", "memory-") for rank in (0, 1)]
    for fifo in fifos:
        os.mkfifo(fifo)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", BG_JOB]
    command += [str(ck), str(out), "--steps", "1000", "--interval", "3", "--hold-at", "7"]
    command += ["--gate-from", "6", "--gate-memory-from", "6"]
    proc = start_supervised(str(ck), command, extra_options=tier_options(memory_dir, 6), log_path=log_path)
    processes.append(proc)
    held = [out / fifo.name.replace("release-", "blocked-") for fifo in fifos]
    wait_until(lambda: all(path.exists() for path in held), "held storage and fast-tier writes", proc, (log_path,))
    assert {path.read_text() for path in held} == {"6"}
    os.kill(proc.pid, signal.SIGTERM)
    wait_until(
        lambda: "with the background save of step 6 in flight" in log_path.read_text(errors="replace"),
        "the workers' decision",
        proc,
        (log_path,),
    )
    for fifo in fifos:
        _release(fifo, proc)
    assert proc.wait(timeout=WAIT_S) == 143, tails((log_path,))

    text = log_path.read_text(errors="replace")
    holds = [f"rank {rank} holds its {tier}write of step 6" for tier in ("storage-", "memory-") for rank in (0, 1)]
    notice = text.index("emergency checkpoint requested")
    assert all(0 <= text.find(hold) < notice for hold in holds), "both saves were in flight at the notice"
    assert "emergency checkpoint requested: estimated" in text  # the supervisor's decision, with its figures
    assert "to finish the background save of step 6 in flight" in text
    assert "finishing it, then saving step 7" in text
    assert "emergency checkpoint of step 7 is complete: exiting 143" in text
    assert "fast-tier save of step 6 abandoned: nothing of it was committed" in text
    assert "background save of step 6 abandoned" not in text  # storage's step 6 was committed
    steps = {s.step: (s.status, s.reason) for s in catalog.list_steps(LocalStorage(str(ck)))}
    assert steps == {3: ("complete", "periodic"), 6: ("complete", "periodic"), 7: ("complete", "emergency")}
    assert list_tiers(str(memory_dir)) == []
