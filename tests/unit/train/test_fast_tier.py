"""The fast tier of one process: which tier a restore reads, fall-through on a damaged or foreign
fast-tier step, its retention, its budget, and fencing of an older start (issue 23)."""

from __future__ import annotations

import glob
import logging
import os
import re
import threading

import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.storage import LocalStorage


def checkpointer(tmp_path, w: torch.Tensor, **options) -> spotrun.Checkpointer:
    options = {"memory_interval_steps": 2, "memory_dir": str(tmp_path / "mem"), **options}
    return spotrun.Checkpointer(
        {"params": {"w": w}}, uri=str(tmp_path / "store"), handle_signals=False, background_saves=False, **options
    )


def train(ckpt: spotrun.Checkpointer, w: torch.Tensor, first: int, last: int) -> None:
    """Steps ``first..last``: ``w`` holds the step number after each, so a restore shows which step it read."""
    for step in range(first, last + 1):
        w.fill_(step)
        ckpt.end_of_step(step)
        ckpt._tier.report_ended()  # wait for its background write: the test reads the tier next


def complete_steps(root) -> list[int]:
    return [s.step for s in catalog.list_steps(LocalStorage(str(root))) if s.status == catalog.COMPLETE]


def test_a_restart_resumes_from_the_fast_tier_when_it_is_newer_than_storage(tmp_path, caplog):
    w = torch.zeros(4)
    ckpt = checkpointer(tmp_path, w, interval_steps=5)
    train(ckpt, w, 1, 8)  # storage: 5; fast tier: 6 and 8
    assert complete_steps(tmp_path / "store") == [5]
    assert complete_steps(tmp_path / "mem") == [6, 8]

    w2 = torch.zeros(4)
    with caplog.at_level(logging.INFO, logger="spotrun"):
        assert checkpointer(tmp_path, w2, interval_steps=5).restore() == 8
    assert torch.equal(w2, torch.full((4,), 8.0))
    assert "(the fast tier, in memory)" in caplog.text


def test_storage_wins_when_it_holds_a_newer_step_than_the_fast_tier(tmp_path):
    w = torch.zeros(4)
    ckpt = checkpointer(tmp_path, w, interval_steps=5, memory_interval_steps=4)
    train(ckpt, w, 1, 5)  # fast tier: 4; storage: 5
    w2 = torch.zeros(4)
    restorer = checkpointer(tmp_path, w2)
    assert restorer.restore() == 5
    assert restorer._restored.tier == "storage"
    assert torch.equal(w2, torch.full((4,), 5.0))


def test_a_damaged_fast_tier_step_falls_through_to_the_next_source_and_is_uncommitted(tmp_path, caplog):
    w = torch.zeros(4)
    ckpt = checkpointer(tmp_path, w, interval_steps=4)
    train(ckpt, w, 1, 6)  # storage: 4; fast tier: 4 and 6
    for shard in glob.glob(str(tmp_path / "mem" / "step-000000006" / "*.safetensors")):
        with open(shard, "r+b") as file:  # flip the last byte: tensor data, not the header
            file.seek(-1, os.SEEK_END)
            byte = file.read(1)
            file.seek(-1, os.SEEK_END)
            file.write(bytes([byte[0] ^ 0xFF]))

    w2 = torch.zeros(4)
    with caplog.at_level(logging.INFO, logger="spotrun"):
        restorer = checkpointer(tmp_path, w2)
        assert restorer.restore() == 4
    assert restorer._restored.tier == "memory"  # step 4 in memory comes before step 4 on storage
    assert torch.equal(w2, torch.full((4,), 4.0))
    assert "checkpoint step 6 in the fast tier failed verification" in caplog.text
    assert "falling back to step 4 in the fast tier" in caplog.text
    assert 6 not in complete_steps(tmp_path / "mem")  # never tried again


def test_a_fast_tier_step_of_another_run_is_never_a_candidate(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPOTRUN_RUN_ID", "first-run")
    w = torch.zeros(4)
    train(checkpointer(tmp_path, w, interval_steps=4), w, 1, 6)
    monkeypatch.setenv("SPOTRUN_RUN_ID", "another-run")
    w2 = torch.zeros(4)
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        restorer = checkpointer(tmp_path, w2)
        assert restorer.restore() == 4
    assert restorer._restored.tier == "storage"
    assert "fast tier step 6 ignored: it belongs to another run (first-run)" in caplog.text


def test_the_fast_tier_keeps_its_newest_step_and_the_one_before_it(tmp_path):
    w = torch.zeros(4)
    ckpt = checkpointer(tmp_path, w)
    for last in (2, 4, 6, 8, 10):
        train(ckpt, w, last - 1, last)
        assert complete_steps(tmp_path / "mem") == [s for s in (last - 2, last) if s > 0]
    ckpt.close()
    assert sorted(os.listdir(tmp_path / "mem")) == ["incarnations", "step-000000008", "step-000000010"]


def test_the_fast_tier_deletes_its_older_step_off_the_training_thread_before_writing_the_next(tmp_path, monkeypatch):
    """Freeing a step's pages took longer than the staging copy: on the training thread it tripled
    a save's stall. On the save's thread, before the next step is written, the tier still never
    holds more than two steps."""
    from spotrun.train import fast_tier

    deleted = []
    real_delete = fast_tier.delete_step

    def recording_delete(storage, step, *, why, **options):
        on_training_thread = threading.current_thread() is threading.main_thread()
        deleted.append((step, on_training_thread, sorted(os.listdir(tmp_path / "mem"))))
        real_delete(storage, step, why=why, **options)

    monkeypatch.setattr(fast_tier, "delete_step", recording_delete)
    w = torch.zeros(4)
    ckpt = checkpointer(tmp_path, w)
    train(ckpt, w, 1, 6)
    ckpt.close()
    assert deleted == [(2, False, ["incarnations", "step-000000002", "step-000000004"])]
    assert complete_steps(tmp_path / "mem") == [4, 6]


def test_a_fast_tier_over_its_budget_is_refused_with_the_sizes_and_training_goes_on_with_storage(tmp_path, caplog):
    w = torch.zeros(1000)  # 4000 bytes, and the RNG states: two steps do not fit 5000 bytes
    with caplog.at_level(logging.ERROR, logger="spotrun"):
        ckpt = checkpointer(tmp_path, w, interval_steps=3, memory_budget_bytes=5000)
        for step in range(1, 7):
            w.fill_(step)
            ckpt.end_of_step(step)
        ckpt.close()
    assert re.search(
        r"does not fit: 2 steps of this node's ranks take [\d.]+ KiB, but the budget allows 4.9 KiB", caplog.text
    )
    assert "(budget 4.9 KiB, free in" in caplog.text and "running with storage only" in caplog.text
    assert complete_steps(tmp_path / "mem") == []
    assert complete_steps(tmp_path / "store") == [3, 6]


def test_an_older_start_cannot_commit_into_the_fast_tier_of_a_newer_one(tmp_path, caplog):
    w_old, w_new = torch.zeros(4), torch.zeros(4)
    old = checkpointer(tmp_path, w_old)
    train(old, w_old, 1, 2)
    new = checkpointer(tmp_path, w_new)
    assert new.restore() == 2
    train(new, w_new, 3, 4)
    with caplog.at_level(logging.ERROR, logger="spotrun"):
        w_old.fill_(99)
        old.end_of_step(4)  # the orphaned old start's due fast-tier save
        old._tier.report_ended()
    assert "the fast tier failed" in caplog.text and "running with storage only" in caplog.text
    w3 = torch.zeros(4)
    assert checkpointer(tmp_path, w3).restore() == 4
    assert torch.equal(w3, torch.full((4,), 4.0))  # the newer start's step, not the orphan's


def test_an_older_start_whose_first_fast_tier_save_comes_late_never_claims_the_tier(tmp_path, caplog):
    w_old, w_new = torch.zeros(4), torch.zeros(4)
    old = checkpointer(tmp_path, w_old)
    train(old, w_old, 1, 1)  # claimed storage's incarnation 0 only: no fast-tier save yet
    old._identity.save_context(1, "test", {}, {}, None)
    new = checkpointer(tmp_path, w_new)
    new.restore()
    train(new, w_new, 1, 2)
    with caplog.at_level(logging.ERROR, logger="spotrun"):
        w_old.fill_(99)
        old.end_of_step(2)
    assert "belongs to incarnation 1, newer than this start's (0)" in caplog.text
    w3 = torch.zeros(4)
    restorer = checkpointer(tmp_path, w3)
    assert restorer.restore() == 2 and restorer._restored.tier == "memory"
    assert torch.equal(w3, torch.full((4,), 2.0))


def test_a_checkpoint_root_deleted_to_start_over_leaves_the_old_fast_tier_unused(tmp_path, caplog):
    """Without ``spotrun run`` nothing else tells the runs apart: the tier's steps count only as
    a shortcut to incarnations the root recorded."""
    import shutil

    w = torch.zeros(4)
    first = checkpointer(tmp_path, w)
    train(first, w, 1, 4)
    first.close()  # its event log writes under the root
    shutil.rmtree(tmp_path / "store")
    w2 = torch.zeros(4)
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        assert checkpointer(tmp_path, w2).restore() == 0
    assert torch.equal(w2, torch.zeros(4))
    assert "fast tier step 4 ignored: the checkpoint root does not know its incarnation 0" in caplog.text


def test_a_fast_tier_step_fenced_on_the_root_is_never_resumed(tmp_path, caplog):
    """A newer start that resumed from an older step fences the older start's later steps on the
    root; the tier's copies of them are fenced alike."""
    from spotrun.checkpoint.claim import claim_incarnation

    w = torch.zeros(4)
    train(checkpointer(tmp_path, w, interval_steps=2), w, 1, 4)  # storage 2, 4; tier 2, 4 (incarnation 0)
    claim_incarnation(LocalStorage(str(tmp_path / "store")), resumed_step=2, at_least=1, run_id="")
    w2 = torch.zeros(4)
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        restorer = checkpointer(tmp_path, w2)
        assert restorer.restore() == 2
    assert torch.equal(w2, torch.full((4,), 2.0))
    assert "fast tier step 4 ignored: incarnation 1 fenced it on the checkpoint root" in caplog.text


def stop_at(tmp_path, w: torch.Tensor, monkeypatch, stop_step: int, **options) -> spotrun.Checkpointer:
    """Train from step 1 until the emergency stop at ``stop_step`` (``$SPOTRUN_STOP_AT_STEP``)."""
    monkeypatch.setenv("SPOTRUN_STOP_AT_STEP", str(stop_step))
    ckpt = checkpointer(tmp_path, w, interval_steps=5, **options)
    for step in range(1, stop_step + 1):
        w.fill_(step)
        if ckpt.end_of_step(step):
            break
        ckpt._tier.report_ended()
    assert ckpt.preempted and step == stop_step
    monkeypatch.delenv("SPOTRUN_STOP_AT_STEP")
    return ckpt


def test_an_emergency_step_lands_in_the_fast_tier_after_storage_and_a_restart_reads_it_from_memory(
    tmp_path, monkeypatch, caplog
):
    w = torch.zeros(4)
    ckpt = stop_at(tmp_path, w, monkeypatch, 7)
    ckpt.close()
    assert complete_steps(tmp_path / "store") == [5, 7]
    assert complete_steps(tmp_path / "mem") == [6, 7]

    w2 = torch.zeros(4)
    with caplog.at_level(logging.INFO, logger="spotrun"):
        restorer = checkpointer(tmp_path, w2)
        assert restorer.restore() == 7
    assert restorer._restored.tier == "memory"
    assert torch.equal(w2, torch.full((4,), 7.0))


def test_an_emergency_step_skips_the_fast_tier_when_its_saves_would_not_fit_the_time_left(
    tmp_path, monkeypatch, caplog
):
    w = torch.zeros(4)
    monkeypatch.setattr("spotrun.train.meter.SaveMeter.full_save_s", lambda self: 1e6)
    with caplog.at_level(logging.INFO, logger="spotrun"):
        ckpt = stop_at(tmp_path, w, monkeypatch, 7)
    ckpt.close()
    assert complete_steps(tmp_path / "store") == [5, 7]  # storage first, as always
    assert complete_steps(tmp_path / "mem") == [4, 6]  # as the periodic tier saves left it
    assert "emergency step 7 is not written to the fast tier: a fast-tier save takes 1000000.00 s" in caplog.text


def test_an_emergency_step_skips_a_fast_tier_that_has_not_saved_yet(tmp_path, monkeypatch, caplog):
    w = torch.zeros(4)
    with caplog.at_level(logging.INFO, logger="spotrun"):
        ckpt = stop_at(tmp_path, w, monkeypatch, 3, memory_interval_steps=10)
    ckpt.close()
    assert complete_steps(tmp_path / "store") == [3]
    assert complete_steps(tmp_path / "mem") == []
    assert "emergency step 3 is not written to the fast tier: no fast-tier save has committed yet" in caplog.text


def test_on_several_nodes_the_tier_keeps_the_newest_step_and_the_newest_one_fully_replicated():
    """While the replicas of the newest step still copy, a lost node must still leave a whole step:
    the newest step held on 1 + R nodes stays until a newer one is."""
    from spotrun.storage.base import ObjectInfo
    from spotrun.train.fast_tier import steps_to_keep

    def objects(step: int, manifest: bool = True) -> list[ObjectInfo]:
        names = ["rank-00000.i000000000.safetensors", "rank-00001.i000000000.safetensors"]
        names += ["manifest.i000000000.json"] if manifest else []
        return [ObjectInfo(f"step-{step:09d}/{n}", 1, 0.0) for n in names]

    by_step = {22: objects(22), 24: objects(24), 26: objects(26), 28: objects(28, manifest=False)}
    held_twice = {o.key for o in by_step[22] + by_step[24]}  # 26's replicas are still copying
    holders = lambda key: 2 if key in held_twice else 1  # noqa: E731
    assert steps_to_keep(by_step, holders, copies=2) == {24, 26}
    assert steps_to_keep(by_step, lambda key: 2, copies=2) == {26}  # all replicated: the newest alone
    assert steps_to_keep(by_step, None, copies=1) == {26}  # one node: the newest complete step
    assert steps_to_keep({28: objects(28, manifest=False)}, holders, copies=2) == set()
