"""A committed format-4 step whose manifest, rank index or safetensors header was edited, with
every digest recomputed the way spotrun records it (so the edit passes the digest check), is
caught by the checks ``spotrun verify`` makes, before a byte of it reaches a live tensor: the
restore resumes the previous step bit-exactly, one log line names the file and the reason, and
``spotrun ls`` lists the step as corrupt. A state that then refuses to load for what it holds (an
RNG state the generator rejects) is a verification failure too. A self-consistent step that does
not fit the job's model stays a StateMismatchError and un-commits nothing.

Issue 21 (a mutation campaign against format-4 steps: damaged or hostile checkpoints; no field
case), on a one-process save and on C17's FSDP2 state saved by 2 ranks with real torchrun and gloo.
"""

from __future__ import annotations

import copy
import json
import logging
import pathlib
import random
import shutil
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.restore import load_step
from spotrun.checkpoint.verify import steps_to_verify, verify_step
from spotrun.cli import main
from spotrun.errors import CorruptShardError, StateMismatchError
from spotrun.storage import LocalStorage
from tests.support.ckpt_files import manifest_path
from tests.support.paths import JOBS, REPO
from tests.support.step_edits import edit_chunk_bytes, edit_header, edit_index, edit_manifest, redigest
from tests.unit.checkpoint.test_sharded_state import run_with_stderr

ROOT = REPO
WORKER = JOBS / "sharded_job.py"
sys.path.insert(0, str(WORKER.parent))
import sharded_job  # noqa: E402  (the worker's model, also restored in this process)

# --- edits (the files are edited with tests/support/step_edits.py) ---------------------------------------


def shift(entry: str, by: int) -> Callable[[dict], None]:
    def edit(header: dict) -> None:
        header[entry]["data_offsets"] = [o + by for o in header[entry]["data_offsets"]]

    return edit


def into_header(key: str) -> Callable[[dict], None]:
    def edit(index: dict) -> None:
        file_index, begin, end = index["chunks"][key]
        index["chunks"][key] = [file_index, 8, 8 + end - begin]  # the same length, in the JSON header

    return edit


def set_dtype(entry: str, code: str) -> Callable[[dict], None]:
    def edit(header: dict) -> None:
        header[entry]["dtype"] = code

    return edit


def set_block_bytes(index: dict) -> None:
    index["files"][0]["block_bytes"] = 2**19  # a file under 512 KiB: the same single block digest


def set_shape(tensor: str, shape: list[int]) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        record = manifest["tensors"][tensor]
        record.update(shape=shape, grid=[1] * len(shape))

    return edit


def python_rng_index_out_of_range(internal: bytearray) -> None:
    internal[-8:] = (10**6).to_bytes(8, "little")  # random.getstate()'s position: at most 624


def point_at(state: str, key: str, tensor: str) -> Callable[[dict], None]:
    """The state skeleton refers to ``tensor`` at ``state/key`` (its own tensor there no more)."""

    def edit(manifest: dict) -> None:
        manifest["state"][state][key] = {"__tensor__": tensor}

    return edit


def chunk_list(tensor: str, chunks: list) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        record = manifest["tensors"][tensor]
        record.pop("grid"), record.pop("writers")
        record["chunks"] = chunks

    return edit


# --- a one-process step (replicated state) -------------------------------------------------------


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    extra = {"t": torch.randn(6), "count": seed}  # a plain container of a tensor and JSON
    return model, opt, extra


def checkpointer(root: pathlib.Path, model, opt, extra) -> spotrun.Checkpointer:
    return spotrun.Checkpointer(
        {"model": model, "optimizer": opt, "extra": extra},
        storage=LocalStorage(str(root), fsync=False),
        handle_signals=False,
    )


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(5, 3)).square().mean() * (1 + 0 * random.random() + 0 * np.random.rand())
        opt.zero_grad()
        loss.backward()
        opt.step()


def snapshot(model, opt, extra) -> dict:
    """Every value a restore must give back, and every generator's state."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(opt.state_dict()),
        "extra": copy.deepcopy(extra),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(legacy=True),
    }


def assert_same(got: dict, expected: dict) -> None:
    assert got["model"].keys() == expected["model"].keys()
    for name, value in got["model"].items():
        assert torch.equal(value, expected["model"][name]), name
    for param, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][param][key], value), (param, key)
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert got["extra"]["count"] == expected["extra"]["count"]
    assert got["extra"]["t"].shape == expected["extra"]["t"].shape and torch.equal(
        got["extra"]["t"], expected["extra"]["t"]
    )
    assert torch.equal(got["torch_rng"], expected["torch_rng"])
    assert got["python_rng"] == expected["python_rng"]
    assert all(np.array_equal(a, b) for a, b in zip(got["numpy_rng"], expected["numpy_rng"]))


@pytest.fixture(scope="module")
def replicated(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """Steps 1 and 2 of a one-process job, and every value of step 1."""
    root = tmp_path_factory.mktemp("replicated") / "ck"
    model, opt, extra = build()
    ckpt = checkpointer(root, model, opt, extra)
    train(model, opt, 2)
    expected = snapshot(model, opt, extra)
    ckpt.save(1)
    train(model, opt, 2)
    extra["t"].add_(1.0)
    extra["count"] = 7
    ckpt.save(2)
    ckpt.close()
    return root, expected


def statuses(root: pathlib.Path, capsys) -> dict[int, str]:
    """``spotrun ls --json``: step -> status."""
    capsys.readouterr()
    assert main(["ls", str(root), "--json"]) == 0
    return {row["step"]: row["status"] for row in json.loads(capsys.readouterr().out)}


def assert_verify_finds(root: pathlib.Path, step: int, file: str, reason: str) -> None:
    """What ``spotrun verify --step STEP`` finds names the same file and reason (one validation,
    two users), but for an RNG state: only the generator can tell, when it is loaded."""
    storage = LocalStorage(str(root))
    [info] = steps_to_verify(storage, step=step)
    report = verify_step(storage, info, explicit=True)
    found = [str(problem) for problem in report.problems]
    if "RNG" in reason:
        assert report.ok, found
        return
    assert any(reason in line and (file in line or file == f"step {step}") for line in found), found


def fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]


# (id, edit of step 2, what the one log line says: the file's name and the reason)
REPLICATED_EDITS: list[tuple[str, Callable[[pathlib.Path], None], str, str]] = [
    (
        "header dtype changed",
        lambda root: edit_header(root, 2, 0, set_dtype("model/weight", "I32")),
        "rank-00000.",
        "tensor model/weight is stored as I32[4, 3]",
    ),
    (
        "header data_offsets shifted",
        lambda root: edit_header(root, 2, 0, shift("model/bias", 4)),
        "rank-00000.",
        "tensor model/bias starts at byte",
    ),
    (
        "index range pointing into the header",
        lambda root: edit_index(root, 2, 0, into_header("model/bias")),
        "rank-00000.",
        "rank 0's index says 8-24",
    ),
    (
        "block size disagreeing with the manifest",
        lambda root: edit_index(root, 2, 0, set_block_bytes),
        "rank-00000.i000000000.index.json",
        "in blocks of 524288; the manifest records",
    ),
    (
        "manifest shape disagreeing with the file",
        lambda root: edit_manifest(root, 2, set_shape("model/weight", [3, 4])),
        "rank-00000.",
        "tensor model/weight is stored as F32[4, 3]",
    ),
    (
        "plain container's manifest shape disagreeing with the file",
        lambda root: edit_manifest(root, 2, set_shape("extra/t", [2, 3])),
        "rank-00000.",
        "tensor extra/t is stored as F32[6]",
    ),
    (
        "a chunk list leaving a gap (all of the tensor)",
        lambda root: edit_manifest(root, 2, chunk_list("model/weight", [])),
        "step 2",
        "tensor model/weight: its chunks cover 0 of its 12 elements",
    ),
    (
        "a state that puts another tensor where a parameter was",
        lambda root: edit_manifest(root, 2, point_at("model", "weight", "model/bias")),
        "manifest.i000000000.json",
        "the state holds tensor 'model/bias' at model/weight",
    ),
    (
        "an RNG state the generator rejects",
        lambda root: edit_chunk_bytes(root, 2, 0, "rank-00000/rng/python/internal", python_rng_index_out_of_range),
        "manifest.i000000000.json",
        "saved RNG state is malformed",
    ),
]


@pytest.mark.parametrize("edit, file, reason", [e[1:] for e in REPLICATED_EDITS], ids=[e[0] for e in REPLICATED_EDITS])
def test_an_edited_step_with_recomputed_digests_falls_back_to_the_previous_step_bit_exactly(
    replicated, tmp_path, caplog, capsys, edit, file, reason
):
    source, expected = replicated
    root = pathlib.Path(shutil.copytree(source, tmp_path / "ck"))
    edit(root)
    redigest(root, 2)
    assert catalog.newest_complete(LocalStorage(str(root))).step == 2  # sizes and digests agree
    assert_verify_finds(root, 2, file, reason)

    model, opt, extra = build(seed=5)
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        assert checkpointer(root, model, opt, extra).restore() == 1
    [line] = fallback_lines(caplog)
    assert line.startswith("checkpoint step 2 failed verification (rank 0: ") and line.endswith(
        "falling back to step 1"
    )
    assert file in line and reason in line, line
    assert_same(snapshot(model, opt, extra), expected)
    assert statuses(root, capsys) == {1: "complete", 2: "corrupt"}


def test_nothing_is_read_into_a_live_tensor_before_the_whole_step_passed_the_checks(replicated, tmp_path):
    """The last chunk in the file is the edited one: every other tensor would be read first if
    the checks ran as the reads go."""
    source, _ = replicated
    root = pathlib.Path(shutil.copytree(source, tmp_path / "ck"))
    edit_header(root, 2, 0, set_dtype("rank-00000/rng/torch_cpu", "I8"))
    redigest(root, 2)
    storage = LocalStorage(str(root))
    info = catalog.committed(storage, 2)
    live = {
        name: torch.full(record.shape, 7, dtype=getattr(torch, record.dtype))
        for name, record in info.manifest.tensors.items()
    }
    before = {name: t.clone() for name, t in live.items()}
    with pytest.raises(CorruptShardError, match=r"rank-00000\..*: tensor rank-00000/rng/torch_cpu is stored as I8"):
        load_step(storage, 2, info.manifest_key, 0, 1, destinations=live)
    for name, tensor in live.items():
        assert torch.equal(tensor, before[name]), name


def test_a_different_model_on_an_intact_step_is_a_state_mismatch_and_uncommits_nothing(replicated, tmp_path, capsys):
    source, _ = replicated
    root = pathlib.Path(shutil.copytree(source, tmp_path / "ck"))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 5)  # another model: a weight of another shape, which the step does not have
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(StateMismatchError, match=r"(?s)cannot load saved state 'model': .*size mismatch for weight"):
        checkpointer(root, model, opt, {}).restore()
    assert statuses(root, capsys) == {1: "complete", 2: "complete"}
    assert manifest_path(root, 2).exists()


class FailingState:
    """A job's own state object whose ``load_state_dict`` has a bug."""

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        raise TypeError("a bug in the job's own code")


def test_the_jobs_own_load_state_dict_failing_stops_the_start_and_uncommits_nothing(tmp_path, capsys):
    root = tmp_path / "ck"
    ckpt = spotrun.Checkpointer(
        {"own": FailingState()}, storage=LocalStorage(str(root), fsync=False), handle_signals=False
    )
    ckpt.save(1)
    ckpt.close()
    with pytest.raises(TypeError, match="a bug in the job's own code"):
        spotrun.Checkpointer(
            {"own": FailingState()}, storage=LocalStorage(str(root), fsync=False), handle_signals=False
        ).restore()
    assert statuses(root, capsys) == {1: "complete"}


# --- FSDP2 state saved by 2 ranks ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """Steps 2 and 3 of an FSDP2 job on 2 ranks, and the digest of every parameter and AdamW
    state tensor at step 2."""
    base = tmp_path_factory.mktemp("sharded")
    root = base / "ck"
    jobs = [{"layout": "fsdp", "ckpt": str(root), "steps": 2}, {"layout": "fsdp", "ckpt": str(root), "steps": 3}]
    results, _ = run_with_stderr(2, jobs, base / "out.json")
    assert [r["restored"] for r in results] == [0, 2]
    return root, results[0]["tensors"]


UP_WEIGHT_CHUNKS = [[[0, 0], [10, 12], 0], [[10, 0], [10, 12], 1]]

# (id, edit of step 3, what the one log line says)
SHARDED_EDITS: list[tuple[str, Callable[[pathlib.Path], None], str, str]] = [
    (
        "a chunk list leaving a gap",
        lambda root: edit_manifest(root, 3, chunk_list("model/up.weight", UP_WEIGHT_CHUNKS[:1])),
        "step 3",
        "tensor model/up.weight: its chunks cover 120 of its 240 elements",
    ),
    (
        "overlapping chunks",
        lambda root: edit_manifest(root, 3, chunk_list("model/up.weight", UP_WEIGHT_CHUNKS + UP_WEIGHT_CHUNKS[:1])),
        "step 3",
        "tensor model/up.weight: its chunks at offsets [0, 0] and [0, 0] overlap",
    ),
    (
        "header dtype changed on the other rank's file",
        lambda root: edit_header(root, 3, 1, set_dtype("model/up.weight@10,0", "I32")),
        "rank-00001.",
        "tensor model/up.weight@10,0 is stored as I32[10, 12]",
    ),
    (
        "index range pointing into the header",
        lambda root: edit_index(root, 3, 1, into_header("model/down.bias@6")),
        "rank-00001.",
        "rank 1's index says 8-32",
    ),
    (
        "an RNG state the generator rejects",
        lambda root: edit_chunk_bytes(root, 3, 0, "rank-00000/rng/python/internal", python_rng_index_out_of_range),
        "manifest.i000000001.json",
        "saved RNG state is malformed",
    ),
]


def restore_single(root: pathlib.Path) -> tuple[int, dict[str, str]]:
    """Restore ``root`` into the worker's model in this process (one rank, no mesh): the step
    and the digest of every parameter and optimizer state tensor."""
    torch.manual_seed(9)
    model = sharded_job.build("single")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ckpt = spotrun.Checkpointer(
        {"model": model, "optimizer": opt, "scheduler": sched},
        uri=str(root),
        handle_signals=False,
        background_saves=False,
    )
    step = ckpt.restore()
    ckpt.close()
    return step, sharded_job.tensor_digests(model, opt)


@pytest.mark.slow
@pytest.mark.parametrize("edit, file, reason", [e[1:] for e in SHARDED_EDITS], ids=[e[0] for e in SHARDED_EDITS])
def test_an_edited_sharded_step_falls_back_to_the_previous_step_bit_exactly(
    sharded, tmp_path, caplog, capsys, edit, file, reason
):
    source, expected = sharded
    root = pathlib.Path(shutil.copytree(source, tmp_path / "ck"))
    edit(root)
    redigest(root, 3)
    assert_verify_finds(root, 3, file, reason)
    with caplog.at_level(logging.WARNING, logger="spotrun"):
        step, restored = restore_single(root)
    assert step == 2
    [line] = fallback_lines(caplog)
    assert line.startswith("checkpoint step 3 failed verification (rank 0: ") and line.endswith(
        "falling back to step 2"
    )
    assert file in line and reason in line, line
    assert restored == expected
    assert statuses(root, capsys) == {2: "complete", 3: "corrupt"}


@pytest.mark.slow
def test_an_edit_only_one_rank_reads_makes_every_rank_fall_back_together(sharded, tmp_path, capsys):
    """On 2 ranks as FSDP2, rank 0 reads none of rank 1's file; rank 1 finds the edit, and both
    resume step 2."""
    source, expected = sharded
    root = pathlib.Path(shutil.copytree(source, tmp_path / "ck"))
    edit_header(root, 3, 1, set_dtype("model/up.weight@10,0", "I32"))
    redigest(root, 3)
    [result], stderr = run_with_stderr(2, [{"layout": "fsdp", "ckpt": str(root), "steps": 3}], tmp_path / "out.json")
    assert result["restored"] == 2
    assert result["restored_tensors"] == expected
    lines = [line for line in stderr.splitlines() if "failed verification" in line]
    assert len(lines) == 1 and "rank 1: " in lines[0] and "rank 0: " not in lines[0], lines
    assert "tensor model/up.weight@10,0 is stored as I32[10, 12]" in lines[0]
