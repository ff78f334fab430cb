"""Issue 10, acceptance: the example trainer with sharded state (FSDP2, tensor parallel) under
real torchrun and gloo, stopped and resumed on the same and on other layouts.

* Same layout (FSDP2 on 2 ranks, SIGTERM at a random step under ``spotrun run``): the resume is
  bit-identical to an uninterrupted run, losses and every final model and optimizer tensor.
* Another layout (FSDP2 on 2 ranks to 1 and 3 ranks, DDP to FSDP2, FSDP2 to DDP, tensor
  parallel to 1 rank, two nodes to one): every step after the change trains on the same global
  batch as the uninterrupted run (equal ``samples`` digests and learning rates), with losses
  within :data:`LOSS_RTOL`. Dropout is off there, since per-rank dropout streams cannot map
  across world sizes, and on with ``--sample-keyed-dropout``, which draws each mask from the
  sample rather than the rank.
* A global batch that does not divide by the new world size is refused before training,
  naming both numbers, and the checkpoint is untouched and loads on a fitting world size.

"Saved on 2 ranks with FSDP2 at step CHANGE_STEP" is the periodic checkpoint of that step of the
uninterrupted run itself, copied into a fresh checkpoint root: the resumed run and the
uninterrupted one then share steps 1..CHANGE_STEP by construction. Tiny model, few steps: the
runs take seconds each on 2 CPU cores; every rank computes with one intra-op thread.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.trainrun import (
    final_tensors,
    last_loss_per_step,
    ls_json,
    read_log,
    rendezvous_port,
    sigterm,
    start_supervised,
    tails,
    wait_for_step,
)

pytestmark = pytest.mark.slow

STEPS = 12
#: The step saved before a layout change (a periodic save of the uninterrupted run).
CHANGE_STEP = 5
SAVE_INTERVAL = CHANGE_STEP
#: Divides by 1, 2, 3 and 4 data-parallel ranks, not by 5.
GLOBAL_BATCH = 12
TINY_ARGS = [
    "--width",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--block-size",
    "16",
    "--max-bytes",
    "20000",
    "--batch-size",
    str(GLOBAL_BATCH),
    "--steps",
    str(STEPS),
    "--warmup-steps",
    "2",
    "--save-interval",
    str(SAVE_INTERVAL),
    "--log-interval",
    "1000",
    "--intra-op-threads",
    "1",
]
NO_DROPOUT = ["--dropout", "0"]
KEYED_DROPOUT = ["--dropout", "0.1", "--sample-keyed-dropout"]
#: Relative tolerance between the losses of one run on two layouts. Another layout adds the same
#: numbers in another order (DDP all-reduces gradient buckets, FSDP2 reduce-scatters per unit
#: over another number of ranks, tensor parallelism splits the matrix products and sums the
#: halves, each rank's mean loss covers other samples), so float32 results differ in the last
#: bits (~1e-7 relative per operation; measured here: about 1e-7 on the loss); over 7 steps of a
#: tiny model they stay far below 1e-5. The data order and learning rates are exact.
LOSS_RTOL = 1e-5
PREEMPTED = 143
_COMMITTED = re.compile(r"emergency checkpoint of step (\d+) is complete")


# --- running the trainer ---------------------------------------------------------------------


def launcher(nproc: int | None) -> list[str]:
    """torchrun with ``nproc`` ranks on this node (gloo); ``None``: one plain process (no torchrun,
    no process group)."""
    if nproc is None:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def node_launcher(nnodes: int, port: int) -> list[str]:
    """One node's torchrun: 1 process, ``nnodes`` nodes, c10d rendezvous at 127.0.0.1:``port``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"rdzv-{port}",
    ]


def trainer_command(nproc: int | list[str] | None, ck: Path, log_file: Path, *extra: str) -> list[str]:
    """The example trainer under :func:`launcher` (``nproc``) or the given launcher command."""
    start = nproc if isinstance(nproc, list) else launcher(nproc)
    return [
        *start,
        "-m",
        "spotrun.examples.train_gpt",
        "--checkpoint-uri",
        str(ck),
        "--log-file",
        str(log_file),
        *TINY_ARGS,
        *extra,
    ]


def train(nproc: int | None, ck: Path, log_file: Path, *extra: str, stop_at_step: int | None = None) -> str:
    """Run the trainer to the end (or, with ``stop_at_step``, until it saved that step and
    stopped); returns its stderr. Asserts exit code 0."""
    env = dict(os.environ)
    env.pop("SPOTRUN_STOP_AT_STEP", None)
    if stop_at_step is not None:
        env["SPOTRUN_STOP_AT_STEP"] = str(stop_at_step)
    done = subprocess.run(
        trainer_command(nproc, ck, log_file, *extra), capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


class Run:
    """An uninterrupted run: its log rows (one per step) and checkpoint root."""

    def __init__(self, root: Path, rows: list[dict]) -> None:
        self.root, self.rows = root, rows

    def saved_at(self, step: int, dest: Path) -> Path:
        """A fresh checkpoint root holding this run's checkpoint of ``step`` (a copy)."""
        name = f"step-{step:09d}"
        shutil.copytree(self.root / name, dest / name)
        return dest


def uninterrupted(tmp_path_factory, name: str, *extra: str) -> Run:
    root = tmp_path_factory.mktemp(name)
    train(2, root / "ck", root / "train.jsonl", "--fsdp", *extra)
    rows = read_log(root / "train.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return Run(root / "ck", rows)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Run:
    """FSDP2 on 2 ranks, dropout off, STEPS steps: the reference of every layout change."""
    return uninterrupted(tmp_path_factory, "fsdp", *NO_DROPOUT)


@pytest.fixture(scope="module")
def keyed_run(tmp_path_factory) -> Run:
    """FSDP2 on 2 ranks with dropout 0.1 drawn by --sample-keyed-dropout, STEPS steps."""
    return uninterrupted(tmp_path_factory, "fsdp-keyed", *KEYED_DROPOUT)


def assert_continues(rows: list[dict], reference: Run, after_step: int) -> None:
    """``rows`` are steps ``after_step + 1`` to STEPS of ``reference``: the same global batches
    (samples digests) and learning rates, losses within LOSS_RTOL."""
    expected = [row for row in reference.rows if row["step"] > after_step]
    assert [(r["step"], r["samples"], r["lr"]) for r in rows] == [(r["step"], r["samples"], r["lr"]) for r in expected]
    print(
        "largest relative loss difference:",
        max(abs(r["loss"] - e["loss"]) / abs(e["loss"]) for r, e in zip(rows, expected)),
    )
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in expected], rel=LOSS_RTOL)


def supervise(ck: Path, command: list[str], log_path: Path, processes: list) -> subprocess.Popen:
    """``spotrun run --notice none -- command`` (output to ``log_path``), killed at the end if left."""
    proc = start_supervised(str(ck), command, grace_period_s=120, extra_options=["--notice", "none"], log_path=log_path)
    processes.append(proc)
    return proc


def text(path: Path) -> str:
    return path.read_text(errors="replace")


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path) -> SHA-256 of its bytes; the event log
    (``events/``, which records each launch, the refused one too) left out."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != "events"
    }


# --- 1. same layout: bit-identical ----------------------------------------------------------


def test_fsdp2_sigterm_at_a_random_step_resumes_on_2_ranks_bit_identically(tmp_path_factory, tmp_path, processes):
    """FSDP2 on 2 ranks with ordinary dropout (each rank's own generator, restored): SIGTERM to
    ``spotrun run`` at a random step, then the same command again. Every step's loss and every
    final model and optimizer tensor (gathered to full from the final checkpoints) equal the
    uninterrupted run's bit for bit."""
    dropout = ["--dropout", "0.1"]
    reference = uninterrupted(tmp_path_factory, "fsdp-dropout", *dropout)
    ck, log_file = tmp_path / "ck", tmp_path / "train.jsonl"
    preempt_at = random.Random().randint(2, STEPS - 4)  # at least 4 steps of 0.2 s left to see the notice
    print(f"preempting at step {preempt_at}")

    first = start_supervised(
        str(ck),
        trainer_command(2, ck, log_file, "--fsdp", *dropout, "--step-sleep-s", "0.2"),
        extra_options=["--notice", "none"],
        log_path=tmp_path / "first.log",
    )
    processes.append(first)
    wait_for_step(log_file, preempt_at, first)
    sigterm(first)
    assert first.wait(timeout=300) == PREEMPTED, (tmp_path / "first.log").read_text(errors="replace")[-4000:]
    [step] = [int(s) for s in _COMMITTED.findall((tmp_path / "first.log").read_text(errors="replace"))]
    assert preempt_at <= step < STEPS
    listed = {row["step"]: row for row in ls_json(str(ck))}
    assert max(listed) == step
    assert (listed[step]["status"], listed[step]["layout"]) == ("complete", "2 ranks, mesh 2")

    rows_before = len(read_log(log_file))
    second = start_supervised(
        str(ck),
        trainer_command(2, ck, log_file, "--fsdp", *dropout),
        extra_options=["--notice", "none"],
        log_path=tmp_path / "second.log",
    )
    processes.append(second)
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text(errors="replace")[-4000:]
    assert [row["step"] for row in read_log(log_file)[rows_before:]] == list(range(step + 1, STEPS + 1))

    assert last_loss_per_step(log_file) == {row["step"]: row["loss"] for row in reference.rows}
    got, expected = final_tensors(str(ck), STEPS, world_size=1), final_tensors(str(reference.root), STEPS, world_size=1)
    assert sorted(got) == sorted(expected) and any(name.startswith("optimizer/") for name in expected)
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []


# --- 2. another layout: the same samples, losses within rounding ----------------------------


@pytest.mark.parametrize(
    "saved_by, resumed_on",
    [
        ("fsdp", (1, ["--fsdp"])),
        ("fsdp", (3, ["--fsdp"])),
        ("fsdp", (2, [])),  # DDP
        ("ddp", (2, ["--fsdp"])),
    ],
    ids=["fsdp2-2-ranks-to-fsdp2-1-rank", "fsdp2-2-ranks-to-fsdp2-3-ranks", "fsdp2-to-ddp", "ddp-to-fsdp2"],
)
def test_a_layout_change_trains_on_the_same_samples_with_losses_within_rounding(
    fsdp_run, tmp_path, saved_by: str, resumed_on: tuple[int, list[str]]
):
    """Saved at step CHANGE_STEP on 2 ranks (FSDP2, or DDP), resumed on another layout, dropout
    off: steps CHANGE_STEP+1 to the end train on the uninterrupted FSDP2 run's global batches
    with its learning rates, and losses within LOSS_RTOL."""
    if saved_by == "fsdp":
        ck = fsdp_run.saved_at(CHANGE_STEP, tmp_path / "ck")
    else:  # DDP on 2 ranks, stopped after saving CHANGE_STEP
        ck = tmp_path / "ck"
        train(2, ck, tmp_path / "ddp.jsonl", *NO_DROPOUT, stop_at_step=CHANGE_STEP)
        ddp_rows, fsdp_rows = read_log(tmp_path / "ddp.jsonl"), fsdp_run.rows[:CHANGE_STEP]
        assert [(r["step"], r["samples"]) for r in ddp_rows] == [(r["step"], r["samples"]) for r in fsdp_rows]
    nproc, layout = resumed_on
    stderr = train(nproc, ck, tmp_path / "resumed.jsonl", *NO_DROPOUT, *layout)
    mesh = ", mesh 2" if saved_by == "fsdp" else ""
    onto = "the same world size" if nproc == 2 else "another world size: resharded"
    assert f"restored step {CHANGE_STEP} (saved by 2 ranks{mesh}) onto {nproc} rank" in stderr
    assert onto in stderr
    assert_continues(read_log(tmp_path / "resumed.jsonl"), fsdp_run, CHANGE_STEP)


@pytest.mark.parametrize("nproc", [3], ids=["fsdp2-3-ranks"])  # growing: new ranks reseed their own RNGs
def test_sample_keyed_dropout_keeps_losses_within_rounding_at_another_world_size(keyed_run, tmp_path, nproc):
    """Dropout on (0.1) with --sample-keyed-dropout: FSDP2 saved on 2 ranks at CHANGE_STEP and
    resumed on 1 or 3 ranks draws the same masks for the same samples, so the losses after the
    change stay within LOSS_RTOL of the uninterrupted 2-rank run (rank-keyed dropout cannot)."""
    reference = keyed_run
    ck = reference.saved_at(CHANGE_STEP, tmp_path / "ck")
    stderr = train(nproc, ck, tmp_path / "resumed.jsonl", "--fsdp", *KEYED_DROPOUT)
    assert "world size changed from 2 to" in stderr  # the RNG policy applied, and was logged
    assert_continues(read_log(tmp_path / "resumed.jsonl"), reference, CHANGE_STEP)


# --- 3. two nodes, then one ----------------------------------------------------------------


def test_two_nodes_preempted_then_one_node_resumes_their_fsdp2_checkpoint_and_finishes(fsdp_run, tmp_path, processes):
    """Two nodes on loopback (a `spotrun run` supervisor each, `torchrun --nnodes 2
    --nproc-per-node 1`, c10d rendezvous), FSDP2: a SIGTERM to one supervisor makes both nodes
    save the same step and exit 143. One node does not come back: the same command with
    `--nnodes 1` resumes the 2-rank checkpoint on 1 rank and finishes, on the uninterrupted
    run's global batches with losses within LOSS_RTOL."""
    ck, log_file = tmp_path / "ck", tmp_path / "train.jsonl"  # only global rank 0 writes the log
    port = rendezvous_port()
    nodes = [
        supervise(
            ck,
            trainer_command(node_launcher(2, port), ck, log_file, "--fsdp", *NO_DROPOUT, "--step-sleep-s", "0.2"),
            tmp_path / f"first-node{n}.log",
            processes,
        )
        for n in range(2)
    ]
    outputs = tuple(tmp_path / f"first-node{n}.log" for n in range(2))  # supervisor, torchrun and worker output
    wait_for_step(log_file, 3, nodes[0], outputs=outputs)
    sigterm(nodes[0])  # the notice reaches node 0 only
    assert [proc.wait(timeout=300) for proc in nodes] == [PREEMPTED] * 2, tails(outputs)
    committed = [[int(s) for s in _COMMITTED.findall(text(tmp_path / f"first-node{n}.log"))] for n in range(2)]
    assert committed[0] == committed[1] and len(committed[0]) == 1, committed  # the same step on both nodes
    step = committed[0][0]
    assert 3 <= step < STEPS
    listed = {row["step"]: row for row in ls_json(str(ck))}
    assert max(listed) == step
    assert (listed[step]["status"], listed[step]["layout"]) == ("complete", "2 ranks, mesh 2")
    rows_before = read_log(log_file)
    assert [r["samples"] for r in rows_before] == [r["samples"] for r in fsdp_run.rows[:step]]

    restart = supervise(
        ck,
        trainer_command(node_launcher(1, rendezvous_port()), ck, log_file, "--fsdp", *NO_DROPOUT),
        tmp_path / "restart.log",
        processes,
    )
    assert restart.wait(timeout=300) == 0, text(tmp_path / "restart.log")[-4000:]
    restart_log = text(tmp_path / "restart.log")
    assert (
        f"step {step} (saved by 2 ranks, mesh 2) resumes on 1 node x 1 process = 1 rank; another world size "
        f"than the checkpoint's 2: the workers reshard it"
    ) in restart_log
    assert (
        f"restored step {step} (saved by 2 ranks, mesh 2) onto 1 rank, mesh 1 (another world size: resharded)"
        in restart_log
    )
    assert_continues(read_log(log_file)[len(rows_before) :], fsdp_run, step)


# --- 4. tensor parallel to one rank ---------------------------------------------------------


def test_tensor_parallel_saved_on_2_ranks_resumes_on_1_rank_and_finishes(fsdp_run, tmp_path):
    """--tp 2 on 2 ranks (a column-wise / row-wise Linear pair in every block), stopped after
    saving step CHANGE_STEP; one plain process without TP resumes it and finishes, on the
    uninterrupted run's global batches with losses within LOSS_RTOL."""
    ck = tmp_path / "ck"
    train(2, ck, tmp_path / "tp.jsonl", "--tp", "2", *NO_DROPOUT, stop_at_step=CHANGE_STEP)
    tp_rows = read_log(tmp_path / "tp.jsonl")
    assert [r["samples"] for r in tp_rows] == [r["samples"] for r in fsdp_run.rows[:CHANGE_STEP]]
    stderr = train(None, ck, tmp_path / "resumed.jsonl", *NO_DROPOUT)
    assert (
        f"restored step {CHANGE_STEP} (saved by 2 ranks, mesh 2) onto 1 rank (another world size: resharded)" in stderr
    )
    assert_continues(read_log(tmp_path / "resumed.jsonl"), fsdp_run, CHANGE_STEP)


# --- 5. a global batch the new world size cannot split ---------------------------------------


def test_a_global_batch_not_divisible_by_the_new_world_size_is_refused(fsdp_run, tmp_path, processes):
    """A global batch that does not divide by the new world size is refused and loses nothing.

    The FSDP2 2-rank checkpoint (global batch 12) resumed under `spotrun run` on 5 ranks:
    refused before any step, the message naming both numbers; the checkpoint root is unchanged
    byte for byte, and a fitting world size (one process) then resumes it and finishes."""
    ck, log_file = fsdp_run.saved_at(CHANGE_STEP, tmp_path / "ck"), tmp_path / "train.jsonl"
    before = tree_digest(ck)
    refused = supervise(
        ck, trainer_command(5, ck, log_file, "--fsdp", *NO_DROPOUT), tmp_path / "refused.log", processes
    )
    code = refused.wait(timeout=300)
    refused_log = text(tmp_path / "refused.log")
    assert code not in (0, PREEMPTED), refused_log[-4000:]
    assert (
        f"the global batch (--batch-size {GLOBAL_BATCH}) does not divide by the 5 data-parallel ranks "
        f"(world size 5 / --tp 1)"
    ) in refused_log
    assert read_log(log_file) == []  # no step trained
    assert tree_digest(ck) == before

    stderr = train(None, ck, log_file, *NO_DROPOUT)
    assert f"restored step {CHANGE_STEP} (saved by 2 ranks, mesh 2) onto 1 rank" in stderr
    assert_continues(read_log(log_file), fsdp_run, CHANGE_STEP)
