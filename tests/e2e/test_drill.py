"""`spotrun drill`: a rehearsed preemption of the user's own job, its restart, the comparison
with an uninterrupted run, and the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from spotrun.checkpoint import catalog
from spotrun.drill.compare import Difference, compare_states, compare_steps
from spotrun.drill.scratch import copy_step, open_scratch_root
from spotrun.errors import ConfigError
from spotrun.storage import LocalStorage, parse_location
from spotrun.train.checkpointer import Checkpointer
from tests.support.paths import JOBS
from tests.support.trainrun import ls_json, read_log, torchrun_command

PREEMPTED = 143
NOISY_JOB = str(JOBS / "noisy_job.py")


def drill(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spotrun", "drill", *args], capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.slow
def test_drill_rehearses_an_azure_preemption_and_a_restart(tmp_path):
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    result = drill(
        "--cloud",
        "azure",
        "--after-steps",
        "10",
        "--checkpoint-uri",
        ck,
        "--json",
        "--",
        *torchrun_command(30, 10, log_file, "--step-sleep-s", "0.2"),
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["problems"] == []
    assert report["first_exit_code"] == PREEMPTED and report["restart_exit_code"] == PREEMPTED
    emergency = report["emergency_step"]
    assert 10 <= emergency < 30
    assert report["resume_step"] == emergency
    assert report["first_step_after_restart"] == emergency + 1  # SPOTRUN_STOP_AT_STEP stopped it there
    assert report["notice_unix_s"] <= report["commit_unix_s"] <= report["acknowledged_unix_s"] <= report["exit_unix_s"]
    assert all(seconds is not None and seconds >= 0 for seconds in report["phases_s"].values()), report["phases_s"]

    # the exact check: an uninterrupted run from the fresh start to emergency + 1 saved the same bits
    assert report["exact"] is True and report["differences"] == [] and report["difference_count"] == 0
    assert report["start_step"] is None and report["reference_exit_code"] == PREEMPTED
    assert not os.path.exists(report["reference_uri"]) and report["reference_kept"] is False  # scratch root deleted

    listed = {row["step"]: row for row in ls_json(ck)}
    assert listed[emergency]["status"] == listed[emergency + 1]["status"] == "complete"
    assert max(listed) == emergency + 1  # the job is left resumable, one step further
    steps = [row["step"] for row in read_log(log_file)]
    # phase 1 ran 1..E, the restart exactly E+1, the reference run (same command, same log file) 1..E+1
    expected = list(range(1, emergency + 1)) + [emergency + 1] + list(range(1, emergency + 2))
    assert steps == expected, steps


@pytest.mark.slow
def test_drill_finds_a_job_that_does_not_resume_exactly(tmp_path):
    """The job adds noise from a generator seeded with its process id: every checkpoint saves and
    restores, but the resumed run's step E+1 differs from the uninterrupted run's: exit code 1."""
    ck, reference = tmp_path / "ck", tmp_path / "reference"
    result = drill(
        "--cloud",
        "signal",
        "--after-steps",
        "3",
        "--grace-period-s",
        "20",
        "--checkpoint-uri",
        str(ck),
        "--reference-uri",
        str(reference),
        "--json",
        "--",
        sys.executable,
        NOISY_JOB,
        "--steps",
        "40",
        "--step-sleep-s",
        "0.1",
        timeout_s=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["first_exit_code"] == report["restart_exit_code"] == PREEMPTED
    emergency = report["emergency_step"]
    assert report["resume_step"] == emergency and report["first_step_after_restart"] == emergency + 1
    assert report["exact"] is False and report["difference_count"] == 1  # spotrun's own RNG states do agree
    [difference] = report["differences"]
    assert difference["key"] == "model/w" and difference["max_abs_diff"] > 0, report["differences"]
    assert any("not bit-identical" in p and "model/w" in p for p in report["problems"]), report["problems"]
    assert report["reference_uri"] == str(reference)
    assert not reference.exists() or not any(p.is_file() for p in reference.rglob("*"))  # its objects deleted


@pytest.mark.slow
def test_drill_starts_the_reference_from_the_newest_checkpoint(tmp_path):
    """With a checkpoint already there (R0), the reference run starts from a copy of it; an
    exactly resumable job (noise from torch's generator, which spotrun saves) passes, and
    --keep-reference leaves the reference checkpoints in place."""
    ck, reference = tmp_path / "ck", tmp_path / "reference"
    job = [sys.executable, NOISY_JOB, "--steps", "40", "--step-sleep-s", "0.1", "--noise", "torch"]
    subprocess.run(
        job, check=True, timeout=120, env={**os.environ, "SPOTRUN_CHECKPOINT_URI": str(ck), "SPOTRUN_STOP_AT_STEP": "2"}
    )  # R0 = step 2, without spotrun run
    result = drill(
        "--cloud",
        "signal",
        "--after-steps",
        "4",
        "--grace-period-s",
        "20",
        "--checkpoint-uri",
        str(ck),
        "--reference-uri",
        str(reference),
        "--keep-reference",
        "--json",
        "--",
        *job,
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["start_step"] == 2 and report["exact"] is True and report["difference_count"] == 0
    assert report["reference_kept"] is True and report["reference_uri"] == str(reference)
    target = report["emergency_step"] + 1
    kept = {row["step"]: row["status"] for row in ls_json(str(reference))}
    assert kept[2] == kept[target] == "complete" and max(kept) == target  # the copy of R0, and the reference's E+1


@pytest.mark.slow
def test_drill_fails_on_a_job_that_does_not_save(tmp_path):
    """A job without spotrun's Checkpointer ignores the save request: the supervisor stops it at
    the deadline (exit 142) and the drill says so, exit code 1."""
    result = drill(
        "--cloud",
        "signal",
        "--after-s",
        "1",
        "--grace-period-s",
        "6",
        "--checkpoint-uri",
        str(tmp_path / "ck"),
        "--",
        sys.executable,
        "-c",
        "import time; time.sleep(300)",
        timeout_s=180,
    )
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "FAILED" in result.stdout
    assert "exited 142 after the notice" in result.stdout
    assert "exact resume: not checked" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["--after-steps", "3", "--after-s", "2", "--", "true"],  # two triggers
        ["--cloud", "oracle", "--", "true"],
        ["--after-steps", "0", "--", "true"],
        ["--cloud", "aws"],  # no command
        ["--no-exact-check", "--keep-reference", "--", "true"],
        ["--reference-uri", "CK", "--", "true"],  # the job's own root
        ["--reference-uri", "FULL", "--", "true"],  # a root that already holds objects
    ],
)
def test_drill_refuses_bad_options(tmp_path, args):
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    args = [str(tmp_path / "ck") if a == "CK" else str(full) if a == "FULL" else a for a in args]
    result = drill("--checkpoint-uri", str(tmp_path / "ck"), *args, timeout_s=120)
    assert result.returncode == 2
    assert "error" in result.stderr
    assert not (tmp_path / "ck").exists()  # nothing was launched


@pytest.mark.slow
def test_drill_of_a_command_that_does_not_exist_is_a_spotrun_error(tmp_path):
    result = drill(
        "--cloud",
        "signal",
        "--after-s",
        "1",
        "--checkpoint-uri",
        str(tmp_path / "ck"),
        "--",
        "no-such-command-spotrun",
        timeout_s=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    assert "cannot start no-such-command-spotrun" in result.stderr
    assert "failed with exit code 2 before the notice" in result.stdout
    assert "None" not in result.stdout


def test_compare_states_equal_and_bitwise():
    def state(w: torch.Tensor, lr: float = 0.1) -> dict:
        return {
            "model": {"w": w, "steps": torch.tensor(3)},
            "optimizer": {"param_groups": [{"lr": lr, "betas": (0.9, 0.99)}]},
            "nested": {1: [True, None, "x", float("nan")]},
        }

    nan_w = torch.tensor([1.0, float("nan"), -0.0], dtype=torch.float32)
    assert compare_states(state(nan_w), state(nan_w.clone())) == []  # NaN equals itself bit for bit
    # -0.0 vs 0.0: equal as numbers, different bits; max abs difference 0
    assert compare_states(state(nan_w), state(torch.tensor([1.0, float("nan"), 0.0]))) == [
        Difference("model/w", "1 of 3 element(s) differ", 0.0)
    ]
    # a differing tensor: key path and max abs difference
    differences = compare_states(state(torch.tensor([1.0, 2.0, 3.0])), state(torch.tensor([1.0, 2.5, 3.0])), "rank 1")
    assert differences == [Difference("rank 1/model/w", "1 of 3 element(s) differ", 0.5)]
    # dtype and shape differences, without comparing bytes
    assert (
        compare_states({"t": torch.zeros(2)}, {"t": torch.zeros(2, dtype=torch.float64)})[0].what
        == "dtype float32 vs float64"
    )
    assert compare_states({"t": torch.zeros(2)}, {"t": torch.zeros(3)})[0].what == "shape [2] vs [3]"
    assert compare_states({"t": torch.tensor([1, 2])}, {"t": torch.tensor([1, 3])}) == [
        Difference("t", "1 of 2 element(s) differ", None)
    ]  # integer tensors: no max abs difference


def test_compare_states_json_values():
    w = torch.ones(2)
    base = {"opt": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}, "data": {"epoch": 1, 2: "b"}, "w": w}
    assert compare_states(base, {**base, "opt": {"param_groups": [{"lr": 0.2, "betas": (0.9, 0.99)}]}}) == [
        Difference("opt/param_groups/0/lr", "0.1 vs 0.2", pytest.approx(0.1))
    ]
    assert [d.key for d in compare_states(base, {**base, "data": {"epoch": 2, 2: "b"}})] == ["data/epoch"]
    assert compare_states(base, {**base, "data": {"epoch": True, 2: "b"}})[0].what == "int 1 vs bool True"
    assert compare_states(base, {**base, "opt": {"param_groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]}})[0].key == (
        "opt/param_groups/0/betas"
    )  # a tuple is not a list
    assert compare_states(base, {**base, "data": {"epoch": 1, "2": "b"}}) == [
        Difference("data/2", "only in the resumed run"),
        Difference("data/2", "only in the reference run"),
    ]
    assert compare_states(base, {**base, "w": [1.0, 1.0]})[0].what.startswith("Tensor tensor float32[2] vs list")
    assert compare_states({"x": 0.0}, {"x": -0.0}) == [Difference("x", "0.0 vs -0.0", 0.0)]
    assert compare_states({"x": float("nan")}, {"x": float("nan")}) == []


def save_one_step(root, step: int, w: torch.Tensor) -> LocalStorage:
    storage = LocalStorage(str(root), fsync=False)
    ckpt = Checkpointer({"model": {"w": w}}, storage=storage, handle_signals=False)
    torch.manual_seed(7)
    ckpt.save(step, reason="test")
    return storage


def test_copy_step_and_compare_steps(tmp_path):
    source = save_one_step(tmp_path / "a", 3, torch.arange(4.0))
    target = LocalStorage(str(tmp_path / "b"), fsync=False)
    assert copy_step(source, target, 3) == 3  # rank 0's shard and index, then the manifest
    assert catalog.inspect_step(target, 3).status == catalog.COMPLETE
    assert compare_steps(source, target, 3) == []  # replicated state and rank 0's RNGs alike
    other = save_one_step(tmp_path / "c", 3, torch.tensor([0.0, 1.0, 2.0, 3.5]))
    assert compare_steps(source, other, 3) == [Difference("model/w", "1 of 4 element(s) differ", 0.5)]


def test_scratch_roots(tmp_path):
    local = open_scratch_root(parse_location(str(tmp_path / "ck")), None)
    try:
        assert local.temporary_dir == local.uri and os.path.isdir(local.uri) and not local.uri.startswith(str(tmp_path))
        local.storage.put("step-000000001/x", b"1")
        assert local.delete() == 1 and not os.path.exists(local.uri)
    finally:
        local.delete()
    s3 = open_scratch_root(parse_location("s3://bucket/jobs/a", endpoint_url="http://127.0.0.1:9"), None)
    assert s3.uri.startswith("s3://bucket/jobs/a-drill-reference/") and s3.temporary_dir is None
    bucket_wide = open_scratch_root(parse_location("s3://bucket", endpoint_url="http://127.0.0.1:9"), None)
    assert bucket_wide.uri.startswith("s3://bucket/spotrun-drill-reference/")
    given = tmp_path / "given"
    save_one_step(given, 1, torch.zeros(1))
    with pytest.raises(ConfigError, match="already holds objects"):
        open_scratch_root(parse_location(str(tmp_path / "ck")), str(given))
