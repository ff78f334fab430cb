"""A torch.compile'd model's checkpoint loads compiled or not (issue 20, script shapes).

``torch.compile(model).state_dict()`` puts ``_orig_mod.`` in every key; spotrun saves a
module's state as if nothing in it were compiled, so a run may turn ``torch.compile`` on or
off between restarts, and a checkpoint written with the prefixed keys (before this) still loads.
"""

from __future__ import annotations

import pytest
import torch

import spotrun
from spotrun.state.stateful import state_of
from spotrun.storage import LocalStorage


def build(compile_whole: bool, compile_block: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if compile_block:
        model[0] = torch.compile(model[0], backend="eager")  # compiling is lazy: nothing runs
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return (torch.compile(model, backend="eager") if compile_whole else model), model, opt


def train_and_save(path, compile_whole: bool, compile_block: bool, old_format: bool = False):
    wrapped, model, opt = build(compile_whole, compile_block)
    # old_format: the keys a compiled model was saved under before spotrun dropped "_orig_mod."
    saved = dict(wrapped.state_dict()) if old_format else wrapped
    ckpt = spotrun.Checkpointer(
        {"model": saved, "optimizer": opt}, storage=LocalStorage(str(path), fsync=False), handle_signals=False
    )
    model(torch.ones(4, 3)).sum().backward()  # the plain module: no compile time
    opt.step()
    ckpt.save(1, reason="final")
    ckpt.close()
    return {k.replace("_orig_mod.", ""): v.clone() for k, v in model.state_dict().items()}, opt


@pytest.mark.parametrize("saved", ["plain", "compiled", "block-compiled", "old-format-compiled"])
@pytest.mark.parametrize("restored", ["plain", "compiled", "block-compiled"])
def test_compiled_model_checkpoint_loads_compiled_or_not(tmp_path, saved, restored):
    """Issue 20 (compile shape): a checkpoint saved from a model compiled whole, compiled in part
    or not at all (or with "_orig_mod." keys, as before) restores into any of the three,
    parameters and Adam state equal."""
    flags = {
        "plain": (False, False),
        "compiled": (True, False),
        "block-compiled": (False, True),
        "old-format-compiled": (True, True, True),
    }
    expected, saved_opt = train_and_save(tmp_path, *flags[saved])
    wrapped, model, opt = build(*flags[restored])
    ckpt = spotrun.Checkpointer(
        {"model": wrapped, "optimizer": opt}, storage=LocalStorage(str(tmp_path), fsync=False), handle_signals=False
    )
    assert ckpt.restore() == 1
    got = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    saved_params = [p for g in saved_opt.param_groups for p in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for old, new in zip(saved_params, params):
        assert torch.equal(opt.state[new]["exp_avg"], saved_opt.state[old]["exp_avg"])


def test_compiled_module_state_is_saved_under_plain_keys():
    """The saved keys of a compiled model are its plain model's (exports see plain names)."""
    wrapped, model, _ = build(True, True)
    assert sorted(state_of(wrapped)) == sorted(k.replace("_orig_mod.", "") for k in model.state_dict())
    assert not any("_orig_mod" in k for k in state_of(wrapped))
