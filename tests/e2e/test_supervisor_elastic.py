"""`spotrun run -- torchrun --nnodes MIN:MAX ...`: an elastic node range.

The supervisor reads torchrun's options with torchrun's own parser and says in its start log
which step it resumes, how many ranks saved it (and their meshes) and how many it launches
(for a range: the range, the count being known after the rendezvous). The end-to-end test runs
a real `torchrun --nnodes 1:2 --nproc-per-node 1` with a c10d rendezvous on loopback, one node
coming: it trains, is preempted, and the restart resumes and finishes, bit-identical to an
uninterrupted run of the same command. The fast tests give the supervisor a stand-in
`torchrun` executable (it records that it ran and exits 0), since only the command line
matters to them.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import uuid

import pytest

from tests.jobs.fakeckpt import write_step
from tests.support.paths import JOBS
from tests.support.trainrun import (
    TRAIN_ARGS,
    final_tensors,
    last_loss_per_step,
    ls_json,
    read_log,
    rendezvous_port,
    sigterm,
    start_supervised,
    wait_for_step,
)

STEPS = 16
SAVE_INTERVAL = 5
PREEMPTED = 143
_COMMITTED = re.compile(r"emergency checkpoint of step (\d+) is complete")
ELASTIC_RANKS = (
    "1 to 2 nodes x 1 process = 1 to 2 ranks (torchrun --nnodes 1:2: the count is known after the rendezvous"
)


def elastic_command(log_file: pathlib.Path, *extra: str) -> list[str]:
    """One node's torchrun for 1 to 2 nodes of 1 process, c10d rendezvous on 127.0.0.1; a second
    node is waited for 1 s (``last_call_timeout``) once the first joined."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{rendezvous_port()}",
        "--rdzv-id",
        uuid.uuid4().hex[:12],
        "--rdzv-conf",
        "last_call_timeout=1",
        "-m",
        "spotrun.examples.train_gpt",
        "--steps",
        str(STEPS),
        "--save-interval",
        str(SAVE_INTERVAL),
        "--log-file",
        str(log_file),
        *TRAIN_ARGS,
        *extra,
    ]


def supervise(ck: str, command: list[str], log_path: pathlib.Path, processes: list) -> subprocess.Popen:
    proc = start_supervised(ck, command, grace_period_s=120, extra_options=["--notice", "none"], log_path=log_path)
    processes.append(proc)
    return proc


@pytest.mark.slow
def test_elastic_range_on_one_node_is_preempted_and_resumes_exactly(tmp_path, processes):
    # the uninterrupted reference: the same command, one node
    ref_ck, ref_log = str(tmp_path / "ref-ck"), tmp_path / "ref.jsonl"
    reference = supervise(ref_ck, elastic_command(ref_log), tmp_path / "ref.log", processes)
    assert reference.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text(errors="replace")
    ref_losses = last_loss_per_step(ref_log)
    assert sorted(ref_losses) == list(range(1, STEPS + 1))

    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    first = supervise(ck, elastic_command(log_file, "--step-sleep-s", "0.05"), tmp_path / "first.log", processes)
    wait_for_step(log_file, 3, first)
    sigterm(first)
    assert first.wait(timeout=300) == PREEMPTED
    first_log = (tmp_path / "first.log").read_text(errors="replace")
    assert f"fresh start on {ELASTIC_RANKS}" in first_log
    assert "(world size 1) on cpu" in first_log  # the trainer's own line: the count after the rendezvous
    [step] = [int(s) for s in _COMMITTED.findall(first_log)]
    assert 3 <= step < STEPS

    rows_before = len(read_log(log_file))
    restart = supervise(ck, elastic_command(log_file), tmp_path / "restart.log", processes)
    assert restart.wait(timeout=600) == 0, (tmp_path / "restart.log").read_text(errors="replace")
    restart_log = (tmp_path / "restart.log").read_text(errors="replace")
    assert f"step {step} (saved by 1 rank) resumes on {ELASTIC_RANKS}" in restart_log
    assert read_log(log_file)[rows_before]["step"] == step + 1

    assert last_loss_per_step(log_file) == ref_losses
    got, expected = final_tensors(ck, STEPS, world_size=1), final_tensors(ref_ck, STEPS, world_size=1)
    assert sorted(got) == sorted(expected)
    assert all(got[name].equal(expected[name]) for name in expected)
    listed = {row["step"]: row for row in ls_json(ck)}
    assert (listed[STEPS]["status"], listed[STEPS]["layout"]) == ("complete", "1 rank")


# --- the command line alone (a stand-in torchrun) ------------------------------------------------


@pytest.fixture
def torchrun(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """An executable named `torchrun` that records its arguments in a file and exits 0."""
    marker = tmp_path / "torchrun-ran"
    path = tmp_path / "bin" / "torchrun"
    path.parent.mkdir()
    path.write_text(f"#!{sys.executable}\nimport sys\nopen({str(marker)!r}, 'w').write(' '.join(sys.argv[1:]))\n")
    path.chmod(0o755)
    return path, marker


def spotrun_run(ck: pathlib.Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spotrun", "run", "--notice", "none", "--checkpoint-uri", str(ck), "--", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_fixed_count_other_than_the_checkpoints_is_logged_with_both_layouts(tmp_path, torchrun):
    program, marker = torchrun
    ck = tmp_path / "ck"
    write_step(str(ck), 100, world_size=4, meshes=[{"shape": [2, 2], "dim_names": ["dp", "tp"]}])
    done = spotrun_run(ck, str(program), "--nnodes=2", "--nproc_per_node=1", "train.py", "--nnodes", "9")
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "--nnodes=2 --nproc_per_node=1 train.py --nnodes 9"
    assert (
        "step 100 (saved by 4 ranks, mesh 2x2) resumes on 2 nodes x 1 process = 2 ranks; another world "
        "size than the checkpoint's 4: the workers reshard it"
    ) in done.stderr


def test_a_range_with_the_static_rendezvous_is_warned_not_elastic(tmp_path, torchrun):
    program, _marker = torchrun
    done = spotrun_run(tmp_path / "ck", str(program), "--nnodes", "1:2", "--nproc-per-node", "2", "train.py")
    assert done.returncode == 0, done.stderr
    assert (
        "WARNING torchrun --nnodes 1:2 with the static rendezvous (torchrun's default without --rdzv-backend) "
        "is not elastic: it waits for all 2 nodes"
    ) in done.stderr
    assert "fresh start on 1 to 2 nodes x 2 processes = 2 to 4 ranks" in done.stderr


def test_nnodes_from_torchruns_environment_default_is_read(tmp_path, torchrun):
    """torchrun takes an option it is not given from PET_<OPTION>: so does the supervisor."""
    program, _marker = torchrun
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--notice",
            "none",
            "--checkpoint-uri",
            str(tmp_path / "ck"),
            "--",
            str(program),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:1",
            "train.py",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PET_NNODES": "2:4", "PET_NPROC_PER_NODE": "8"},
    )
    assert done.returncode == 0, done.stderr
    assert "fresh start on 2 to 4 nodes x 8 processes = 16 to 32 ranks (torchrun --nnodes 2:4:" in done.stderr
    assert "waits up to 30 s for more nodes once 2 joined" in done.stderr


def test_an_impossible_node_range_is_refused_before_anything_starts(tmp_path, torchrun):
    program, marker = torchrun
    ck = tmp_path / "ck"
    done = spotrun_run(ck, str(program), "--nnodes", "3:2", "train.py")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines()[-1] == "spotrun: error: torchrun --nnodes 3:2: the range needs 0 < MIN <= MAX"
    assert not marker.exists() and not ck.exists()


def test_a_command_that_is_not_torchrun_leaves_the_count_to_the_workers(tmp_path):
    done = spotrun_run(tmp_path / "ck", sys.executable, "-c", "pass")
    assert done.returncode == 0, done.stderr
    assert (
        "fresh start on as many ranks as the launch command starts (not a torchrun command: the workers log the count)"
    ) in done.stderr


RESTARTED_IN_PLACE = JOBS / "restarted_in_place.py"


@pytest.mark.slow
def test_workers_started_again_after_their_emergency_checkpoint_finish_with_exit_0(tmp_path, processes):
    """torchrun starts the workers again within one launch after they saved on its SIGTERM (an
    elastic node change): that emergency checkpoint did not end the launch, so a job that then
    finishes exits 0 (not 143, preempted), and the log says why."""
    ck, log_path = str(tmp_path / "ck"), tmp_path / "spotrun.log"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
        str(RESTARTED_IN_PLACE),
        "9",
        "2",
    ]
    proc = supervise(ck, command, log_path, processes)
    assert proc.wait(timeout=300) == 0, log_path.read_text(errors="replace")
    text = log_path.read_text(errors="replace")
    assert "attempt 0 resumed at step 0" in text and "attempt 1 resumed at step 3" in text
    assert (
        "the workers took an emergency checkpoint of step 3, then torchrun started them again in this launch "
        "(an elastic node change, or its --max-restarts) and they saved step 9: that checkpoint did not end "
        "the launch"
    ) in text
    assert f"training finished: the checkpoint is step 9 under {ck}" in text.splitlines()[-1]
    listed = {row["step"]: row for row in ls_json(ck)}
    assert listed[3]["reason"] == "emergency" and listed[9]["reason"] == "final"
