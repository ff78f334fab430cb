"""Progress bars of the library's transfers (a synchronous save's writes, a restore's reads):
on local rank 0 of a terminal only (forced here with SPOTRUN_PROGRESS=1, and with no delay:
the bar of a real transfer appears once it has run for spotrun.tools.progress.DEFAULT_DELAY_S)."""

from __future__ import annotations

import re

import pytest
import torch

from spotrun import Checkpointer
from spotrun.tools import progress


def save_and_restore(root) -> None:
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(256, 256)}  # 257 KiB
    ckpt = Checkpointer(state, uri=str(root), handle_signals=False, background_saves=False)
    ckpt.save(1)
    ckpt.close()
    again = Checkpointer(state, uri=str(root), handle_signals=False)
    assert again.restore() == 1
    again.close()


@pytest.fixture
def no_delay(monkeypatch):
    monkeypatch.setattr(progress, "DEFAULT_DELAY_S", 0.0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_save_and_restore_show_a_byte_bar_on_a_terminal(tmp_path, monkeypatch, capsys, no_delay):
    monkeypatch.setenv("SPOTRUN_PROGRESS", "1")  # as on a terminal
    save_and_restore(tmp_path)
    err = capsys.readouterr().err
    for transfer in ("save step 1", "restore step 1"):  # a bar over the bytes of the transfer (~270 KiB)
        assert re.search(rf"{transfer}: +0%\|.*\| 0\.00/2\d\dk \[", err), err


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path, monkeypatch, capsys, no_delay):
    monkeypatch.delenv("SPOTRUN_PROGRESS", raising=False)
    save_and_restore(tmp_path)
    err = capsys.readouterr().err
    assert "save step" not in err and "restore step" not in err


def test_no_bar_on_local_ranks_other_than_0(tmp_path, monkeypatch, capsys, no_delay):
    monkeypatch.setenv("SPOTRUN_PROGRESS", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # its ranks share the node's terminal: rank 0 alone shows one
    save_and_restore(tmp_path)
    err = capsys.readouterr().err
    assert "save step" not in err and "restore step" not in err
