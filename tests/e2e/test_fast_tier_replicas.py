"""The fast tier across nodes (issue 24, Acceptance; the several-node part of issue 23): two
simulated nodes on loopback, each its own `spotrun run` with its own fast-tier directory and a
`torchrun --nnodes 2` with a c10d rendezvous; storage every 20 steps, the fast tier every 2, each
node's step replicated to the other by the supervisors.

Node 1's whole process tree is SIGKILLed after step 27 and its memory wiped (a new machine); a
replacement node 1 joins, and the job resumes from the newest step replicated on node 0 (26, or
28 when the kill came late), node 1's parts read from node 0's memory, ending bit-identical to an
uninterrupted run. With both copies gone, the restart falls through to storage's step 20 and
says why; a replica with a flipped byte is caught by its digests and never trained on.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid

import pytest
import torch
from filelock import FileLock

from spotrun.errors import StorageError
from spotrun.storage import tier_protocol as wire
from spotrun.storage.tier_peers import Peer, PeerClient
from tests.e2e.test_fast_tier_crash import job_processes
from tests.support.paths import glob_live
from tests.support.trainrun import (
    TRAIN_ARGS,
    final_tensors,
    kill_tree,
    last_loss_per_step,
    read_log,
    rendezvous_port,
    start_supervised,
    tails,
)

pytestmark = pytest.mark.slow  # two nodes' torchrun jobs, a node lost and replaced

NODES = 2
STEPS = 32
SAVE_INTERVAL = 20  # storage: steps 20 (and 32, the end)
MEMORY_INTERVAL = 2
KILL_AFTER = 27
#: Seconds each step sleeps in the crashed runs, so that node 1 is lost a step or two after a
#: replicated fast-tier step; it changes no number the runs compute.
STEP_SLEEP_S = 0.3
WAIT_S = 300
_PEER_READ = re.compile(r"rank (\d+) read (\d+) bytes of step (\d+) from the fast tier of node\(s\) (\S+)")


def node_command(port: int, rdzv_id: str, log_file: pathlib.Path, *extra: str) -> list[str]:
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


class Job:
    """Two nodes of one job under `spotrun run`, in ``root``."""

    def __init__(self, root: pathlib.Path, processes: list, *extra: str) -> None:
        self.root, self.processes, self.extra = root, processes, extra
        self.port, self.rdzv_id = rendezvous_port(), uuid.uuid4().hex[:12]
        self.log_file = root / "train.jsonl"
        self.nodes: list[subprocess.Popen | None] = [None] * NODES
        self.logs: list[pathlib.Path] = [root / f"node{n}.log" for n in range(NODES)]
        self.listed_before_loss: list[dict] = []
        self.uri: str | None = None  # the checkpoint root; None: a directory in ``root``
        self.supervisor_options: list[str] = []  # more options of every `spotrun run`
        self.drop_env: tuple[str, ...] = ()

    @property
    def ck(self) -> str:
        return self.uri or str(self.root / "ck")

    def memory_dir(self, node: int) -> pathlib.Path:
        return self.root / f"mem{node}"

    def start(self, node: int, log_name: str | None = None, *, grace_period_s: float = 60) -> None:
        if log_name is not None:
            self.logs[node] = self.root / log_name
        proc = start_supervised(
            self.ck,
            node_command(self.port, self.rdzv_id, self.log_file, *self.extra),
            grace_period_s=grace_period_s,
            drop_env=self.drop_env,
            extra_options=[
                "--notice",
                "none",
                "--memory-dir",
                str(self.memory_dir(node)),
                "--memory-interval-steps",
                str(MEMORY_INTERVAL),
                "--max-restarts",
                "3",
                "--restart-backoff-s",
                "0",
                *self.supervisor_options,
            ],
            log_path=self.logs[node],
        )
        self.processes.append(proc)
        self.nodes[node] = proc

    def wait(self) -> list[int]:
        return [proc.wait(timeout=600) for proc in self.nodes]

    def log_text(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def outputs(self) -> str:
        return tails(tuple(self.logs))


def replicated_on(memory_dir: pathlib.Path) -> list[int]:
    """The steps of which the (one) tier under ``memory_dir`` holds another node's whole replica."""
    return sorted(
        int(path.parent.name.removeprefix("step-"))
        for path in glob_live(memory_dir, "tier-*/replicas/*/step-*/manifest.*.json")
    )


def settled_replicas(
    memory_dir: pathlib.Path, source: str = "*", quiet_s: float = 2.0, bound_s: float = 60.0
) -> list[int]:
    """The steps of which ``memory_dir``'s tier holds a whole replica of ``source`` (a node's name),
    once a lost node's last copy has landed: what it sent before it died is still written by this
    node's server for a moment (on a busy machine, seconds), so wait until no replica file of it is
    half-written and the steps held stay the same for ``quiet_s``."""
    give_up = time.monotonic() + bound_s
    seen, since = None, time.monotonic()
    while time.monotonic() < give_up:
        writing = any(".tmp-" in path.name for path in glob_live(memory_dir, f"tier-*/replicas/{source}/**/*"))
        now = sorted(
            int(path.parent.name.removeprefix("step-"))
            for path in glob_live(memory_dir, f"tier-*/replicas/{source}/step-*/manifest.*.json")
        )
        if writing or now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.1)
    raise AssertionError(f"the replicas under {memory_dir} kept changing for {bound_s} s")


def tier_of(memory_dir: pathlib.Path) -> pathlib.Path:
    [tier] = memory_dir.glob("tier-*")
    return tier


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory)


def reference_run(tmp_path_factory):
    """One uninterrupted run of the same two nodes with the same fast tier, run once per test
    session: the first xdist worker to need it runs it under a file lock, the others read it."""
    root = tmp_path_factory.getbasetemp().parent / "replicas-reference"  # the same for every xdist worker
    job = Job(root, [])
    with FileLock(str(root) + ".lock"):
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            try:
                job.start(0)
                job.start(1)
                assert job.wait() == [0] * NODES, job.outputs()
            finally:
                for proc in job.nodes:
                    kill_tree(proc)
            (root / "done").write_text("")
    losses = last_loss_per_step(job.log_file)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, final_tensors(job.ck, STEPS)


def lose_node_1(
    tmp_path: pathlib.Path,
    processes: list,
    *,
    wipe_replicas_on_node_0: bool = False,
    while_running=lambda job: None,
    before_replacement=lambda job, held: None,
) -> tuple[Job, int, str]:
    """Run the job until step KILL_AFTER is logged and node 0 holds node 1's replica of step
    KILL_AFTER - 1 or later; SIGKILL node 1's whole process tree, wipe its memory (and, when
    asked, node 0's replicas too: both copies lost) and start a replacement node 1;
    ``while_running(job)`` runs once both nodes train, ``before_replacement(job, held)`` before the
    replacement starts. Returns the
    job (run to its end), the newest step node 0 held a whole replica of at the loss, and node
    0's name (its tier directory's)."""
    job = Job(tmp_path, processes, "--step-sleep-s", str(STEP_SLEEP_S))
    job.start(0)
    job.start(1)
    deadline = time.monotonic() + WAIT_S
    while not (job.log_file.exists() and read_log(job.log_file)):
        assert all(proc.poll() is None for proc in job.nodes), "a node exited early" + job.outputs()
        assert time.monotonic() < deadline, "the job never trained" + job.outputs()
        time.sleep(0.05)
    while_running(job)
    while True:
        rows = read_log(job.log_file)
        held = replicated_on(job.memory_dir(0))
        if rows and held and rows[-1]["step"] >= KILL_AFTER and held[-1] >= KILL_AFTER - 1:
            break
        assert all(proc.poll() is None for proc in job.nodes), "a node exited early" + job.outputs()
        assert time.monotonic() < deadline, f"node 1's step {KILL_AFTER - 1} never replicated" + job.outputs()
        time.sleep(0.05)
    job.listed_before_loss = ls_json(job.ck, job.memory_dir(0))
    kill_tree(job.nodes[1])  # supervisor, torchrun and rank: the node is gone
    held_at_loss = settled_replicas(job.memory_dir(0))[-1]  # nothing of node 1's arrives any more
    node_0 = tier_of(job.memory_dir(0)).name
    shutil.rmtree(job.memory_dir(1))  # a new machine: nothing in its memory
    if wipe_replicas_on_node_0:
        shutil.rmtree(tier_of(job.memory_dir(0)) / "replicas")
    before_replacement(job, held_at_loss)
    job.start(1, "node1-replacement.log")
    assert job.wait() == [0] * NODES, job.outputs()
    return job, held_at_loss, node_0


def assert_same_as_reference(reference, job: Job) -> None:
    ref_losses, ref_tensors = reference
    assert last_loss_per_step(job.log_file) == ref_losses
    got = final_tensors(job.ck, STEPS)
    assert sorted(got) == sorted(ref_tensors)
    for name, tensor in ref_tensors.items():
        assert torch.equal(got[name], tensor), f"{name} differs"


def restored_step(job: Job) -> int:
    """The step the restart with the replacement node resumed from, as rank 0 logged its restore
    (the training log cannot tell: a restart from the last step logged repeats no step)."""
    text = "\n".join(job.log_text(n) for n in range(NODES))
    steps = {int(step) for step in re.findall(r"restored step (\d+) from ", text)}
    assert len(steps) == 1, f"restores of steps {sorted(steps)}" + job.outputs()
    return steps.pop()


def ls_json(ck: str, memory_dir: pathlib.Path) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "ls", ck, "--json", "--memory-dir", str(memory_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def report_tiers(ck: str) -> list:
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "report", ck, "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [inc.get("restore_tier") for inc in json.loads(done.stdout)["incarnations"]]


def test_a_lost_node_is_replaced_and_resumes_from_its_replica_on_the_other_node(reference, tmp_path, processes):
    job, held_at_loss, node_0 = lose_node_1(tmp_path, processes)
    step = restored_step(job)
    assert step == held_at_loss >= KILL_AFTER - 1, job.outputs()
    # every byte came from the nodes' memory: node 1's parts survive only as node 0's replicas. The
    # replacement's rank either read them from node 0 over the tier's peer link (and the log says so)
    # or, the restore being cooperative, rank 0 read them from its own node and sent them over
    text = "\n".join(job.log_text(n) for n in range(NODES))
    assert re.search(rf"restored step {step} from \S+ \(the fast tier, ", text), job.outputs()
    for _rank, size, read_step, source in _PEER_READ.findall(text):
        assert (int(read_step), source) == (step, node_0) and int(size) > 0
    peer_read = "parts from other nodes' memory" in text
    assert report_tiers(job.ck)[-1] == ("peer" if peer_read else "memory")
    # `spotrun ls` on node 0 before the loss: the fast tier's steps, complete, held by both nodes
    in_memory = [row for row in job.listed_before_loss if row["tier"] == "memory"]
    assert in_memory and all(row["status"] == "complete" for row in in_memory), job.listed_before_loss
    assert any(len(row["holders"]) == NODES and row["holders"][0] == node_0 for row in in_memory), in_memory
    assert_same_as_reference(reference, job)
    for node in range(NODES):  # both supervisors removed their tiers at the end
        assert list(job.memory_dir(node).iterdir()) == []


def test_with_both_copies_of_a_part_lost_the_restart_falls_through_to_storage_and_says_why(
    reference, tmp_path, processes
):
    job, _held, _node_0 = lose_node_1(tmp_path, processes, wipe_replicas_on_node_0=True)
    assert restored_step(job) == SAVE_INTERVAL, job.outputs()
    text = "\n".join(job.log_text(n) for n in range(NODES))
    assert re.search(r"fast tier step \d+ ignored: .*missing", text), job.outputs()
    assert_same_as_reference(reference, job)


def poke_with_a_stranger_and_a_malformed_frame(job: Job) -> None:
    """Connect to node 0's tier server without the job's secret, then with a frame no peer sends."""
    [port] = re.findall(r"fast tier served to the job's other nodes on 127\.0\.0\.1:(\d+)", job.log_text(0))
    stranger = PeerClient(Peer("stranger", "127.0.0.1", int(port), b"not the job's secret" * 2), "stranger", 10)
    with pytest.raises(StorageError, match="secret"):
        stranger.list("")
    secret = bytes.fromhex((tier_of(job.memory_dir(0)) / "secret").read_text())  # a peer gone astray
    with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as raw:
        wire.client_handshake(raw, secret, "astray")
        raw.sendall(struct.pack(">I", 10**9))
        with contextlib.suppress(ConnectionResetError):
            assert raw.recv(1) == b""


def flip_a_byte_in_node_1s_replica(job: Job, step: int) -> None:
    replica_dir = next(tier_of(job.memory_dir(0)).glob(f"replicas/*/step-{step:09d}"))
    [shard] = [p for p in replica_dir.glob("rank-*.safetensors") if ".index." not in p.name]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # tensor bytes, near the end
    shard.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_replica_is_caught_by_its_digests_and_strangers_are_refused(reference, tmp_path, processes):
    job, held_at_loss, _node_0 = lose_node_1(
        tmp_path,
        processes,
        while_running=poke_with_a_stranger_and_a_malformed_frame,
        before_replacement=flip_a_byte_in_node_1s_replica,
    )
    text = "\n".join(job.log_text(n) for n in range(NODES))
    assert re.search(r"connection from 127\.0\.0\.1:\d+ refused: the job's secret was not proven", text), job.outputs()
    assert re.search(r"connection from 127\.0\.0\.1:\d+ dropped: a header of 1000000000 bytes", text), job.outputs()
    assert re.search(rf"checkpoint step {held_at_loss} in the fast tier failed verification", text), job.outputs()
    assert restored_step(job) < held_at_loss  # never trained on
    assert_same_as_reference(reference, job)


# --- a node lost and not replaced (3 to 2, 2 to 1): FSDP2 resharded from the replicas ----------

#: FSDP2, dropout off (per-rank dropout streams cannot map across world sizes), a global batch
#: that divides by 3 and 2 ranks, one intra-op thread per rank.
FSDP_ARGS = [
    "--fsdp",
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
    "12",
    "--warmup-steps",
    "2",
    "--dropout",
    "0",
    "--log-interval",
    "1000",
    "--intra-op-threads",
    "1",
]
FSDP_STEPS = 16
#: Relative tolerance of the losses after the change of layout (the reduction order differs);
#: the global batches and learning rates are exact (tests/e2e/test_sharded_resume.py).
LOSS_RTOL = 1e-5


def trainer(ck: str, log_file: pathlib.Path, *extra: str) -> list[str]:
    """The example trainer's module and arguments, FSDP2."""
    return [
        "-m",
        "spotrun.examples.train_gpt",
        "--checkpoint-uri",
        ck,
        "--steps",
        str(FSDP_STEPS),
        "--save-interval",
        "100",  # storage: only the end; every restore before it is from the fast tier
        "--log-file",
        str(log_file),
        *FSDP_ARGS,
        *extra,
    ]


def elastic_torchrun(port: int, rdzv_id: str, nodes: int) -> list[str]:
    """One node's torchrun of ``nodes - 1`` to ``nodes`` nodes x 1 process; once the fewest joined,
    the last one is waited 3 s."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        f"{nodes - 1}:{nodes}",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        "last_call_timeout=3",
    ]


@pytest.mark.parametrize(
    "node_count",
    [
        pytest.param(3, id="3-nodes-to-2-reading-parts-from-the-other-node"),
        pytest.param(2, id="2-nodes-to-1-reading-its-own-replicas"),
    ],
)
def test_a_job_that_loses_a_node_reshards_fsdp2_onto_the_nodes_left_from_the_replicas(node_count, tmp_path, processes):
    # the uninterrupted reference: FSDP2 on 2 ranks of one node (the global batches do not depend on the layout)
    ref_log = tmp_path / "reference.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *trainer(str(tmp_path / "ref-ck"), ref_log),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    reference = read_log(ref_log)

    port, rdzv_id, log_file, ck = (
        rendezvous_port(),
        uuid.uuid4().hex[:12],
        tmp_path / "train.jsonl",
        str(tmp_path / "ck"),
    )
    logs = [tmp_path / f"node{n}.log" for n in range(node_count)]
    nodes = []
    for node in range(node_count):
        proc = start_supervised(
            ck,
            [*elastic_torchrun(port, rdzv_id, node_count), *trainer(ck, log_file, "--step-sleep-s", str(STEP_SLEEP_S))],
            extra_options=[
                "--notice",
                "none",
                "--memory-dir",
                str(tmp_path / f"mem{node}"),
                "--memory-interval-steps",
                str(MEMORY_INTERVAL),
                "--max-restarts",
                "3",
                "--restart-backoff-s",
                "0",
            ],
            log_path=logs[node],
        )
        processes.append(proc)
        nodes.append(proc)
    outputs = lambda: tails(tuple(logs))  # noqa: E731
    lost = node_count - 1
    deadline = time.monotonic() + WAIT_S
    while True:  # every node's step 6 or later held by its successor, and step 7 logged
        rows = read_log(log_file) if log_file.exists() else []
        held = [replicated_on(tmp_path / f"mem{n}") for n in range(node_count)]
        if rows and rows[-1]["step"] >= 7 and all(h and h[-1] >= 6 for h in held):
            break
        assert all(p.poll() is None for p in nodes), "a node exited early" + outputs()
        assert time.monotonic() < deadline, "the replicas of step 6 never landed" + outputs()
        time.sleep(0.05)
    lost_name = tier_of(tmp_path / f"mem{lost}").name
    kill_tree(nodes[lost])  # the node is gone and not replaced
    held_at_loss = max(  # once the copies it sent before it died have landed
        step for n in range(node_count) if n != lost for step in settled_replicas(tmp_path / f"mem{n}", lost_name)
    )
    shutil.rmtree(tmp_path / f"mem{lost}")
    assert [nodes[n].wait(timeout=600) for n in range(node_count) if n != lost] == [0] * (node_count - 1), outputs()

    text = "\n".join(p.read_text(errors="replace") for p in logs)
    steps = [row["step"] for row in read_log(log_file)]
    # the restart trained held_at_loss + 1 to the end (a restart from the last step logged repeats none)
    restart = len(steps) - (FSDP_STEPS - held_at_loss)
    assert steps[restart:] == list(range(held_at_loss + 1, FSDP_STEPS + 1)), outputs()
    saved, left = node_count, node_count - 1
    assert re.search(
        rf"restored step {held_at_loss} \(saved by {saved} ranks, mesh {saved}\) onto {left} ranks?, mesh {left}", text
    ), outputs()
    if left > 1:  # the other node left holds the rest of the step
        assert "(the fast tier, parts from other nodes' memory)" in text
        assert re.search(rf"read \d+ bytes of step {held_at_loss} from the fast tier of node\(s\) [^\n]*", text)
    else:  # the node left holds the lost node's replicas itself: nothing crosses the network
        assert "(the fast tier, in memory)" in text, outputs()
    # the same global batches and learning rates as the uninterrupted run, losses within rounding
    rows = read_log(log_file)
    resumed = rows[restart:]
    expected = [r for r in reference if r["step"] > held_at_loss]
    assert [(r["step"], r["samples"], r["lr"]) for r in resumed] == [
        (r["step"], r["samples"], r["lr"]) for r in expected
    ]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in expected], rel=LOSS_RTOL)
    before = rows[:restart]
    assert [(r["step"], r["samples"]) for r in before] == [(r["step"], r["samples"]) for r in reference[: len(before)]]


# --- a crash that leaves every node up (issue 23 on several nodes) ----------------------------


def test_a_rank_killed_on_one_node_resumes_every_node_from_the_fast_tier_and_the_supervisors_agree(
    reference, tmp_path, processes
):
    """SIGKILL node 1's rank after step KILL_AFTER: both nodes' torchruns end, both supervisors
    start them again, and every rank resumes from the newest fast-tier step (not storage's 20),
    each supervisor's start line naming that step in the fast tier; bit-identical at the end."""
    job = Job(tmp_path, processes, "--step-sleep-s", str(STEP_SLEEP_S))
    job.start(0)
    job.start(1)
    deadline = time.monotonic() + WAIT_S

    def newest_committed() -> int:
        return max(
            (
                int(path.parent.name.removeprefix("step-"))
                for node in range(NODES)
                for path in glob_live(job.memory_dir(node), "tier-*/steps/step-*/manifest.*.json")
            ),
            default=0,
        )

    # step KILL_AFTER logged and the fast tier's step before it committed (a background save: on a
    # busy machine it can commit a few steps late)
    while not (
        job.log_file.exists()
        and read_log(job.log_file)
        and read_log(job.log_file)[-1]["step"] >= KILL_AFTER
        and newest_committed() >= KILL_AFTER - 1
    ):
        assert all(proc.poll() is None for proc in job.nodes), "a node exited early" + job.outputs()
        assert time.monotonic() < deadline, f"step {KILL_AFTER} never logged" + job.outputs()
        time.sleep(0.05)
    _torchrun, ranks = job_processes(job.nodes[1].pid)
    assert len(ranks) == 1, job.outputs()
    os.kill(ranks[0].pid, signal.SIGKILL)
    time.sleep(1.0)  # nothing commits without the killed rank; a manifest copy in flight lands
    newest = newest_committed()
    assert newest >= KILL_AFTER - 1
    assert job.wait() == [0] * NODES, job.outputs()
    assert restored_step(job) == newest, job.outputs()
    for node in range(NODES):  # each supervisor decided as the workers did
        assert f"resuming from step {newest} in the fast tier" in job.log_text(node), job.outputs()
    assert_same_as_reference(reference, job)
