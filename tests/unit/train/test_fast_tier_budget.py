"""The fast tier's budget (issue 23, section 2): checked once, at the first fast-tier save, against
``memory_budget_bytes`` and the free space of the tier; a tier that does not fit is refused with
a clear error naming the sizes, and the job goes on with storage only. One process, no torchrun."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.storage import LocalStorage
from spotrun.train import fast_tier

STEPS = 6


def train(tmp_path, **options) -> tuple[LocalStorage, LocalStorage]:
    """STEPS steps of a small model; storage every 2 steps, the fast tier every step; returns
    (storage, the tier's root)."""
    storage, memory = LocalStorage(str(tmp_path / "ck"), fsync=False), LocalStorage(str(tmp_path / "mem"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = spotrun.Checkpointer(
        {"model": model, "optimizer": opt},
        storage=storage,
        handle_signals=False,
        interval_steps=2,
        memory_interval_steps=1,
        memory_dir=str(tmp_path / "mem"),
        **options,
    )
    ckpt.restore()
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert ckpt.end_of_step(step) is False
    ckpt.close()
    return storage, memory


def complete(storage: LocalStorage) -> list[int]:
    return [s.step for s in catalog.list_steps(storage) if s.status == catalog.COMPLETE]


def does_not_fit(text: str) -> str:
    [line] = [line for line in text.splitlines() if "the fast tier does not fit" in line]
    return line


def test_a_tier_within_its_budget_is_used(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        storage, memory = train(tmp_path, memory_budget_bytes=2**30)
    # a fast-tier save in flight skips the next due ones: which steps landed depends on timing
    assert 1 <= len(complete(memory)) <= 2
    assert complete(storage) == [2, 4, 6]
    assert "fast tier in" in caplog.text and "(budget 1.0 GiB)" in caplog.text
    assert "does not fit" not in caplog.text and "cannot read the free space" not in caplog.text


def test_a_budget_below_two_steps_is_refused_with_the_sizes_and_storage_saves_go_on(tmp_path, caplog):
    storage, memory = train(tmp_path, memory_budget_bytes=1000)
    line = does_not_fit(caplog.text)
    need = re.search(r"2 steps of this node's ranks take ([\d.]+) KiB, but the budget allows 1000 B", line)
    assert need and float(need.group(1)) > 1000 / 1024, line
    assert "(budget 1000 B, free in" in line and line.endswith("running with storage only")
    assert "cannot read the free space" not in caplog.text  # the tier's root is made at its first save
    assert catalog.list_steps(memory) == []  # nothing was ever written to the tier
    assert complete(storage) == [2, 4, 6]
    assert caplog.text.count("does not fit") == 1  # checked once, not at every due step


def test_a_tier_larger_than_its_free_memory_is_refused_with_the_free_space(tmp_path, caplog, monkeypatch):
    """No budget given: the tier's free space decides (a small ``/dev/shm``, as containers get)."""
    monkeypatch.setattr(fast_tier, "free_bytes", lambda path: 2048)
    storage, memory = train(tmp_path)
    line = does_not_fit(caplog.text)
    assert "but memory allows 2.0 KiB (budget none, free in" in line and line.endswith(
        ": 2.0 KiB); running with storage only"
    )
    assert catalog.list_steps(memory) == []
    assert complete(storage) == [2, 4, 6]


@pytest.mark.parametrize("size_bytes, text", [(0, "0 B"), (1000, "1000 B"), (1536, "1.5 KiB"), (3 * 2**30, "3.0 GiB")])
def test_sizes_in_the_tiers_lines_are_shown_in_fitting_units(size_bytes, text):
    assert fast_tier._size(size_bytes) == text
