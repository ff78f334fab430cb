"""The scale model (issue 26, point 1): spotrun's save and restore plans for 1,024 and 8,192
simulated ranks, planned by the product's own code on meta tensors (tests/support/scale_model,
``benchmarks/scale_plan.py``), checked against bounds derived from the job, not from the plans.

The bounds (tests/support/scale_model/bounds.py; docs/design/scale.md, "The bounds"), for R ranks,
T tensors (AdamW: T/4 parameters, each with two moments and a plain ``step`` tensor), S bytes of
state, a replica count P (HSDP's replicate dimension; 1 for FSDP, R for DDP):

- manifest_bytes <= 2 KiB x R + 1 KiB x T + 1 MiB: a rank adds two file records, its RNG and
  numerics skeleton and its RNG tensors' records (about 1.3 KiB); a tensor adds a record with a
  grid and its writers as a progression, never a chunk per rank. And <= 10 MB for 70B on 1,024
  FSDP ranks (the design contract).
- index_bytes_per_rank_max <= 256 B x (T + 8) + 67 B x (S x P / R in MiB) + 1 KiB: an entry per
  chunk the rank writes, a 64-hex digest per 1 MiB block of its files.
- save_requests <= 3 x (2R + 1) + S / 16 MiB: each of a rank's two objects (shard file, index) and
  the manifest costs at most a create, a complete and one request per 16 MiB part.
- restore_get_requests <= R x (1 + 5W + S x P / R / 8 MiB), W = min(R, 1 + P + T/4) the writers a
  restoring rank reads from (itself, its replicas, the owners of the replicated step tensors): the
  manifest, per writer its index, a file's two header reads and the partial read units at the ends
  of what it reads there, then whole 8 MiB units.
- busiest_prefix_request_share <= 1: today every key of a step lies under ``step-N/`` (one prefix);
  the spread key layout of issue 26 point 2 tightens it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from spotrun.checkpoint.chunks import ChunkLayout
from spotrun.checkpoint.layout import shard_part_name
from spotrun.storage.s3_config import S3Options
from tests.support.paths import REPO
from tests.support.scale_model import dcp_side, store
from tests.support.scale_model.bounds import MANIFEST_CONTRACT_BYTES, bounds, misses
from tests.support.scale_model.model import ScaleConfig, run
from tests.support.scale_model.restore_side import RankReads, RestorePlanner, restore_requests
from tests.support.scale_model.save_side import INCARNATION, SavePlanner
from tests.support.scale_model.shapes import shape_for
from tests.support.scale_model.state import Layout, StateBuilder

MIB = 2**20
#: A small transformer (two layers, narrow), for planning every rank through the product's code.
SMALL = {"layers": 2, "hidden": 512, "ffn": 1792, "vocab": 1000, "heads": 8, "kv_heads": 2}


@pytest.mark.parametrize(
    "ranks,layout,layers",
    [(1024, "fsdp", None), (8192, "fsdp", 8), (1024, "hsdp:16x64", 8), (8192, "hsdp:128x64", 8)],
)
def test_at_1024_and_8192_ranks_the_plans_stay_within_their_bounds(ranks, layout, layers):
    """The manifest, the index files, the requests of a save and of a restore and the busiest
    prefix's share, for 70B's shape (all 80 layers at 1,024 FSDP ranks, the design contract's
    case; 8 of them elsewhere, to keep the test short), stay within the bounds of the module
    docstring. Issue 26, point 1."""
    result = run(
        ScaleConfig(ranks=ranks, layout=layout, layers=layers, s3=True, dcp=False, check_ranks=2, restore_sample=4)
    )
    assert misses(result) == [], bounds(result)
    assert result["busiest_prefix_request_share"] == {"save": 1.0, "restore": 1.0}  # one prefix: step-N/
    if layers is None:
        assert result["manifest_bytes"] < MANIFEST_CONTRACT_BYTES
    # every rank writes a shard file and an index; rank 0 the manifest
    assert result["save_objects"] == 2 * ranks + 1


def test_the_bounds_fail_on_worse_plans(monkeypatch):
    """A manifest that lists every chunk, uploads in S3's smallest parts, and a restore in which
    every rank reads every rank's index and headers each break their bound. Issue 26, point 1."""
    config = ScaleConfig(ranks=1024, layout="fsdp", layers=8, s3=True, dcp=False, check_ranks=1, restore_sample=4)
    assert misses(run(config)) == []

    save_only = dataclasses.replace(config, restore=False)
    with monkeypatch.context() as patch:
        patch.setattr(
            ChunkLayout,
            "to_json",
            lambda self: {"chunks": [[list(c.offsets), list(c.lengths), c.writer] for c in self.chunks()]},
        )
        worse = run(save_only)
    assert [m.split()[0] for m in misses(worse)] == ["manifest_bytes"]

    with monkeypatch.context() as patch:
        patch.setattr(store, "S3Options", lambda: S3Options(part_size_bytes=5 * MIB, multipart_threshold_bytes=5 * MIB))
        worse = run(save_only)
    assert [m.split()[0] for m in misses(worse)] == ["save_requests"]

    with monkeypatch.context() as patch:
        everyone = set(range(config.ranks))
        patch.setattr(RankReads, "writers", property(lambda self: everyone))
        every_file = {(w, shard_part_name(w, INCARNATION, 0)) for w in everyone}
        patch.setattr(RankReads, "files", property(lambda self: every_file))
        worse = run(config)
    assert [m.split()[0] for m in misses(worse)] == ["restore_get_requests"]


@pytest.mark.parametrize("layout", ["fsdp", "hsdp:4x6", "fsdp+tp:4", "ddp"])
def test_the_ranks_of_a_class_plan_exactly_as_the_product_plans_each_of_them(layout):
    """Every rank of a 24-rank job, planned from its own meta DTensors by ``plan_writes`` as
    ``prepare_save`` plans it, writes the chunks the scale model derives for it, into files of
    the sizes, places and index size of its class; and a restore planned by classes counts the
    GETs and bytes of planning every restoring rank. Issue 26, point 1."""
    builder = StateBuilder(shape_for(8e9, **SMALL), Layout.parse(layout, 24), "fp32")
    saved = SavePlanner(builder, store.Store("s3"), 1000)
    classes = saved.classes()
    class_of = {rank: c for c in classes for rank in c.ranks}
    for rank in range(24):
        saved.check_rank(rank, class_of[rank])
    manifest, _, _ = saved.manifest(classes)
    restorer = RestorePlanner(saved, classes, manifest, builder)
    by_class, by_rank = restorer.plan(sample=24), restorer.plan(ranks=list(range(24)))
    assert by_class.method in ("classes", "every rank")
    counted = [restore_requests(saved.store, plan, saved, classes, len(manifest)) for plan in (by_class, by_rank)]
    assert counted[0][0] == counted[1][0]
    assert sum(c * b for c, b in counted[0][2]) == sum(c * b for c, b in counted[1][2])


def test_dcp_metadata_extrapolated_from_a_few_tensors_is_within_two_percent(monkeypatch):
    """DCP's ``.metadata`` built whole, and extrapolated from one tensor of each kind as the model
    does past its chunk limit, agree within 2 %. Issue 26, point 1."""
    builder = StateBuilder(shape_for(8e9, **{**SMALL, "layers": 8}), Layout.parse("fsdp", 256), "fp32")
    saved = SavePlanner(builder, store.Store("s3"), 1000)
    exact = dcp_side.dcp_save(saved)
    assert exact.how == "exact"
    monkeypatch.setattr(dcp_side, "EXACT_CHUNKS", exact.chunks // 6)
    estimate = dcp_side.dcp_save(saved)
    assert estimate.how.startswith("extrapolated")
    assert abs(estimate.metadata_bytes - exact.metadata_bytes) < 0.02 * exact.metadata_bytes


def test_the_command_prints_one_json_object_with_the_issues_figures():
    """``benchmarks/scale_plan.py --json`` prints one JSON object holding the figures issue 26
    names. Issue 26, point 1."""
    small = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    command = [sys.executable, str(REPO / "benchmarks" / "scale_plan.py"), "--ranks", "48", "--layout", "hsdp:4x12"]
    done = subprocess.run([*command, *small, "--s3", "--json"], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout)
    for key in ("manifest_bytes", "index_bytes_per_rank_max", "save_requests", "restore_get_requests"):
        assert key in result
    assert set(result["busiest_prefix_request_share"]) == set(result["planning_s_per_rank"]) == {"save", "restore"}
    assert result["dcp"]["metadata_bytes"] > 0


def test_the_simulated_placements_are_those_fully_shard_and_tensor_parallelism_make():
    """The placements the model gives FSDP2, HSDP and FSDP2 + TP are what torch's ``fully_shard``
    (over ``parallelize_module`` for TP) makes on the fake process group. Issue 26, point 1."""
    script = f"""
import sys; sys.path.insert(0, {str(REPO)!r})
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from tests.support.scale_model.state import Layout
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
def model():
    with torch.device("meta"):
        m = torch.nn.Module()
        m.wq, m.wo = torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 16, bias=False)
        m.norm = torch.nn.RMSNorm(16)
    return m
styles = {{
    "wq": ("dim0", ColwiseParallel()), "wo": ("dim1", RowwiseParallel()), "norm": ("replicate", SequenceParallel())
}}
for text, names in (("fsdp", ("dp",)), ("hsdp:2x4", ("replicate", "shard")), ("fsdp+tp:2", ("dp", "tp"))):
    layout = Layout.parse(text, 8)
    mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=names)
    m = model()
    if layout.kind == "fsdp+tp":
        parallelize_module(m, mesh["tp"], {{n: s for n, (_, s) in styles.items()}})
        fully_shard(m, mesh=mesh["dp"])
    else:
        fully_shard(m, mesh=mesh)
    for name, (tp, _) in styles.items():
        got = tuple(getattr(m, name).weight.placements)
        assert got == layout.placements(tp), (text, name, got, layout.placements(tp))
print("same")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "same", done.stderr[-2000:]
