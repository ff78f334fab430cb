"""Collective save/load with real torchrun and gloo (2 ranks)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from safetensors import safe_open

from tests.support.ckpt_files import chunk_files, data_files, manifest_path, shard_path
from tests.support.paths import JOBS

WORKER = JOBS / "tiny_dist.py"
pytestmark = pytest.mark.slow


def torchrun(ckpt_dir: pathlib.Path, mode: str) -> list[dict]:
    out_dir = ckpt_dir.parent / f"out-{mode}"
    out_dir.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            str(ckpt_dir),
            mode,
            str(out_dir),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(2)]


def test_a_rank_without_tensors_writes_a_shard_that_opens(tmp_path):
    """Field case C11."""
    ck = tmp_path / "ck"
    torchrun(ck, "save")
    manifest = json.loads(manifest_path(ck, 3).read_text())
    assert [f["rank"] for f in data_files(manifest)] == [0, 1]
    assert [f.startswith("rank-00000.") for f in chunk_files(ck, 3)["w/only"]] == [True]
    with safe_open(str(shard_path(ck, 3, 1)), framework="pt") as f:
        assert list(f.keys()) == []
        assert f.metadata()["rank"] == "1"
    rows = torchrun(ck, "load")
    assert [r["w"] for r in rows] == [[0.0, 1.0, 2.0, 3.0]] * 2
    assert [r["meta"] for r in rows] == [{"epoch": 1}] * 2


def test_a_rank_whose_write_fails_fails_the_save_on_every_rank(tmp_path):
    ck = tmp_path / "ck"
    rows = torchrun(ck, "fail-rank1")
    assert all(r["error"] and "rank(s) [1]" in r["error"] and "injected" in r["error"] for r in rows)
    assert not list((ck / "step-000000004").glob("manifest*"))


def test_5_split_shards_on_two_ranks_load_back_exactly(tmp_path):
    """With small shard limits every rank writes several files (replicated tensors spread
    over the ranks, each rank's own tensors with them) and every rank loads back exactly."""
    ck = tmp_path / "ck"
    rows = torchrun(ck, "split")
    assert [(r["replicated_exact"], r["own_exact"]) for r in rows] == [(True, True)] * 2
    manifest = json.loads(manifest_path(ck, 5).read_text())
    files_per_rank = [sum(f["rank"] == r for f in data_files(manifest)) for r in range(2)]
    assert min(files_per_rank) > 1
    holding = chunk_files(ck, 5)
    assert set(holding) == set(manifest["tensors"])
    assert set().union(*holding.values()) == {f["path"] for f in data_files(manifest)}
