"""A notice too short for storage (issue 24, item 6), in one process: where the supervisor sends
the emergency checkpoint, and how a node that stays writes a fast-tier step to storage (whole,
verified, manifest last) or refuses to (damaged, never whole, fenced)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog, fencing
from spotrun.checkpoint.restore import load_committed
from spotrun.supervisor.observers import Observers
from spotrun.supervisor.tier_emergency import MEMORY, STORAGE, decide_emergency, drain_to_storage
from tests.support.ckpt_files import shard_path, storage_at

STEP = 26


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(256, 512)  # weight: 512 KiB of float32


@pytest.fixture
def tier(tmp_path):
    """A fast tier's root holding step STEP, saved as the workers save it."""
    root = tmp_path / "tier"
    ckpt = spotrun.Checkpointer({"model": Net()}, storage=storage_at(root), handle_signals=False)
    ckpt.save(STEP, "emergency")
    ckpt.close()
    return root


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, name: str, fields: dict) -> None:
        self.events.append((name, fields))


def test_a_whole_verified_step_is_written_to_storage_manifest_last_and_loads_the_same(tier, tmp_path, caplog):
    storage = storage_at(tmp_path / "ck")
    caplog.set_level(logging.INFO)
    assert drain_to_storage(storage_at(tier), storage, STEP, wait_s=5)
    info = catalog.inspect_step(storage, STEP)
    assert (info.status, info.reason) == (catalog.COMPLETE, "emergency")
    assert f"the fast tier's step {STEP} is complete on storage" in caplog.text
    got = load_committed(storage, STEP, 0, 1)
    want = load_committed(storage_at(tier), STEP, 0, 1)
    assert torch.equal(got.replicated["model"]["proj.weight"], want.replicated["model"]["proj.weight"])
    # a second node that stays finds it committed: nothing rewritten, still complete
    manifest_before = (tmp_path / "ck" / info.manifest_key).stat().st_mtime_ns
    assert drain_to_storage(storage_at(tier), storage, STEP, wait_s=5)
    assert (tmp_path / "ck" / info.manifest_key).stat().st_mtime_ns == manifest_before


def test_a_step_with_a_flipped_byte_is_never_written_to_storage(tier, tmp_path, caplog):
    shard = shard_path(tier, STEP)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    storage = storage_at(tmp_path / "ck")
    assert not drain_to_storage(storage_at(tier), storage, STEP, wait_s=5)
    assert f"the fast tier's step {STEP} failed verification, not written to storage" in caplog.text
    assert catalog.inspect_step(storage, STEP) is None


def test_a_step_whose_part_never_arrives_is_given_up_after_the_wait(tier, tmp_path, caplog):
    shard_path(tier, STEP).unlink()  # the node that held it is gone, and no copy came
    storage = storage_at(tmp_path / "ck")
    started = time.monotonic()
    assert not drain_to_storage(storage_at(tier), storage, STEP, wait_s=1)
    assert time.monotonic() - started < 30  # bounded: one wait, not a hang
    assert f"the fast tier's step {STEP} is not whole after 1 s" in caplog.text
    assert catalog.inspect_step(storage, STEP) is None


def test_a_step_of_an_incarnation_that_storage_fenced_is_not_committed(tier, tmp_path, caplog):
    storage = storage_at(tmp_path / "ck")
    incarnation = catalog.inspect_step(storage_at(tier), STEP).manifest.incarnation
    fencing.claim(storage, resumed_step=None, run_id="a newer start", at_least=incarnation + 1)
    assert not drain_to_storage(storage_at(tier), storage, STEP, wait_s=5)
    assert "writing the fast tier's step 26 to storage failed" in caplog.text
    assert not [s for s in catalog.list_steps(storage) if s.status == catalog.COMPLETE]


class FakeService:
    """What the decision reads of the supervisor's tier service."""

    def __init__(self, own_steps, rate_bytes_s: float, targets=("node-b",)) -> None:
        self.own_steps, self._rate, self._targets = own_steps, rate_bytes_s, list(targets)

    def target_nodes(self) -> list[str]:
        return self._targets

    def copy_rate_bytes_s(self) -> float:
        return self._rate


def slow_storage_manifest(tier_root, write_s: float):
    """The manifest of the step the job resumed from, as if its save to storage took ``write_s``."""
    manifest = copy.copy(catalog.inspect_step(storage_at(tier_root), STEP).manifest)
    manifest.timing = dataclasses.replace(manifest.timing, write_s=write_s)
    return manifest


@pytest.mark.parametrize(
    "rate_bytes_s, targets, expected",
    [
        (256 << 20, ["node-b"], MEMORY),  # the tier's save and the copy fit in the 10 s left
        (10_000, ["node-b"], None),  # the copy alone would take a minute: no save fits
        (256 << 20, [], None),  # one node: no other node to hold it
    ],
    ids=["copy-fits", "copy-too-slow", "no-other-node"],
)
def test_a_notice_too_short_for_storage_goes_to_the_fast_tier_only_when_its_copy_fits(
    tier, tmp_path, rate_bytes_s, targets, expected
):
    recorder = Recorder()
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    route = decide_emergency(
        str(control_dir),
        slow_storage_manifest(tier, write_s=30.0),
        1,
        time.time() + 10,
        Observers([recorder]),
        FakeService(storage_at(tier), rate_bytes_s, targets),
    )
    assert route == expected
    [(name, fields)] = recorder.events
    assert (name, fields["save"], fields["tier"]) == ("decision", expected is not None, expected)
    if expected == MEMORY:
        assert fields["message"].startswith("emergency checkpoint to the fast tier, copied to node(s) node-b")
    else:
        assert fields["message"].startswith("NOT saving")


def test_a_notice_with_time_for_storage_still_goes_to_storage(tier, tmp_path):
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    route = decide_emergency(
        str(control_dir),
        slow_storage_manifest(tier, write_s=1.0),
        1,
        time.time() + 60,
        Observers(),
        FakeService(storage_at(tier), 256 << 20),
    )
    assert route == STORAGE


@pytest.mark.parametrize(
    "safe, drained, expected",
    [(False, False, (142, None)), (True, False, (143, STEP)), (True, True, (143, STEP))],
    ids=["lost", "held-by-another-node", "written-to-storage"],
)
def test_the_exit_code_after_an_emergency_checkpoint_in_the_fast_tier(tier, tmp_path, safe, drained, expected):
    from spotrun.control import files as control
    from spotrun.supervisor.exit_codes import preempted_exit_code

    storage = storage_at(tmp_path / "ck")
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    control.write_commit_report(str(control_dir), STEP, "memory")
    settled: list[int] = []

    def settle(step: int) -> bool:
        settled.append(step)
        if drained:
            assert drain_to_storage(storage_at(tier), storage, step, wait_s=5)
        return safe

    got = preempted_exit_code(
        storage, 0, str(control_dir), choice=None, declined=False, acknowledgements=[], settle_memory_step=settle
    )
    assert (got, settled) == (expected, [STEP])
