"""The fast tier under `spotrun run` (issue 23, Acceptance): the example trainer on 2 ranks,
storage every 20 steps, the fast tier every 2 steps; a worker or torchrun SIGKILLed after step
27 (no notice, so no emergency save): the restart resumes from step 26 read from memory, not
storage's 20, and ends bit-identical to an uninterrupted run of the same command. A damaged
fast-tier step is found by its digests and skipped; a finished job leaves nothing in memory;
DataLoader workers forked by the ranks keep working across fast-tier saves and the restore.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from filelock import FileLock

from spotrun.checkpoint import catalog
from spotrun.eventlog.records import read_events
from spotrun.storage import LocalStorage
from spotrun.supervisor.process import ProcInfo, descendants, is_alive
from tests.support.ckpt_files import shard_path
from tests.support.paths import glob_live
from tests.support.trainrun import (
    final_tensors,
    kill_tree,
    last_loss_per_step,
    read_log,
    start_supervised,
    tails,
    torchrun_command,
)

pytestmark = pytest.mark.slow  # torchrun jobs, a restart each

STEPS = 40
SAVE_INTERVAL = 20  # storage: steps 20 and 40
MEMORY_INTERVAL = 2  # the fast tier: every even step, the newest two kept
KILL_AFTER = 27  # the fast tier then holds 24 and 26 (26 and 28 if the kill came late), storage 20
#: Seconds each step sleeps in the crashed runs: the kill should land after step 27 is logged and
#: before step 28's fast-tier save commits, a window of two sleeps (a later kill on a loaded
#: machine is read and followed: crash_and_resume). It changes no number the runs compute.
STEP_SLEEP_S = 0.4
WAIT_S = 300  # bound of every wait: a loaded machine is slow, a hung job must still fail
#: The example trainer's DataLoader workers (forked by each rank, the default start method), with
#: a text short enough (21 samples: an epoch every few steps) that they are forked again and
#: again while fast-tier saves are in flight.
FORKED_LOADER = ("--num-workers", "2", "--max-bytes", "700")


def supervisor_options(memory_dir: pathlib.Path) -> list[str]:
    return [
        "--notice",
        "none",
        "--memory-dir",
        str(memory_dir),
        "--memory-interval-steps",
        str(MEMORY_INTERVAL),
        "--max-restarts",
        "2",
        "--restart-backoff-s",
        "0",
    ]


@dataclass
class Uninterrupted:
    """The uninterrupted run of a command: its directory, per-step losses, the final step's tensors."""

    root: pathlib.Path
    losses: dict[int, float]
    tensors: dict[str, torch.Tensor]


def uninterrupted(shared: pathlib.Path, *extra: str) -> Uninterrupted:
    """The uninterrupted supervised run of the command with ``extra`` trainer arguments (without
    the crashed runs' step sleep), run once per test session: the first xdist worker to need it
    runs it under a file lock, the others read it."""
    root = shared / ("fast-tier-reference" + "".join(extra).replace("-", "_"))
    with FileLock(str(root) + ".lock"):
        if not (root / "done").exists():
            root.mkdir(exist_ok=True)
            proc = start_supervised(
                str(root / "ck"),
                torchrun_command(STEPS, SAVE_INTERVAL, root / "train.jsonl", *extra),
                extra_options=supervisor_options(root / "mem"),
                log_path=root / "supervisor.log",
            )
            try:
                assert proc.wait(timeout=600) == 0, tails((root / "supervisor.log",))
            finally:
                kill_tree(proc)
            (root / "done").write_text("")
    losses = last_loss_per_step(root / "train.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return Uninterrupted(root, losses, final_tensors(str(root / "ck"), STEPS))


@pytest.fixture
def reference_of(tmp_path_factory):
    """``reference_of(*extra)``: :func:`uninterrupted` for the trainer arguments ``extra``."""
    shared = tmp_path_factory.getbasetemp().parent  # the same for every xdist worker of a run
    return lambda *extra: uninterrupted(shared, *extra)


@dataclass
class Crash:
    """What a crashed-and-restarted run left: its directories, the kill and the logs."""

    tmp_path: pathlib.Path
    logged_at_kill: int  # the last step in the training log when the victim was killed
    memory_at_kill: list[int]  # the complete fast-tier steps then
    killed: list[ProcInfo]  # torchrun and its ranks at the kill
    rank_children: list[int]  # how many processes each rank had started then (DataLoader workers)
    alive_at_restart: list[ProcInfo]  # those of them still running when the supervisor restarted

    @property
    def newest_in_memory(self) -> int:
        return self.memory_at_kill[-1]

    @property
    def ck(self) -> str:
        return str(self.tmp_path / "ck")

    @property
    def memory_dir(self) -> pathlib.Path:
        return self.tmp_path / "mem"

    @property
    def supervisor_log(self) -> str:
        return (self.tmp_path / "supervisor.log").read_text(errors="replace")

    @property
    def resumed_steps(self) -> list[int]:
        """The steps the restart trained: the training log from where its step numbers go back, or,
        when they never do (a restart from the last step logged repeats none), after the step that
        incarnation 1's start record names."""
        steps = [row["step"] for row in read_log(self.tmp_path / "train.jsonl")]
        back = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
        if back:
            return steps[back[-1] :]
        assert steps == sorted(set(steps)), steps
        return [step for step in steps if step > self.start_record(1)["resumed_step"]]

    def start_record(self, incarnation: int) -> dict:
        """The ``start`` record of ``incarnation`` in rank 0's event log."""
        [obj] = [o for o in read_events(LocalStorage(self.ck)) if o.incarnation == incarnation and o.rank == 0]
        return next(r for r in obj.records if r["event"] == "start")


def wait_until(condition, proc: subprocess.Popen, what: str, outputs: tuple[pathlib.Path, ...]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"spotrun run exited with {proc.returncode} before {what}" + tails(outputs))
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {WAIT_S} s" + tails(outputs))
        time.sleep(0.05)


def job_processes(supervisor_pid: int) -> tuple[ProcInfo, list[ProcInfo]]:
    """This run's torchrun (the supervisor's child) and its ranks (torchrun's children), rank order."""
    tree = descendants(supervisor_pid)
    torchruns = [p for p in tree if p.ppid == supervisor_pid and b"torch.distributed.run" in cmdline(p.pid)]
    if len(torchruns) != 1:
        return ProcInfo(-1, -1, 0, "?"), []
    [torchrun] = torchruns
    ranks = {rank_of(p.pid): p for p in tree if p.ppid == torchrun.pid}
    return torchrun, [ranks[r] for r in sorted(ranks) if r is not None]


def cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def rank_of(pid: int) -> int | None:
    try:
        environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


def complete_in_memory(memory_dir: pathlib.Path) -> list[int]:
    """The complete steps in the (one) fast tier under ``memory_dir``."""
    tiers = sorted(glob_live(memory_dir, "tier-*/steps"))
    if len(tiers) != 1:
        return []
    return sorted(s.step for s in catalog.list_steps(LocalStorage(str(tiers[0]))) if s.status == catalog.COMPLETE)


def tier_steps_root(memory_dir: pathlib.Path) -> pathlib.Path:
    [root] = glob_live(memory_dir, "tier-*/steps")
    return root


def crash_and_resume(
    tmp_path: pathlib.Path,
    processes: list,
    victim: str,
    *extra: str,
    before_kill=lambda memory_dir, steps: None,
) -> Crash:
    """Run the command under `spotrun run` until step KILL_AFTER is logged and the fast tier holds
    step KILL_AFTER - 1, SIGKILL ``victim`` (``"rank 1"`` or ``"torchrun"``) and let the
    supervisor restart the training to the end (exit 0).

    The ranks are stopped (SIGSTOP) while the test reads the training log and the tier's complete
    steps and runs ``before_kill(memory_dir, those steps)``, so that what it saw is what the
    restart finds (on a loaded machine the ranks may have gone a step further by then).
    """
    log_file = tmp_path / "train.jsonl"
    memory_dir = tmp_path / "mem"
    outputs = (tmp_path / "supervisor.log",)
    proc = start_supervised(
        str(tmp_path / "ck"),
        torchrun_command(STEPS, SAVE_INTERVAL, log_file, "--step-sleep-s", str(STEP_SLEEP_S), *extra),
        extra_options=supervisor_options(memory_dir),
        log_path=outputs[0],
    )
    processes.append(proc)

    def at_kill_point() -> bool:
        rows = read_log(log_file)
        in_memory = complete_in_memory(memory_dir)
        return bool(rows and in_memory) and rows[-1]["step"] >= KILL_AFTER and in_memory[-1] >= KILL_AFTER - 1

    wait_until(at_kill_point, proc, f"step {KILL_AFTER} logged and step {KILL_AFTER - 1} in the fast tier", outputs)
    torchrun, ranks = job_processes(proc.pid)
    assert len(ranks) == 2, f"torchrun {torchrun} and its ranks {ranks}" + tails(outputs)
    for rank in ranks:
        os.kill(rank.pid, signal.SIGSTOP)
    try:
        logged_at_kill = read_log(log_file)[-1]["step"]
        memory_at_kill = complete_in_memory(memory_dir)
        rank_children = [sum(p.ppid == rank.pid for p in descendants(rank.pid)) for rank in ranks]
        before_kill(memory_dir, memory_at_kill)
        target = torchrun if victim == "torchrun" else ranks[int(victim.removeprefix("rank "))]
        os.kill(target.pid, signal.SIGKILL)
    finally:
        for rank in ranks:
            if is_alive(rank):
                os.kill(rank.pid, signal.SIGCONT)
    wait_until(lambda: "restart 1 of" in outputs[0].read_text(errors="replace"), proc, "restarted", outputs)
    killed = [torchrun, *ranks]
    alive_at_restart = [p for p in killed if is_alive(p)]
    assert proc.wait(timeout=WAIT_S) == 0, tails(outputs)
    assert list(memory_dir.iterdir()) == []  # the supervisor removed its tier at the end
    return Crash(tmp_path, logged_at_kill, memory_at_kill, killed, rank_children, alive_at_restart)


def assert_killed_as_planned(crash: Crash) -> None:
    """The kill came after step KILL_AFTER, the fast tier then held its newest two steps, the
    newest of them KILL_AFTER - 1 or later and at most 3 steps behind the training (steps lost)."""
    newest = crash.newest_in_memory
    assert crash.logged_at_kill >= KILL_AFTER and newest >= KILL_AFTER - 1, crash
    assert crash.memory_at_kill == [newest - MEMORY_INTERVAL, newest]
    assert crash.logged_at_kill - newest <= 3, crash


def assert_exact(crash: Crash, reference: Uninterrupted) -> None:
    """Per-step losses (each step's last run) and every final tensor equal the uninterrupted run's."""
    assert last_loss_per_step(crash.tmp_path / "train.jsonl") == reference.losses
    got = final_tensors(crash.ck, STEPS)
    assert sorted(got) == sorted(reference.tensors)
    for name, tensor in reference.tensors.items():
        assert torch.equal(got[name], tensor), f"{name} differs from the uninterrupted run"


def assert_resumed_from_memory(crash: Crash, step: int) -> None:
    """The restart resumed ``step`` read from the fast tier: the supervisor chose it, rank 0
    restored it from memory, the event log's start record of incarnation 1 says so, and the
    training went on from the next step."""
    assert f"resuming from step {step} in the fast tier" in crash.supervisor_log, crash.supervisor_log[-4000:]
    assert f"restored step {step} from " in crash.supervisor_log
    assert "(the fast tier, in memory) (incarnation 1)" in crash.supervisor_log
    start = crash.start_record(1)
    assert (start["resumed_step"], start["restore_tier"]) == (step, "memory"), start
    assert crash.resumed_steps == list(range(step + 1, STEPS + 1))


def test_a_killed_worker_resumes_from_the_fast_tier_exactly(tmp_path, processes, reference_of):
    """Issue 23, Acceptance 1: a rank SIGKILLed after step 27; the restart resumes from the newest
    fast-tier step (26) read from memory, not storage's 20, loses at most 3 steps (the report
    agrees) and ends bit-identical."""
    reference = reference_of()
    crash = crash_and_resume(tmp_path, processes, "rank 1")
    assert_killed_as_planned(crash)
    assert_resumed_from_memory(crash, crash.newest_in_memory)
    assert "restart 1 of 2" in crash.supervisor_log
    report = subprocess.run(
        [sys.executable, "-m", "spotrun", "report", crash.ck, "--json"], capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["incarnations"]
    assert [(r["resumed_step"], r["ended"]) for r in rows] == [(0, "restarted"), (crash.newest_in_memory, "finished")]
    assert rows[0]["steps_lost"] <= 3
    assert_exact(crash, reference)


def test_a_killed_torchrun_resumes_from_the_fast_tier_exactly(tmp_path, processes, reference_of):
    """Issue 23, Acceptance 2: torchrun SIGKILLed after step 27: its ranks go with it (none is
    left when the restart starts), and the restart resumes from step 26 in memory, exact."""
    reference = reference_of()
    crash = crash_and_resume(tmp_path, processes, "torchrun")
    assert_killed_as_planned(crash)
    assert crash.alive_at_restart == []
    assert_resumed_from_memory(crash, crash.newest_in_memory)
    assert_exact(crash, reference)


def flip_last_byte(path: pathlib.Path) -> None:
    """Flip every bit of the file's last byte (tensor data: a safetensors file ends with it)."""
    with open(path, "r+b") as file:
        file.seek(-1, os.SEEK_END)
        byte = file.read(1)[0]
        file.seek(-1, os.SEEK_END)
        file.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("damaged", ["newest", "both"])
def test_a_damaged_fast_tier_step_falls_through_by_digest_and_stays_exact(tmp_path, processes, reference_of, damaged):
    """Issue 23, Acceptance 3: a byte flipped in the fast-tier copy of the newest step (26) right
    before the kill: the restore finds it by its digest, says so and falls through to the next
    older step in either tier: the tier's older step (24, newer than storage's 20) loads; with
    both fast-tier steps damaged, storage's 20. The run ends bit-identical."""
    reference = reference_of()

    def damage(memory_dir: pathlib.Path, steps: list[int]) -> None:
        for step in steps if damaged == "both" else steps[-1:]:
            flip_last_byte(shard_path(tier_steps_root(memory_dir), step, rank=0))

    crash = crash_and_resume(tmp_path, processes, "rank 1", before_kill=damage)
    assert_killed_as_planned(crash)
    newest, older = crash.newest_in_memory, crash.newest_in_memory - MEMORY_INTERVAL
    # the supervisor lists steps, it does not read their data: it names the newest in memory
    assert f"resuming from step {newest} in the fast tier" in crash.supervisor_log
    said = [line for line in crash.supervisor_log.splitlines() if "failed verification" in line]
    expected = [(newest, f"step {older} in the fast tier")]
    if damaged == "both":
        expected.append((older, f"step {SAVE_INTERVAL} on storage"))
    assert len(said) == len(expected), said
    for line, (step, fallback) in zip(said, expected):
        assert f"checkpoint step {step} in the fast tier failed verification" in line, line
        assert f"falling back to {fallback}" in line, line
    resumed, tier = (SAVE_INTERVAL, "storage") if damaged == "both" else (older, "memory")
    start = crash.start_record(1)
    assert (start["resumed_step"], start["restore_tier"]) == (resumed, tier), start
    assert crash.resumed_steps == list(range(resumed + 1, STEPS + 1))
    assert_exact(crash, reference)


def test_a_finished_job_leaves_nothing_in_its_memory_dir(reference_of):
    """Issue 23, Acceptance: no files left under the tier directory after a finished job (the
    uninterrupted run, which held fast-tier steps while it ran; the crashed runs check it too)."""
    reference = reference_of()
    said = (reference.root / "supervisor.log").read_text(errors="replace")
    assert "(memory, in the background)" in said  # fast-tier steps were committed
    assert list((reference.root / "mem").iterdir()) == []


def test_forked_dataloader_workers_survive_fast_tier_saves_and_restore(tmp_path, processes, reference_of):
    """Issue 23, Acceptance: no fork problem: each rank forks DataLoader workers (the default
    start method) at every epoch, every few steps, while fast-tier saves run on their thread;
    after a rank is killed the restart restores step 26 from memory and forks them again, and
    the run ends exact."""
    reference = reference_of(*FORKED_LOADER)
    crash = crash_and_resume(tmp_path, processes, "rank 1", *FORKED_LOADER)
    assert_killed_as_planned(crash)
    assert crash.rank_children == [2, 2]  # the loader workers ran (forked) when the rank was killed
    assert_resumed_from_memory(crash, crash.newest_in_memory)
    assert_exact(crash, reference)
