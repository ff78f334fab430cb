"""Field cases C01, C02, C03: exact resume of data order, RNG and LR schedule.

Each test runs a training loop uninterrupted, then again with a preemption (a save,
after which every object is thrown away), resumes into freshly built objects, and
compares what a user would look at: sample ids, losses, learning rates.
"""

from __future__ import annotations

import pytest
import torch

import spotrun
from spotrun.storage import LocalStorage


class Ids(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])  # shape (1,): the sample id as a feature


def make_checkpointer(path, state) -> spotrun.Checkpointer:
    return spotrun.Checkpointer(state, storage=LocalStorage(str(path), fsync=False), handle_signals=False)


# --- C01 -------------------------------------------------------------------------------------------


def c01_run(path, total_steps: int, stop_after: int | None) -> dict[int, list[int]]:
    loader = spotrun.ResumableDataLoader(Ids(10), batch_size=2, shuffle=True, seed=1234)
    ckpt = make_checkpointer(path, {"data": loader})
    step = ckpt.restore()
    ids: dict[int, list[int]] = {}
    while step < total_steps:
        for batch in loader:
            step += 1
            ids[step] = [int(x) for x in batch[:, 0].tolist()]
            if step == stop_after:
                ckpt.save(step, reason="emergency")
                return ids
            if step >= total_steps:
                break
    return ids


def test_dataloader_order_resumes_exactly_after_epoch_0(tmp_path):
    """Field case C01."""
    reference = c01_run(tmp_path / "a", 15, None)
    first = c01_run(tmp_path / "b", 15, stop_after=7)
    resumed = c01_run(tmp_path / "b", 15, None)
    assert sorted(first) == list(range(1, 8)) and sorted(resumed) == list(range(8, 16))
    assert {s: resumed[s] for s in range(8, 16)} == {s: reference[s] for s in range(8, 16)}
    combined = {**first, **resumed}
    for epoch in (1, 2):
        seen = [i for s in range(epoch * 5 + 1, epoch * 5 + 6) for i in combined[s]]
        assert sorted(seen) == list(range(10)), f"epoch {epoch} saw {seen}"
    assert [combined[s] for s in range(1, 6)] != [combined[s] for s in range(6, 11)]


# --- C02 -------------------------------------------------------------------------------------------


def c02_run(path, stop_after: int | None, total_steps: int = 12) -> dict[int, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = spotrun.ResumableDataLoader(Ids(8), batch_size=2, shuffle=True, seed=7)  # 4 steps per epoch
    ckpt = make_checkpointer(path, {"model": model, "optimizer": opt, "data": loader})
    torch.manual_seed(999)  # a restart seeds differently: the checkpoint must bring the RNG back
    step = ckpt.restore()
    if step == 0:
        torch.manual_seed(1)
    losses: dict[int, float] = {}
    while step < total_steps:
        for batch in loader:
            loss = ((model(batch) - batch) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            losses[step] = loss.item()
            if step == stop_after:
                ckpt.save(step, reason="emergency")
                return losses
            if step >= total_steps:
                break
    return losses


@pytest.mark.parametrize("preempt_after", [4, 3], ids=["epoch-boundary", "mid-epoch"])
def test_rng_resumes_exactly_at_an_epoch_boundary_and_mid_epoch(tmp_path, preempt_after):
    """Field case C02."""
    reference = c02_run(tmp_path / "ref", None)
    c02_run(tmp_path / "run", preempt_after)
    resumed = c02_run(tmp_path / "run", None)
    following = range(preempt_after + 1, preempt_after + 5)
    assert [resumed[s] for s in following] == [reference[s] for s in following]
    assert resumed == {s: reference[s] for s in resumed}  # bit-identical to the end


# --- C03 -------------------------------------------------------------------------------------------


def c03_run(path, stop_after: int | None) -> dict[int, float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=100.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4], gamma=0.1)
    loader = spotrun.ResumableDataLoader(Ids(4), batch_size=2, shuffle=True, seed=3)  # 2 steps per epoch
    ckpt = make_checkpointer(path, {"model": model, "optimizer": opt, "scheduler": sched, "data": loader})
    step = ckpt.restore()
    lrs: dict[int, float] = {}
    for _epoch in range(loader.epoch, 6):
        for batch in loader:
            lrs[step + 1] = opt.param_groups[0]["lr"]
            loss = (model(batch) * 0.0).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == stop_after:
                ckpt.save(step, reason="emergency")
                return lrs
        sched.step()  # per epoch
    return lrs


@pytest.mark.parametrize("preempt_after", [4, 6, 7], ids=["after-epoch-1", "after-epoch-2", "mid-epoch-3"])
def test_lr_schedule_resumes_exactly(tmp_path, preempt_after):
    """Field case C03."""
    expected = [100.0] * 8 + [10.0] * 4
    reference = c03_run(tmp_path / "ref", None)
    assert [reference[s] for s in range(1, 13)] == pytest.approx(expected)
    first = c03_run(tmp_path / "run", preempt_after)
    resumed = c03_run(tmp_path / "run", None)
    assert sorted({**first, **resumed}) == list(range(1, 13))
    combined = {**first, **resumed}
    assert [combined[s] for s in range(1, 13)] == pytest.approx(expected)
