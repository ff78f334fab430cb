"""Sharded state (FSDP2, HSDP, tensor parallel, FSDP2 + TP) saved as each rank's own chunks and
restored into any other layout, with real torchrun and gloo.

The worker (tests/jobs/sharded_job.py) trains a two-layer model whose sizes (20 and 12)
do not divide by 3, so shards are uneven; every parameter and AdamW state tensor is gathered
to full and hashed right after each restore, and compared with the saving run's final values.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import spotrun
from spotrun.errors import NoCheckpointError
from tests.support.paths import GOLDEN, JOBS, REPO

WORKER = JOBS / "sharded_job.py"
ROOT = REPO
STEPS = 3

sys.path.insert(0, str(WORKER.parent))
import sharded_job  # noqa: E402  (the worker's model and job, also run in this process)


def run_with_stderr(nproc: int, jobs: list[dict], out: pathlib.Path) -> tuple[list[dict], str]:
    """Run the sharded worker's ``jobs`` on ``nproc`` ranks: (its results, torchrun's stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(WORKER),
            "--jobs",
            json.dumps(jobs),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stderr


def run(nproc: int, jobs: list[dict], out: pathlib.Path) -> list[dict]:
    return run_with_stderr(nproc, jobs, out)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[pathlib.Path, dict]]:
    """layout -> (checkpoint root with step 3 saved in that layout, the saving job's result)."""
    base = tmp_path_factory.mktemp("sharded")
    two = ["fsdp", "ddp", "tp"]
    four = ["hsdp", "fsdp_tp"]
    results = run(2, [{"layout": k, "ckpt": str(base / k), "steps": STEPS} for k in two], base / "two.json")
    results += run(4, [{"layout": k, "ckpt": str(base / k), "steps": STEPS} for k in four], base / "four.json")
    return {k: (base / k, r) for k, r in zip(two + four, results)}


def copy_of(saved_root: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    target = tmp_path / saved_root.name
    shutil.copytree(saved_root, target)
    return target


def assert_restored_exactly(result: dict, source: dict) -> None:
    assert result["restored"] == STEPS
    assert result["restored_tensors"] == source["tensors"]  # every parameter and optimizer tensor
    assert len(result["restored_tensors"]) == 16  # 4 parameters, and AdamW's step, exp_avg, exp_avg_sq of each


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "ddp", "tp", "hsdp", "fsdp_tp"])
def test_state_saved_in_any_layout_resumes_bit_identically_in_one_process(saved, tmp_path, layout):
    root, source = saved[layout]
    result = sharded_job.run_job("single", str(copy_of(root, tmp_path)), STEPS, distributed=False)
    assert_restored_exactly(result, source)
    assert result["lr"] == source["lr"]  # the LR scheduler too


@pytest.mark.slow
def test_fsdp2_and_hsdp_state_resumes_bit_identically_on_3_ranks_and_as_tensor_parallel(saved, tmp_path):
    """Row-sharded saves read into FSDP2 on 3 ranks (uneven rows), and into a 3-way tensor-parallel
    layout whose row-wise layer needs a column slice of every saved row."""
    cases = [("fsdp", "fsdp"), ("hsdp", "fsdp"), ("fsdp", "tp")]
    results = run(
        3,
        [
            {"layout": target, "ckpt": str(tmp_path / f"{i}"), "steps": STEPS}
            for i, (source, target) in enumerate(cases)
            if shutil.copytree(saved[source][0], tmp_path / f"{i}")
        ],
        tmp_path / "out.json",
    )
    for result, (source, _target) in zip(results, cases):
        assert_restored_exactly(result, saved[source][1])


@pytest.mark.slow
def test_ddp_state_resumes_as_fsdp2_and_fsdp2_state_as_ddp(saved, tmp_path):
    results = run(
        2,
        [
            {"layout": "fsdp", "ckpt": str(copy_of(saved["ddp"][0], tmp_path)), "steps": STEPS + 2},
            {"layout": "ddp", "ckpt": str(copy_of(saved["fsdp"][0], tmp_path)), "steps": STEPS + 2},
        ],
        tmp_path / "out.json",
    )
    assert_restored_exactly(results[0], saved["ddp"][1])
    assert_restored_exactly(results[1], saved["fsdp"][1])
    # both go on training from the same values on the same batches: the same losses up to the
    # order of the gradient reductions (FSDP2 reduce-scatters, the DDP stand-in all-reduces)
    for step in ("4", "5"):
        assert results[0]["losses"][step] == pytest.approx(results[1]["losses"][step], rel=1e-5)


def chunk_bytes_by_tensor(root: pathlib.Path) -> dict[str, dict[int, int]]:
    """tensor -> {writer rank: bytes of its chunks}, from the rank index files of step 3."""
    found: dict[str, dict[int, int]] = {}
    for index_file in (root / f"step-{STEPS:09d}").glob("rank-*.index.json"):
        index = json.loads(index_file.read_text())
        for key, (_file, begin, end) in index["chunks"].items():
            per_rank = found.setdefault(key.split("@")[0], {})
            per_rank[index["rank"]] = per_rank.get(index["rank"], 0) + end - begin
    return found


@pytest.mark.slow
@pytest.mark.parametrize("layout,ranks", [("fsdp", 2), ("tp", 2), ("hsdp", 4), ("fsdp_tp", 4)])
def test_each_rank_writes_its_own_chunks_and_a_replicated_chunk_once_in_total(saved, layout, ranks):
    """No all-gather: every sharded parameter is written by several ranks, none of them all of it;
    the bytes written per tensor add up to exactly its size (HSDP's replicas and TP's replicated
    biases written once in total)."""
    root, _ = saved[layout]
    manifest = json.loads(next((root / f"step-{STEPS:09d}").glob("manifest.*.json")).read_text())
    written = chunk_bytes_by_tensor(root)
    model = sharded_job.Net()
    for name, param in model.named_parameters():
        key = f"model/{name}"
        size = param.numel() * param.element_size()
        assert sum(written[key].values()) == size  # once in total
        record = manifest["tensors"][key]
        assert record["shape"] == list(param.shape) and record["dtype"] == "float32"
        if layout != "tp" or name != "down.bias":  # TP replicates the row-wise layer's bias
            assert len(written[key]) > 1 and max(written[key].values()) < size  # each rank its own part
    assert manifest["world_size"] == ranks
    assert [m["shape"] for m in manifest["meshes"]] == ([[2, 2]] if ranks == 4 else [[2]])


@pytest.mark.slow
def test_a_corrupt_block_fails_the_resharded_restore_naming_the_file(saved, tmp_path):
    root = copy_of(saved["fsdp"][0], tmp_path)
    shard = next((root / f"step-{STEPS:09d}").glob("rank-00001.*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # inside rank 1's last tensor
    shard.write_bytes(bytes(data))
    model = sharded_job.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = spotrun.Checkpointer({"model": model, "optimizer": opt}, uri=str(root), handle_signals=False)
    with pytest.raises(NoCheckpointError):
        ckpt.restore()
    rejected = list((root / f"step-{STEPS:09d}").glob("rejected-*"))
    assert rejected and shard.name in json.loads(rejected[0].read_text())["reason"]


GOLDEN_V3 = GOLDEN / "golden-v3-sharded"


@pytest.mark.slow
def test_a_format_3_checkpoint_of_replicated_state_resumes_as_fsdp2_on_2_ranks(tmp_path):
    """A checkpoint written by spotrun before format 4 (whole tensors, optimizer state keyed by
    position; tests/golden/golden-v3-sharded, made by commit de8ffc2 in one process) loads into
    an FSDP2 model on 2 ranks: each rank keeps its part of every tensor, and training goes on."""
    root = tmp_path / "golden"
    shutil.copytree(GOLDEN_V3 / "checkpoint", root)
    (result,) = run(2, [{"layout": "fsdp", "ckpt": str(root), "steps": STEPS + 2}], tmp_path / "out.json")
    assert result["restored"] == STEPS
    assert result["restored_tensors"] == json.loads((GOLDEN_V3 / "digests.json").read_text())
    assert sorted(result["losses"]) == ["4", "5"]


@pytest.mark.slow
def test_a_parameter_smaller_than_the_ranks_saves_and_resumes_with_empty_shards(tmp_path):
    """A one-element bias under FSDP2 leaves every rank but one an empty shard of it and of its
    AdamW state: the ranks still agree on the state's structure when saving, and a restore on
    3 ranks gives each its (empty or not) part, and training goes on."""
    root = tmp_path / "ck"
    (saved,) = run(2, [{"layout": "fsdp", "model": "head", "ckpt": str(root), "steps": STEPS}], tmp_path / "a.json")
    (resumed,) = run(
        3, [{"layout": "fsdp", "model": "head", "ckpt": str(root), "steps": STEPS + 2}], tmp_path / "b.json"
    )
    assert resumed["restored"] == STEPS
    assert resumed["restored_tensors"] == saved["tensors"] and len(saved["tensors"]) == 24
    assert sorted(resumed["losses"]) == ["4", "5"]
