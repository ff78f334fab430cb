"""Two nodes on one machine: two `spotrun run` supervisors, each running
`torchrun --nnodes 2 --nproc-per-node 1` with c10d rendezvous on loopback, one checkpoint
directory. A notice (SIGTERM) reaches ONE supervisor only: the ranks of both nodes save the
same step, both supervisors exit 143 (the other one because its own workers report the
emergency commit), and restarting both resumes exactly.

The reference is an uninterrupted run of the same 2-node topology: a single-node 2-rank run
is not bit-identical to it, because torchrun sets OMP_NUM_THREADS=1 only when a node runs
several processes, so the two topologies use different intra-op thread counts (here 2 per
process, as every checkpoint records; the machine's load does not matter, see
tests/e2e/test_determinism.py).
"""

from __future__ import annotations

import os
import re
import sys
import uuid

import pytest
import torch

from spotrun.checkpoint.restore import load_committed
from spotrun.storage import open_storage
from tests.support.trainrun import (
    TRAIN_ARGS,
    final_tensors,
    kill_tree,
    last_loss_per_step,
    ls_json,
    read_log,
    rendezvous_port,
    sigterm,
    start_supervised,
    wait_for_step,
)

pytestmark = pytest.mark.slow

STEPS = 30
SAVE_INTERVAL = 10
NODES = 2
PREEMPTED = 143
_COMMITTED = re.compile(r"emergency checkpoint of step (\d+) is complete")


def node_command(port: int, rdzv_id: str, log_file, *extra: str) -> list[str]:
    """One node's torchrun: 1 process, 2 nodes, c10d rendezvous at 127.0.0.1:port.
    Both nodes get the same ``--log-file``: only global rank 0 writes it."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(NODES),
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        rdzv_id,
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


def start_nodes(ck: str, log_file, log_prefix, processes: list, *extra: str) -> list:
    """Start both nodes' supervisors (a fresh rendezvous each launch); their logs go to
    ``<log_prefix>-node<N>.log``."""
    port, rdzv_id = rendezvous_port(), uuid.uuid4().hex[:12]
    nodes = []
    for node in range(NODES):
        proc = start_supervised(
            ck,
            node_command(port, rdzv_id, log_file, *extra),
            grace_period_s=120,
            extra_options=["--notice", "none"],
            log_path=f"{log_prefix}-node{node}.log",
        )
        processes.append(proc)
        nodes.append(proc)
    return nodes


def node_logs(log_prefix) -> list[str]:
    return [open(f"{log_prefix}-node{node}.log", errors="replace").read() for node in range(NODES)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 2-node run: per-step losses, final tensors, each rank's recorded
    numerics settings (one process per node: as many intra-op threads as CPUs)."""
    root = tmp_path_factory.mktemp("reference")
    started: list = []
    try:
        nodes = start_nodes(str(root / "ck"), root / "train.jsonl", root / "supervisor", started)
        assert [proc.wait(timeout=600) for proc in nodes] == [0] * NODES
    finally:
        for proc in started:
            kill_tree(proc)
    losses = last_loss_per_step(root / "train.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    numerics = [
        load_committed(open_storage(str(root / "ck")), STEPS, rank, NODES).rank_local["numerics"]
        for rank in range(NODES)
    ]
    assert [n["intra_op_threads"] for n in numerics] == [len(os.sched_getaffinity(0))] * NODES
    return losses, final_tensors(str(root / "ck"), STEPS), numerics


@pytest.mark.parametrize("agreement", ["immediate", "pipelined"])
def test_notice_to_one_node_saves_both_and_resumes_exactly(reference, tmp_path, processes, monkeypatch, agreement):
    """Pipelined (issue 26, point 5): the agreement read one look after it started still stops
    every rank at the same step, and the resume is as exact."""
    monkeypatch.setenv("SPOTRUN_AGREEMENT", agreement)  # the supervisors' workers inherit it
    ck, log_file = str(tmp_path / "ck"), tmp_path / "train.jsonl"
    nodes = start_nodes(ck, log_file, tmp_path / "first", processes, "--step-sleep-s", "0.05")
    wait_for_step(log_file, 8, nodes[0])
    assert nodes[1].poll() is None
    sigterm(nodes[0])  # node 0 only
    assert [proc.wait(timeout=300) for proc in nodes] == [PREEMPTED] * NODES

    logs = node_logs(tmp_path / "first")
    assert "preemption notice: SIGTERM" in logs[0]
    assert "preemption notice:" not in logs[1]
    assert "without a notice here" in logs[1]
    said = any("per-step agreement is pipelined" in text for text in logs)  # rank 0 may be on either node
    assert said == (agreement == "pipelined")
    committed = [[int(s) for s in _COMMITTED.findall(text)] for text in logs]
    assert committed[0] == committed[1] and len(committed[0]) == 1, committed  # the same step on both nodes
    step = committed[0][0]
    assert 8 <= step < STEPS
    assert read_log(log_file)[-1]["step"] == step
    listed = {row["step"]: row for row in ls_json(ck)}
    assert max(listed) == step
    assert listed[step]["status"] == "complete" and listed[step]["world_size"] == NODES
    assert listed[step]["reason"] in ("emergency", "periodic")  # periodic if the notice came at step 10 or 20

    rows_before = len(read_log(log_file))
    nodes = start_nodes(ck, log_file, tmp_path / "restart", processes, "--step-sleep-s", "0.05")
    assert [proc.wait(timeout=600) for proc in nodes] == [0] * NODES
    for text in node_logs(tmp_path / "restart"):
        assert f"resuming from step {step} " in text
    assert read_log(log_file)[rows_before]["step"] == step + 1

    ref_losses, ref_tensors, ref_numerics = reference
    for checkpoint in (step, STEPS):  # both launches computed with the reference's settings
        assert [
            load_committed(open_storage(ck), checkpoint, rank, NODES).rank_local["numerics"] for rank in range(NODES)
        ] == ref_numerics
    assert last_loss_per_step(log_file) == ref_losses
    got = final_tensors(ck, STEPS)
    assert sorted(got) == sorted(ref_tensors)
    for name, tensor in ref_tensors.items():
        assert torch.equal(got[name], tensor), f"{name} differs"
