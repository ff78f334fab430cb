"""Single-process checkpoint tests: round trip, exact resume, errors, verification."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.stream import ShardSource
from spotrun.errors import NoCheckpointError, StateMismatchError, StateSerializationError
from spotrun.storage import LocalStorage
from tests.support.ckpt_files import manifest_path, shard_path


class TiedModel(torch.nn.Module):
    """Embedding and output head share one weight (field case C05)."""

    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.drop = torch.nn.Dropout(0.5)
        self.hidden = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B,) int64 -> (B, vocab)
        return self.head(self.drop(torch.relu(self.hidden(self.emb(x)))))


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = TiedModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=40)
    return model, opt, sched


def train(model, opt, sched, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 11, (16,))
        noise = random.random() + float(np.random.rand())  # python and numpy RNG matter too
        loss = torch.nn.functional.cross_entropy(model(x), x) * (1.0 + 0.0 * noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item() + noise)
    return losses


def checkpointer(tmp_path, model, opt, sched, **kwargs) -> spotrun.Checkpointer:
    return spotrun.Checkpointer(
        {"model": model, "optimizer": opt, "scheduler": sched},
        storage=LocalStorage(str(tmp_path), fsync=False),
        handle_signals=False,
        **kwargs,
    )


def test_resume_is_bit_exact(tmp_path):
    model, opt, sched = build()
    ckpt = checkpointer(tmp_path, model, opt, sched)
    train(model, opt, sched, 5)
    ckpt.save(5)
    reference = train(model, opt, sched, 6)

    model2, opt2, sched2 = build(seed=123)  # different init and RNG: all must come from the checkpoint
    random.seed(99)
    np.random.seed(99)
    ckpt2 = checkpointer(tmp_path, model2, opt2, sched2)
    assert ckpt2.restore() == 5
    assert train(model2, opt2, sched2, 6) == reference
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_tied_weights_are_saved_once_and_restored_tied(tmp_path):
    """Field case C05."""
    model, opt, sched = build()
    train(model, opt, sched, 3)
    checkpointer(tmp_path, model, opt, sched).save(3)
    manifest = json.loads(manifest_path(tmp_path, 3).read_text())
    assert manifest["aliases"] == {"model/head.weight": "model/emb.weight"}

    model2, opt2, sched2 = build(seed=7)
    assert checkpointer(tmp_path, model2, opt2, sched2).restore() == 3
    assert model2.head.weight.data_ptr() == model2.emb.weight.data_ptr()
    assert model2.head.weight is model2.emb.weight
    assert torch.equal(model2.emb.weight, model.emb.weight)
    assert torch.equal(model2.head.weight, model.head.weight)


def test_non_serialisable_value_names_its_key_and_writes_nothing(tmp_path):
    model, opt, sched = build()
    extra = {"epoch": 3, "hooks": {"on_end": print}}
    ckpt = spotrun.Checkpointer(
        {"model": model, "extra": extra}, storage=LocalStorage(str(tmp_path)), handle_signals=False
    )
    with pytest.raises(StateSerializationError, match=r"extra/hooks/on_end"):
        ckpt.save(1)
    assert list(tmp_path.iterdir()) == []


def test_json_state_round_trips_types(tmp_path):
    extra = {"epoch": 3, "ids": {0: "a", 1: "b"}, "betas": (0.9, 0.99), "inf": float("inf"), "none": None}
    ckpt = spotrun.Checkpointer({"extra": extra}, storage=LocalStorage(str(tmp_path)), handle_signals=False)
    ckpt.save(2)
    restored: dict = {}
    ckpt2 = spotrun.Checkpointer({"extra": restored}, storage=LocalStorage(str(tmp_path)), handle_signals=False)
    assert ckpt2.restore() == 2
    assert restored == extra
    assert isinstance(restored["betas"], tuple) and list(restored["ids"]) == [0, 1]


def test_corrupt_shard_falls_back_to_previous_step(tmp_path, caplog):
    model, opt, sched = build()
    ckpt = checkpointer(tmp_path, model, opt, sched)
    train(model, opt, sched, 2)
    ckpt.save(2)
    after_two = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, sched, 2)
    ckpt.save(4)
    shard = shard_path(tmp_path, 4, 0)
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size, different bytes: only the checksum can tell
    shard.write_bytes(bytes(data))
    assert catalog.newest_complete(LocalStorage(str(tmp_path))).step == 4  # sizes still match

    model2, opt2, sched2 = build(seed=5)
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        assert checkpointer(tmp_path, model2, opt2, sched2).restore() == 2
    assert "checkpoint step 4 failed verification" in caplog.text
    assert "falling back to step 2" in caplog.text
    for name, value in model2.state_dict().items():
        assert torch.equal(value, after_two[name]), name
    steps = {s.step: s for s in catalog.list_steps(LocalStorage(str(tmp_path)))}
    assert steps[4].status == catalog.CORRUPT and steps[2].status == catalog.COMPLETE

    # The rejected step can be saved again later and then commits normally.
    ckpt2 = checkpointer(tmp_path, model2, opt2, sched2)
    ckpt2.save(4)
    assert catalog.newest_complete(LocalStorage(str(tmp_path))).step == 4


def test_every_step_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    model, opt, sched = build()
    ckpt = checkpointer(tmp_path, model, opt, sched)
    ckpt.save(1)
    shard = shard_path(tmp_path, 1, 0)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(NoCheckpointError, match="tried steps"):
        checkpointer(tmp_path, *build()).restore()
    # the step is now un-committed (corrupt): the next start still refuses to begin again at 0,
    # and so does the supervisor, before it launches anything
    with pytest.raises(NoCheckpointError, match=r"step\(s\) \[1\] failed verification.*refusing to start over"):
        checkpointer(tmp_path, *build()).restore()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--checkpoint-uri",
            str(tmp_path),
            "--notice",
            "none",
            "--",
            sys.executable,
            "-c",
            "raise SystemExit(7)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "refusing to start over from step 0" in run.stderr, run.stderr[-2000:]
    assert "started pid" not in run.stderr


def test_fresh_start_returns_zero(tmp_path):
    assert checkpointer(tmp_path, *build()).restore() == 0


def test_missing_state_name_is_a_clear_error(tmp_path):
    model, opt, sched = build()
    spotrun.Checkpointer({"model": model}, storage=LocalStorage(str(tmp_path)), handle_signals=False).save(1)
    with pytest.raises(StateMismatchError, match="no state named 'optimizer'"):
        checkpointer(tmp_path, model, opt, sched).restore()


def test_wrong_architecture_is_a_clear_error(tmp_path):
    model, opt, sched = build()
    checkpointer(tmp_path, model, opt, sched).save(1)
    other = torch.nn.Linear(3, 3)
    ckpt = spotrun.Checkpointer(
        {"model": other, "optimizer": {}, "scheduler": {}},
        storage=LocalStorage(str(tmp_path)),
        handle_signals=False,
    )
    with pytest.raises(StateMismatchError, match="cannot load saved state 'model'"):
        ckpt.restore()


def test_periodic_saves_follow_interval(tmp_path):
    model, opt, sched = build()
    ckpt = checkpointer(tmp_path, model, opt, sched, interval_steps=3)
    for step in range(1, 8):
        assert ckpt.end_of_step(step) is False
    ckpt.close()  # waits for the save of step 6, written in the background
    assert [s.step for s in catalog.list_steps(LocalStorage(str(tmp_path)))] == [3, 6]


def shard_bytes(tensors: dict, metadata: dict) -> bytes:
    """The bytes the writer streams for one shard file."""
    source = ShardSource(tensors, metadata)
    out = bytearray(source.size_bytes)
    source.readinto(0, memoryview(out))
    return bytes(out)


def test_shard_metadata_values_are_strings_and_an_empty_shard_opens(tmp_path):
    """Field case C11."""
    data = shard_bytes({"w": torch.ones(2)}, {"step": 7, "ratio": 0.5, "ok": True})
    path = tmp_path / "a.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"step": "7", "ratio": "0.5", "ok": "True"}
        assert torch.equal(f.get_tensor("w"), torch.ones(2))
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(shard_bytes({}, {"rank": 1}))
    with safe_open(str(empty), framework="pt") as f:
        assert list(f.keys()) == [] and f.metadata() == {"rank": "1"}
    with pytest.raises(StateSerializationError):
        shard_bytes({}, {3: "x"})


def test_rng_states_are_restored(tmp_path):
    ckpt = spotrun.Checkpointer({"x": {"v": 1}}, storage=LocalStorage(str(tmp_path)), handle_signals=False)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    ckpt.save(1)
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(10)
    np.random.seed(20)
    torch.manual_seed(30)
    assert spotrun.Checkpointer({"x": {}}, storage=LocalStorage(str(tmp_path)), handle_signals=False).restore() == 1
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_checkpoint_request_saves_once_and_training_goes_on(tmp_path, monkeypatch):
    from spotrun.control import files as control

    control_dir = tmp_path / "control"
    control_dir.mkdir()
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(control_dir))
    model, opt, sched = build()
    ckpt = checkpointer(tmp_path / "ck", model, opt, sched, interval_steps=100)
    assert ckpt.end_of_step(1) is False
    control.write_checkpoint_request(str(control_dir), "aws: rebalance")
    assert ckpt.end_of_step(2) is False  # saved, and keeps training
    assert ckpt.end_of_step(3) is False  # the same request is served once
    control.write_checkpoint_request(str(control_dir), "aws: rebalance")
    assert ckpt.end_of_step(4) is False
    ckpt.close()  # waits for the save of step 4, written in the background
    steps = catalog.list_steps(LocalStorage(str(tmp_path / "ck")))
    assert [(s.step, s.reason) for s in steps] == [(2, "requested"), (4, "requested")]


def test_unserialisable_state_fails_at_restore_before_training(tmp_path):
    model, opt, sched = build()
    ckpt = spotrun.Checkpointer(
        {"model": model, "cfg": {"f": lambda x: x}}, storage=LocalStorage(str(tmp_path)), handle_signals=False
    )
    with pytest.raises(StateSerializationError, match="cfg/f"):
        ckpt.restore()


def test_a_committed_step_is_never_overwritten(tmp_path):
    model, opt, sched = build()
    checkpointer(tmp_path, model, opt, sched).save(5)
    shard = shard_path(tmp_path, 5, 0)
    before = shard.read_bytes()
    train(model, opt, sched, 1)  # different state, same step number
    from spotrun.errors import CheckpointSaveError

    with pytest.raises(CheckpointSaveError, match="already committed"):
        checkpointer(tmp_path, model, opt, sched).save(5)
    assert shard.read_bytes() == before
    assert checkpointer(tmp_path, *build(seed=3)).restore() == 5


@pytest.mark.parametrize("damage", ["bad-manifest", "short-shard"])
def test_training_gets_through_a_step_that_was_corrupt(tmp_path, damage):
    """After falling back past a corrupt step, saving that step again must work."""
    model, opt, sched = build()
    ckpt = checkpointer(tmp_path, model, opt, sched)
    ckpt.save(2)
    train(model, opt, sched, 2)
    ckpt.save(4)
    if damage == "bad-manifest":
        manifest_path(tmp_path, 4).write_text('{"format": "spotrun-checkpoint", "trunc')
    else:
        shard = shard_path(tmp_path, 4, 0)
        shard.write_bytes(shard.read_bytes()[:-10])
    model2, opt2, sched2 = build(seed=1)
    ckpt2 = checkpointer(tmp_path, model2, opt2, sched2)
    assert ckpt2.restore() == 2
    train(model2, opt2, sched2, 2)
    ckpt2.save(4)
    steps = {s.step: s.status for s in catalog.list_steps(LocalStorage(str(tmp_path)))}
    assert steps == {2: "complete", 4: "complete"}
    assert checkpointer(tmp_path, *build(seed=2)).restore() == 4


def test_stop_at_step_takes_the_emergency_checkpoint_of_exactly_that_step(tmp_path, monkeypatch):
    """$SPOTRUN_STOP_AT_STEP acts like an agreed save request at that step, whatever the check
    interval: the emergency checkpoint of that step, the commit report, and True."""
    from spotrun.control import files as control

    control_dir = tmp_path / "control"
    control_dir.mkdir()
    monkeypatch.setenv("SPOTRUN_CONTROL_DIR", str(control_dir))
    monkeypatch.setenv("SPOTRUN_STOP_AT_STEP", "5")
    model, opt, sched = build()
    ckpt = checkpointer(tmp_path / "ck", model, opt, sched, interval_steps=2, check_interval_steps=4)
    stopped_at = next(step for step in range(1, 20) if ckpt.end_of_step(step))
    assert stopped_at == 5 and ckpt.preempted
    steps = catalog.list_steps(LocalStorage(str(tmp_path / "ck")))
    assert [(s.step, s.reason, s.status) for s in steps] == [
        (2, "periodic", "complete"),
        (4, "periodic", "complete"),
        (5, "emergency", "complete"),
    ]
    assert control.read_commit_report(str(control_dir)).step == 5  # so the supervisor exits 143


def test_stop_at_step_is_read_like_the_resume_step():
    from spotrun.control.env import WorkerEnv
    from spotrun.errors import ConfigError

    assert WorkerEnv.from_environ({}).stop_at_step is None
    assert WorkerEnv.from_environ({"SPOTRUN_STOP_AT_STEP": " 12 "}).stop_at_step == 12
    with pytest.raises(ConfigError, match="SPOTRUN_STOP_AT_STEP"):
        WorkerEnv.from_environ({"SPOTRUN_STOP_AT_STEP": "twelve"})
