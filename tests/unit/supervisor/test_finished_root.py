"""A start on a finished root (the same command run again) exits 0 at once without launching the
command, and says so; a job with more to do is launched as before (issue 20, from a new user's
trial: the README's own main command, run again, started torchrun only to find nothing to do)."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

from spotrun.supervisor.finished import command_digest
from tests.support.paths import JOBS
from tests.support.trainrun import ls_json

NOISY_JOB = str(JOBS / "noisy_job.py")


def run(
    root: pathlib.Path, launches: pathlib.Path, steps: int, *options: str, named_file: pathlib.Path | None = None
) -> subprocess.CompletedProcess:
    """``spotrun run`` of a one-process Checkpointer job that counts its launches in ``launches``
    (through a shell, so that the count is kept even when the job is not a spotrun job)."""
    script = (
        f"echo launched >> {shlex.quote(str(launches))} && "
        f"exec {shlex.quote(sys.executable)} {shlex.quote(NOISY_JOB)} --steps {steps} --noise torch"
    )
    command = ["sh", "-c", script, "sh", *([str(named_file)] if named_file else [])]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--checkpoint-uri",
            str(root),
            "--notice",
            "none",
            *options,
            "--",
            *command,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def launch_count(launches: pathlib.Path) -> int:
    return len(launches.read_text().splitlines()) if launches.exists() else 0


def test_the_same_command_on_a_finished_root_exits_0_without_launching(tmp_path):
    root, launches, notes = tmp_path / "ck", tmp_path / "launches.txt", tmp_path / "notes.txt"
    notes.write_text("first\n")
    first = run(root, launches, 3, named_file=notes)
    assert first.returncode == 0, first.stderr[-3000:]
    assert launch_count(launches) == 1 and max(row["step"] for row in ls_json(str(root))) == 3

    again = run(root, launches, 3, named_file=notes)
    assert again.returncode == 0, again.stderr[-3000:]
    assert launch_count(launches) == 1  # the command was not started
    [line] = [line for line in again.stderr.splitlines() if "already finished" in line]
    assert "step 3" in line and "--rerun-finished" in line and "not starting it again" in line, line
    assert "started pid" not in again.stderr

    def message(output: str) -> str:
        return output.splitlines()[-1].split(" INFO ", 1)[1]

    assert message(again.stderr) == message(first.stderr)  # the same last line: where, and what next

    forced = run(root, launches, 3, "--rerun-finished", named_file=notes)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert launch_count(launches) == 2


def test_the_last_line_of_a_finished_run_names_the_checkpoint_and_commands_that_work(tmp_path):
    root, launches = tmp_path / "ck", tmp_path / "launches.txt"
    finished = run(root, launches, 3)
    assert finished.returncode == 0, finished.stderr[-3000:]
    last = finished.stderr.splitlines()[-1]
    assert f"training finished: the checkpoint is step 3 under {root}" in last, last
    commands = re.findall(r"`([^`]+)`", last)
    assert [c.split()[:2] for c in commands] == [["spotrun", "ls"], ["spotrun", "export"]], last
    out = tmp_path / "hf"
    for command in commands:  # as printed, with OUT filled in
        words = [str(out) if word == "OUT" else word for word in shlex.split(command)]
        done = subprocess.run([sys.executable, "-m", *words], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (command, done.stdout, done.stderr[-2000:])
    assert (out / "model.safetensors.index.json").exists()


def test_a_job_with_more_to_do_is_launched(tmp_path):
    """Another --steps, an edited file named on the command line, a newer checkpoint since the
    finish: each launches the command."""
    root, launches, notes = tmp_path / "ck", tmp_path / "launches.txt", tmp_path / "notes.txt"
    notes.write_text("first\n")
    assert run(root, launches, 3, named_file=notes).returncode == 0
    extended = run(root, launches, 5, named_file=notes)  # a user extended --steps
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert launch_count(launches) == 2 and max(row["step"] for row in ls_json(str(root))) == 5

    notes.write_text("edited\n")  # e.g. a config file the script reads
    edited = run(root, launches, 5, named_file=notes)
    assert edited.returncode == 0, edited.stderr[-3000:]
    assert launch_count(launches) == 3
    assert run(root, launches, 5, named_file=notes).returncode == 0 and launch_count(launches) == 3  # finished now

    # a newer step than the record names (a preempted later run, a restore): the record is stale
    env = {**os.environ, "SPOTRUN_CHECKPOINT_URI": str(root)}
    subprocess.run([sys.executable, NOISY_JOB, "--steps", "6", "--noise", "torch"], env=env, check=True, timeout=120)
    assert run(root, launches, 5, named_file=notes).returncode == 0
    assert launch_count(launches) == 4


def test_a_command_that_saved_nothing_is_always_launched(tmp_path):
    """No complete checkpoint, no record: spotrun cannot tell a finished job from a new one."""
    root = tmp_path / "ck"
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "spotrun", "run", "--checkpoint-uri", str(root), "--notice", "none", "--", "true"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0 and "started pid" in result.stderr, result.stderr[-3000:]
    assert not (root / "finished").exists()


def test_the_command_digest_covers_the_files_the_command_line_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pathlib.Path("train.py").write_text("print(1)\n")
    pathlib.Path("cfg.yaml").write_text("lr: 1\n")
    command = ["torchrun", "train.py", "--config=cfg.yaml", "--steps", "600"]
    digest = command_digest(command)
    assert command_digest(list(command)) == digest
    assert command_digest([*command[:-1], "1200"]) != digest
    pathlib.Path("cfg.yaml").write_text("lr: 2\n")
    assert command_digest(command) != digest
    pathlib.Path("cfg.yaml").write_text("lr: 1\n")
    assert command_digest(command) == digest
    pathlib.Path("train.py").write_text("print(2)\n")
    assert command_digest(command) != digest
