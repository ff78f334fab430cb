"""spotrun.state.ddp_buckets in one process (a 1-rank gloo group): the layout DDP reports after
its rebuild, a fresh DDP given a saved layout, and the cases left alone with a reason. The
4-rank resume it exists for: tests/e2e/test_ddp_exact_resume.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from spotrun.state import ddp_buckets
from spotrun.state.ddp_buckets import (
    DDP_BUCKETS_STATE_NAME,
    DDPBucketsState,
    apply_layout,
    decode_layout,
    encode_layout,
    rebuilt_layout,
)
from spotrun.train.apply import apply_loaded


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))


def reducer_layout(ddp: DistributedDataParallel) -> list[list[int]]:
    parameters, _ = ddp._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(parameters)}
    return [[index[id(p)] for p in bucket.parameters()] for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def step(ddp: DistributedDataParallel) -> None:
    ddp(torch.randn(4, 8)).sum().backward()


def test_a_fresh_ddp_takes_the_saved_layout_and_keeps_training(group):
    fresh = DistributedDataParallel(mlp())
    assert reducer_layout(fresh) == [[0, 1, 2, 3, 4, 5]]  # DDP's initial layout
    layout = [[5, 4], [3, 2, 1, 0]]
    assert apply_layout(fresh, layout) is None
    assert reducer_layout(fresh) == layout
    for _ in range(3):  # its hooks are the new reducer's only: the steps reduce once each
        step(fresh)
    assert all(p.grad is not None for p in fresh.parameters())


def test_rebuilt_layout_reads_what_ddp_reports_after_its_rebuild(group):
    ddp = DistributedDataParallel(mlp())
    assert rebuilt_layout(ddp) is None  # not rebuilt yet
    for _ in range(3):
        step(ddp)
    reported = rebuilt_layout(ddp)
    assert reported is not None
    assert sorted(i for bucket in reported for i in bucket) == list(range(6))
    assert reducer_layout(ddp) == reported


@pytest.mark.parametrize(
    "layout, why",
    [
        ([[0, 1, 2]], "does not fit its 6 parameters"),
        ([[0, 1, 2, 3, 4, 4]], "does not fit its 6 parameters"),
        ([[0, 1, 2, 3, 4, 5], []], "does not fit its 6 parameters"),
    ],
)
def test_a_layout_that_does_not_fit_leaves_ddp_alone(group, layout, why):
    ddp = DistributedDataParallel(mlp())
    assert why in apply_layout(ddp, layout)
    assert reducer_layout(ddp) == [[0, 1, 2, 3, 4, 5]]


def test_a_ddp_with_a_communication_hook_is_left_alone_with_the_reason(group):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = DistributedDataParallel(mlp())
    ddp.register_comm_hook(None, allreduce_hook)
    assert apply_layout(ddp, [[5, 4, 3, 2, 1, 0]]) == "it has a communication hook"
    assert reducer_layout(ddp) == [[0, 1, 2, 3, 4, 5]]


@pytest.fixture
def three_ranks(monkeypatch):
    """spotrun's view of a 3-rank job (DDP runs on the 1-rank group): where buckets matter."""
    monkeypatch.setattr(ddp_buckets.dist, "is_distributed", lambda: True)
    monkeypatch.setattr(ddp_buckets.dist, "world_size", lambda: 3)
    monkeypatch.setattr(ddp_buckets.dist, "rank", lambda: 0)


def test_the_state_saves_the_rebuilt_layout_and_restores_it_into_a_fresh_ddp(group, three_ranks):
    model = mlp()
    ddp = DistributedDataParallel(model)
    saving = DDPBucketsState({"model": model})
    for _ in range(3):
        step(ddp)
    saved = saving.state_dict()
    assert decode_layout(saved["layouts"]["model"], 6) == reducer_layout(ddp)
    fresh_model = mlp()
    fresh = DistributedDataParallel(fresh_model)
    restoring = DDPBucketsState({"model": fresh_model})
    restoring.load_state_dict({"layouts": {"model": encode_layout([[5, 4], [3, 2, 1, 0]])}})
    assert reducer_layout(fresh) == [[5, 4], [3, 2, 1, 0]]
    assert restoring.state_dict() == {"layouts": {"model": "5-4, 3-0"}}  # saved again before DDP reports it


def test_a_layout_for_a_module_no_ddp_wraps_now_is_named_in_a_warning(group, three_ranks, caplog):
    """Found by a new user's trial: a DDP made after the restore resumed inexactly in silence."""
    model = mlp()
    DDPBucketsState({"model": model}).load_state_dict({"layouts": {"model": "5-0"}})
    assert "state 'model' are not restored (no DistributedDataParallel wraps it now" in caplog.text
    wrapped = DistributedDataParallel(model)
    DDPBucketsState({"model": model}).load_state_dict({"layouts": {"model": ["5-0"]}})
    assert "the saved layout is a list, not text" in caplog.text
    assert reducer_layout(wrapped) == [[0, 1, 2, 3, 4, 5]]


def test_a_ddp_around_a_parent_of_the_state_modules_is_named_in_a_warning(group, three_ranks, caplog):
    """Found by a new user's trial: state {"enc", "dec"} under DDP(Sequential(enc, dec)) saved no
    layout and said nothing."""
    enc, dec = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)
    wrapper = DistributedDataParallel(torch.nn.Sequential(enc, dec))
    assert DDPBucketsState({"enc": enc, "dec": dec}).state_dict() == {"layouts": {}}
    assert wrapper.module[0] is enc
    assert "wraps a module that holds state ['dec', 'enc'] but is not itself a state entry" in caplog.text


def test_every_rank_restores_rank_0s_layout_whatever_its_own_says():
    """Found by a new user's trial: a hand-edited manifest whose ranks held different layouts
    restored, then aborted the job at its first backward (gloo: "Received data size doesn't
    match"), and so every restart. Each rank now takes rank 0's from the manifest."""
    got = {}

    class Recorder:
        def load_state_dict(self, state):
            got["state"] = state

    rank_0 = {"layouts": {"model": "5-0"}}
    loaded = SimpleNamespace(
        manifest=SimpleNamespace(step=4, world_size=1, rank_state=[{DDP_BUCKETS_STATE_NAME: rank_0}]),
        replicated={},
        rank_local={DDP_BUCKETS_STATE_NAME: {"layouts": {"model": "0-3 5 4"}}},  # this rank's own, edited
    )
    apply_loaded(loaded, {}, {DDP_BUCKETS_STATE_NAME: Recorder()})
    assert got["state"] == rank_0
    got.clear()
    loaded.manifest.rank_state = [{}]  # written before spotrun saved layouts: nothing to load
    apply_loaded(loaded, {}, {DDP_BUCKETS_STATE_NAME: Recorder()})
    assert got == {}
