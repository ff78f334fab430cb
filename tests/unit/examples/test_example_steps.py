"""The example trainer refuses a checkpoint whose fixed-length LR schedule ends at another step
than ``--steps`` (issue 20, from a new user's trial: 20 steps, then the same with ``--steps 40``
on the same root died at step 21 with a traceback from torch's OneCycleLR)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from spotrun.errors import StateMismatchError
from spotrun.examples.gpt import GPT, GPTConfig
from spotrun.examples.train_gpt import FixedLengthSchedule, build_optimizer, build_scheduler
from tests.support.trainrun import ls_json

TINY_ARGS = [
    "--width",
    "16",
    "--depth",
    "1",
    "--heads",
    "2",
    "--block-size",
    "16",
    "--batch-size",
    "4",
    "--max-bytes",
    "20000",
    "--save-interval",
    "4",
    "--log-interval",
    "1000",
]


def schedule(kind: str, steps: int, warmup_steps: int) -> FixedLengthSchedule:
    torch.manual_seed(0)
    opt = build_optimizer(GPT(GPTConfig(block_size=4, width=8, depth=1, heads=1)), 1e-3, 0.1)
    return FixedLengthSchedule(build_scheduler(opt, kind, steps, warmup_steps), kind, steps)


@pytest.mark.parametrize(("kind", "warmup_steps"), [("onecycle", 2), ("cosine", 2), ("cosine", 0)])
def test_a_fixed_length_schedule_refuses_another_length(kind, warmup_steps):
    saved = json.loads(json.dumps(schedule(kind, 20, warmup_steps).state_dict()))  # as a checkpoint holds it
    schedule(kind, 20, warmup_steps).load_state_dict(saved)
    for steps in (40, 10):
        with pytest.raises(StateMismatchError, match=f"ends at step 20 .*not at --steps {steps}"):
            schedule(kind, steps, warmup_steps).load_state_dict(saved)


def test_a_constant_schedule_extends_and_another_kind_is_refused():
    saved = json.loads(json.dumps(schedule("constant", 20, 0).state_dict()))
    schedule("constant", 40, 0).load_state_dict(saved)  # no end: a longer run is the same schedule
    with pytest.raises(StateMismatchError, match="not a --schedule onecycle schedule"):
        schedule("onecycle", 20, 2).load_state_dict(saved)


def train(root, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrun.examples.train_gpt",
            "--steps",
            str(steps),
            "--checkpoint-uri",
            str(root),
            *TINY_ARGS,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_an_extended_steps_is_refused_before_training_in_one_line(tmp_path):
    root = tmp_path / "ck"
    assert train(root, 8).returncode == 0
    incarnations = sorted(p.name for p in (root / "incarnations").iterdir())
    extended = train(root, 16)
    assert extended.returncode == 2, extended.stderr[-3000:]
    assert "Traceback" not in extended.stderr
    [line] = [line for line in extended.stderr.splitlines() if "ERROR" in line]
    assert "ends at step 8" in line and "--steps 16" in line and "cannot be extended" in line, line
    assert sorted(p.name for p in (root / "incarnations").iterdir()) == incarnations  # nothing changed
    assert max(row["step"] for row in ls_json(str(root))) == 8
    assert train(root, 8).returncode == 0  # the checkpoint still resumes with its own --steps
