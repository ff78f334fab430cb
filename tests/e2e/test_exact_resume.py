"""End to end: `spotrun run -- torchrun --nproc-per-node 2 ... train_gpt`, preempted by
SIGTERM (once, twice) or killed outright, resumes bit-exactly."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time

import pytest

from tests.support import trainrun
from tests.support.ckpt_files import data_files, manifest_path, shard_path
from tests.support.trainrun import (
    assert_same_as_reference,
    ls_json,
    read_log,
    sigterm,
    start_supervised,
    torchrun_command,
    wait_for_step,
)

pytestmark = pytest.mark.slow

STEPS = trainrun.REFERENCE_STEPS  # the shared reference run (conftest.py)
SAVE_INTERVAL = trainrun.REFERENCE_SAVE_INTERVAL
PREEMPTED = 143


def wait_for_text(path, text: str, proc, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (path.read_text(errors="replace") if path.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, f"never logged {text!r}"
        time.sleep(0.05)


def run_until_done(
    ck: str, log_file, preempt_at_steps: list[int], max_launches: int = 6, sigterms_per_preemption: int = 1
) -> list[int]:
    """Launch the same command again and again; SIGTERM the supervisor once the log reaches each
    step in ``preempt_at_steps`` (one per launch; ``sigterms_per_preemption`` signals each time,
    the later ones while the emergency save is under way). Returns the exit codes."""
    codes: list[int] = []
    pending = list(preempt_at_steps)
    supervisor_log = log_file.parent / "supervisor.log"
    while len(codes) < max_launches:
        supervisor_log.unlink(missing_ok=True)
        proc = start_supervised(
            ck, torchrun_command(STEPS, SAVE_INTERVAL, log_file, "--step-sleep-s", "0.05"), log_path=supervisor_log
        )
        if pending:
            wait_for_step(log_file, pending.pop(0), proc)
            sigterm(proc)
            for _ in range(sigterms_per_preemption - 1):
                wait_for_text(supervisor_log, "preemption notice", proc)
                sigterm(proc)
                wait_for_text(supervisor_log, "ignoring another notice", proc)
        codes.append(proc.wait(timeout=600))
        if codes[-1] == 0:
            return codes
    raise AssertionError(f"not done after {max_launches} launches: exit codes {codes}")


def test_sigterm_once_resumes_exactly(reference, tmp_path):
    rng = random.Random()
    step = rng.randint(3, STEPS - 4)
    print(f"preempting at step {step}")
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    codes = run_until_done(ck, log_file, [step])
    assert codes == [PREEMPTED, 0]
    emergency = [row["step"] for row in ls_json(ck) if row["reason"] == "emergency"]
    assert len(emergency) == 1 and step <= emergency[0] < STEPS, emergency
    assert_same_as_reference(reference, ck, log_file)


def test_two_sigterms_resume_exactly(reference, tmp_path):
    rng = random.Random()
    first = rng.randint(2, STEPS // 2 - 2)
    second = rng.randint(STEPS // 2 + 2, STEPS - 3)
    print(f"preempting at steps {first} and {second}")
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    codes = run_until_done(ck, log_file, [first, second], sigterms_per_preemption=2)
    assert codes == [PREEMPTED, PREEMPTED, 0]
    assert len([row for row in ls_json(ck) if row["reason"] == "emergency"]) == 2
    assert_same_as_reference(reference, ck, log_file)


def test_sigkill_resumes_from_last_periodic_checkpoint(reference, tmp_path):
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    proc = start_supervised(ck, torchrun_command(STEPS, SAVE_INTERVAL, log_file, "--step-sleep-s", "0.05"))
    wait_for_step(log_file, 14, proc)
    # No chance to save: SIGKILL the supervisor and every process below it at once.
    from spotrun.supervisor.process import descendants

    victims = [proc.pid] + [p.pid for p in descendants(proc.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    listed = {row["step"]: row["status"] for row in ls_json(ck)}
    assert listed == {10: "complete"}

    # A step directory that a crash left without a manifest (a rank finished its shard,
    # the commit never happened): ignored on resume, shown as incomplete.
    os.makedirs(f"{ck}/step-000000020")
    shutil.copy(shard_path(ck, 10, 0), f"{ck}/step-000000020/")
    assert {row["step"]: row["status"] for row in ls_json(ck)} == {10: "complete", 20: "incomplete"}

    killed_at = read_log(log_file)[-1]["step"]
    proc = start_supervised(ck, torchrun_command(STEPS, SAVE_INTERVAL, log_file))
    assert proc.wait(timeout=600) == 0
    steps_logged = [row["step"] for row in read_log(log_file)]
    restart = steps_logged[steps_logged.index(killed_at) + 1 :]
    assert restart[0] == 11, f"restart began at step {restart[0]}, expected 11 (after periodic step 10)"
    assert_same_as_reference(reference, ck, log_file)


def test_replicated_state_is_written_once_spread_over_ranks_by_bytes(reference):
    from safetensors import safe_open

    step_dir = reference[2] / f"step-{STEPS:09d}"
    manifest = json.loads(manifest_path(reference[2], STEPS).read_text())
    keys_by_file = {}
    for record in data_files(manifest):
        with safe_open(str(step_dir / record["path"]), framework="pt") as f:
            keys_by_file[record["path"]] = {
                k: f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()
            }
    replicated = {n for n in manifest["tensors"] if not n.startswith("rank-")}
    stored = [k for keys in keys_by_file.values() for k in keys if not k.startswith("rank-")]
    assert sorted(stored) == sorted(replicated)  # every replicated tensor exactly once in total
    per_rank_bytes = [sum(b for k, b in keys.items() if not k.startswith("rank-")) for keys in keys_by_file.values()]
    assert len(per_rank_bytes) == 2 and min(per_rank_bytes) > 0.8 * max(per_rank_bytes), per_rank_bytes


def rank_pids(supervisor_pid: int) -> list[int]:
    """The training ranks: torchrun starts each in its own session (pgid == pid)."""
    from spotrun.supervisor.process import descendants

    ranks = []
    for info in descendants(supervisor_pid):
        try:
            with open(f"/proc/{info.pid}/cmdline", "rb") as f:
                cmdline = f.read()
            is_rank = b"spotrun.examples.train_gpt" in cmdline and b"torch.distributed.run" not in cmdline
            if is_rank and os.getpgid(info.pid) == info.pid:
                ranks.append(info.pid)
        except (OSError, ProcessLookupError):
            continue
    return ranks


def test_sigterm_to_the_ranks_and_their_loader_workers_still_resumes_exactly(reference, tmp_path):
    """Field case C09: num_workers=4, then SIGTERM to each rank's whole process group (the rank
    and its loader workers), as torchrun or a VM shutdown does: a complete checkpoint is written
    and the run resumes from it, exactly."""
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    command = torchrun_command(STEPS, SAVE_INTERVAL, log_file, "--step-sleep-s", "0.05", "--num-workers", "4")
    proc = start_supervised(ck, command)
    wait_for_step(log_file, 12, proc)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2, ranks
    for pgid in ranks:
        os.killpg(pgid, signal.SIGTERM)
    assert proc.wait(timeout=600) == PREEMPTED
    emergency = [row for row in ls_json(ck) if row["reason"] == "emergency"]
    assert len(emergency) == 1 and emergency[0]["status"] == "complete" and emergency[0]["step"] >= 12

    logged_before_restart = len(read_log(log_file))
    proc = start_supervised(ck, torchrun_command(STEPS, SAVE_INTERVAL, log_file, "--num-workers", "4"))
    assert proc.wait(timeout=600) == 0
    assert read_log(log_file)[logged_before_restart]["step"] == emergency[0]["step"] + 1
    assert_same_as_reference(reference, ck, log_file)  # the reference ran with num_workers=0
