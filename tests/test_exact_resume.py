"""End to end: `spotrun run -- torchrun --nproc-per-node 2 ... train_gpt`, preempted by
SIGTERM (once, twice) or killed outright, resumes bit-exactly."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from tests.trainrun import (
    final_tensors,
    last_loss_per_step,
    read_log,
    sigterm,
    start_supervised,
    torchrun_command,
    wait_for_step,
)

pytestmark = pytest.mark.slow

STEPS = 30
SAVE_INTERVAL = 10
PREEMPTED = 143


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run: per-step losses and final tensors."""
    root = tmp_path_factory.mktemp("reference")
    log_file = root / "train.jsonl"
    proc = start_supervised(str(root / "ck"), torchrun_command(STEPS, SAVE_INTERVAL, log_file))
    assert proc.wait(timeout=600) == 0
    losses = last_loss_per_step(log_file)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, final_tensors(str(root / "ck"), STEPS)


def run_until_done(ck: str, log_file, preempt_at_steps: list[int], max_launches: int = 6) -> list[int]:
    """Launch the same command again and again; SIGTERM the supervisor once the log reaches each
    step in ``preempt_at_steps`` (consumed in order, one or more per launch). Returns exit codes."""
    codes: list[int] = []
    pending = list(preempt_at_steps)
    while len(codes) < max_launches:
        proc = start_supervised(ck, torchrun_command(STEPS, SAVE_INTERVAL, log_file, "--step-sleep-s", "0.05"))
        if pending:
            wait_for_step(log_file, pending.pop(0), proc)
            sigterm(proc)
        codes.append(proc.wait(timeout=600))
        if codes[-1] == 0:
            return codes
    raise AssertionError(f"not done after {max_launches} launches: exit codes {codes}")


def assert_same_as_reference(reference, ck: str, log_file) -> None:
    ref_losses, ref_tensors = reference
    assert last_loss_per_step(log_file) == ref_losses
    got = final_tensors(ck, STEPS)
    assert sorted(got) == sorted(ref_tensors)
    for name, tensor in ref_tensors.items():
        assert torch.equal(got[name], tensor), f"{name} differs"


def test_sigterm_once_resumes_exactly(reference, tmp_path):
    rng = random.Random()
    step = rng.randint(3, STEPS - 4)
    print(f"preempting at step {step}")
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    codes = run_until_done(ck, log_file, [step])
    assert codes == [PREEMPTED, 0]
    steps_logged = [row["step"] for row in read_log(log_file)]
    resumed_at = steps_logged[steps_logged.index(max(steps_logged[: steps_logged.index(1) + 1] or [1])) :]
    assert resumed_at  # the log covers both incarnations
    assert_same_as_reference(reference, ck, log_file)


def test_two_sigterms_resume_exactly(reference, tmp_path):
    rng = random.Random()
    first = rng.randint(2, STEPS // 2 - 2)
    second = rng.randint(STEPS // 2 + 2, STEPS - 3)
    print(f"preempting at steps {first} and {second}")
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    codes = run_until_done(ck, log_file, [first, second])
    assert codes == [PREEMPTED, PREEMPTED, 0]
    assert_same_as_reference(reference, ck, log_file)


def ls_json(ck: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "spotrun", "ls", ck, "--json"],
                         check=True, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)


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
    shutil.copy(f"{ck}/step-000000010/rank-00000.safetensors", f"{ck}/step-000000020/")
    assert {row["step"]: row["status"] for row in ls_json(ck)} == {10: "complete", 20: "incomplete"}

    killed_at = read_log(log_file)[-1]["step"]
    proc = start_supervised(ck, torchrun_command(STEPS, SAVE_INTERVAL, log_file))
    assert proc.wait(timeout=600) == 0
    steps_logged = [row["step"] for row in read_log(log_file)]
    restart = steps_logged[steps_logged.index(killed_at) + 1 :]
    assert restart[0] == 11, f"restart began at step {restart[0]}, expected 11 (after periodic step 10)"
    assert_same_as_reference(reference, ck, log_file)
