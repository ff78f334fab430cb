"""spotrun.state.ddp_buckets in one process (a 1-rank gloo group): the layout DDP reports after
its rebuild, a fresh DDP given a saved layout, and the cases left alone with a reason. The
4-rank resume it exists for: tests/e2e/test_ddp_exact_resume.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from spotrun.state.ddp_buckets import apply_layout, rebuilt_layout


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
