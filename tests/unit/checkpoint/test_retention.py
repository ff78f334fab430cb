"""Retention (``keep_last``, ``keep_every``): which steps a job keeps, on a local root and on
the moto server, in the Checkpointer and through ``spotrun run``.

The kill in the middle of a deletion and ``spotrun gc`` are in tests/unit/cli/test_gc.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import data_file_key, shard_name, step_dir
from spotrun.checkpoint.retention import Retainer, RetentionPolicy, plan_retention
from spotrun.errors import ConfigError, StorageError
from spotrun.storage import LocalStorage, open_storage
from spotrun.supervisor.config_file import load_run_config
from tests.support.paths import JOBS
from tests.support.trainrun import start_supervised

WORKER = JOBS / "retention_job.py"


def statuses(storage) -> dict[int, str]:
    return {s.step: s.status for s in catalog.list_steps(storage)}


def train(storage, steps: int, *, interval: int = 10, background: bool = True, **options) -> spotrun.Checkpointer:
    """A single-process loop over a tiny state, saving every ``interval`` steps; returns the closed Checkpointer."""
    state = {"model": {"w": torch.zeros(4)}}
    ckpt = spotrun.Checkpointer(
        state, storage=storage, interval_steps=interval, handle_signals=False, background_saves=background, **options
    )
    step = ckpt.restore()
    while step < steps:
        step += 1
        state["model"]["w"] += 1.0
        if ckpt.end_of_step(step):  # an emergency save: stop
            break
    ckpt.close()
    return ckpt


def restored(storage) -> tuple[int, torch.Tensor]:
    state = {"model": {"w": torch.zeros(4)}}
    step = spotrun.Checkpointer(state, storage=storage, handle_signals=False).restore()
    return step, state["model"]["w"]


# --- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "complete, policy, protected, kept",
    [
        ([10, 20, 30, 40, 50, 60], RetentionPolicy(keep_last=2, keep_every=50), {}, [50, 60]),
        ([10, 20, 50, 100, 110, 120, 130], RetentionPolicy(keep_last=2, keep_every=50), {}, [50, 100, 120, 130]),
        ([10, 20, 30], RetentionPolicy(keep_last=1), {10: "resumed"}, [10, 30]),
        ([10, 20, 30], RetentionPolicy(keep_last=5), {}, [10, 20, 30]),
        ([10, 20, 30], RetentionPolicy(), {}, [10, 20, 30]),
        ([10, 20, 30], RetentionPolicy(keep_last=0, keep_every=7), {}, [10, 20, 30]),
        ([], RetentionPolicy(keep_last=1), {}, []),
    ],
)
def test_the_rule_keeps_the_newest_the_divisible_and_the_protected_steps(complete, policy, protected, kept):
    decisions = plan_retention(complete, policy, protected=protected)
    assert [d.step for d in decisions] == sorted(complete)
    assert [d.step for d in decisions if not d.delete] == kept
    assert all(d.reason for d in decisions)


def test_keep_every_without_keep_last_and_values_below_their_minimum_are_refused():
    with pytest.raises(ConfigError, match="keep_every=50 needs keep_last"):
        RetentionPolicy(keep_every=50)
    with pytest.raises(ConfigError, match="keep_last must be >= 0"):
        RetentionPolicy(keep_last=-1)
    with pytest.raises(ConfigError, match="keep_every must be >= 1"):
        RetentionPolicy(keep_last=2, keep_every=0)
    with pytest.raises(ConfigError, match="keep_every=5 needs keep_last"):
        spotrun.Checkpointer({"model": {"w": torch.zeros(1)}}, uri="unused", keep_every=5, handle_signals=False)


# --- in a training job ---------------------------------------------------------------------


@pytest.mark.parametrize("backend, background", [("local", True), ("local", False), ("s3", True)])
def test_keep_last_2_keep_every_50_leaves_exactly_the_expected_steps(tmp_path, request, backend, background):
    uri = f"{request.getfixturevalue('s3_bucket').uri}/ck" if backend == "s3" else str(tmp_path / "ck")
    storage = open_storage(uri)
    train(storage, 130, background=background, keep_last=2, keep_every=50)
    assert statuses(storage) == {50: "complete", 100: "complete", 120: "complete", 130: "complete"}
    kept_dirs = {o.key.split("/")[0] for o in storage.list("") if o.key.startswith("step-")}
    assert kept_dirs == {step_dir(s) for s in (50, 100, 120, 130)}  # nothing left of the deleted steps
    if backend == "local":
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [  # the event log and incarnations stay
            "events",
            "incarnations",
            *(step_dir(s) for s in (50, 100, 120, 130)),
        ]
    step, w = restored(storage)
    assert step == 130 and torch.equal(w, torch.full((4,), 130.0))


def test_the_resume_source_is_never_deleted(tmp_path):
    """Steps 100, 200, 300 exist; 300 fails verification, so the next start resumes from 200
    with keep_last=1: saving 210 and 220 deletes 100 and 210, never 200."""
    storage = LocalStorage(str(tmp_path / "ck"))
    train(storage, 300, interval=100)
    shard = tmp_path / "ck" / data_file_key(300, 0, shard_name(0, 0), None)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a flipped byte in the tensor data: the checksum fails on restore
    shard.write_bytes(bytes(data))
    state = {"model": {"w": torch.zeros(4)}}
    ckpt = spotrun.Checkpointer(state, storage=storage, handle_signals=False, keep_last=1)
    assert ckpt.restore() == 200
    ckpt.save(210)
    ckpt.save(220)
    ckpt.close()
    assert statuses(storage) == {200: "complete", 220: "complete", 300: "corrupt"}


def test_a_checkpointer_argument_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTRUN_KEEP_LAST", "1")
    from_env, overridden = LocalStorage(str(tmp_path / "env")), LocalStorage(str(tmp_path / "arg"))
    train(from_env, 30)
    train(overridden, 30, keep_last=0)  # 0: keep every step
    assert statuses(from_env) == {30: "complete"}
    assert statuses(overridden) == {10: "complete", 20: "complete", 30: "complete"}


def test_an_emergency_save_leaves_retention_to_the_next_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTRUN_STOP_AT_STEP", "25")
    storage = LocalStorage(str(tmp_path / "ck"))
    train(storage, 30, keep_last=1)  # periodic 10, 20; at 25 the emergency save, and the loop stops there
    assert statuses(storage) == {20: "complete", 25: "complete"}


class _NoDelete(LocalStorage):
    """A store that refuses every deletion."""

    def _delete(self, key: str) -> None:
        raise StorageError(13, f"delete {key}: refused (test)")


@pytest.mark.parametrize("background", [True, False])
def test_a_retention_failure_is_logged_and_never_fails_a_save(tmp_path, caplog, background):
    storage = _NoDelete(str(tmp_path / "ck"))
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        train(storage, 30, background=background, keep_last=1)
    assert statuses(storage) == {10: "complete", 20: "complete", 30: "complete"}
    failures = [r.getMessage() for r in caplog.records if "retention (keep_last=1) after the commit" in r.getMessage()]
    assert len(failures) == 2 and "refused (test)" in failures[0]  # after 20 and after 30
    assert restored(storage)[0] == 30


def test_an_orphaned_incarnation_deletes_nothing(tmp_path, caplog):
    storage = LocalStorage(str(tmp_path / "ck"))
    old = train(storage, 20)  # incarnation 0 committed 10 and 20
    assert restored(storage)[0] == 20  # a newer start claims incarnation 1
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        assert Retainer(storage, RetentionPolicy(keep_last=1), timeout_s=60).after_commit(20, old.incarnation) == []
    assert statuses(storage) == {10: "complete", 20: "complete"}
    assert any("retention not applied after the commit of step 20" in r.getMessage() for r in caplog.records)


# --- through spotrun run -------------------------------------------------------------------


def test_keep_last_and_keep_every_in_a_config_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("keep_last: 2\nkeep_every: ${EVERY:-50}\n")
    assert load_run_config(config, environ={}) == {"keep_last": 2, "keep_every": 50}
    config.write_text("keep_last: two\n")
    with pytest.raises(ConfigError, match="keep_last must be an integer"):
        load_run_config(config, environ={})


@pytest.mark.slow
def test_spotrun_run_passes_the_retention_to_torchrun_workers(tmp_path, processes):
    """keep_every from the config file, keep_last on the command line; the workers' Checkpointer
    is given neither: 2 gloo ranks save every step 1..10 and keep 4, 8, 9, 10."""
    config = tmp_path / "run.yaml"
    config.write_text("keep_every: 4\n")
    ck, log_path = tmp_path / "ck", tmp_path / "supervisor.log"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(WORKER),
        "10",
    ]
    proc = start_supervised(
        str(ck),
        command,
        extra_options=["--notice", "none", "--config", str(config), "--keep-last", "2", "--log-level", "info"],
        log_path=log_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    processes.append(proc)
    assert proc.wait(timeout=300) == 0, log_path.read_text()[-3000:]
    assert statuses(LocalStorage(str(ck))) == {4: "complete", 8: "complete", 9: "complete", 10: "complete"}
    assert "retention (keep_last=2, keep_every=4): deleted step 7" in log_path.read_text()


def test_a_bad_retention_option_is_refused_before_anything_starts(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrun",
            "run",
            "--checkpoint-uri",
            str(tmp_path / "ck"),
            "--keep-every",
            "50",
            "--",
            sys.executable,
            "-c",
            "pass",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("spotrun: error: keep_every=50 needs keep_last")
    assert not (tmp_path / "ck").exists()
