"""The Checkpointer's settings: ``spotrun.Checkpointer(...)`` takes them as before and keeps them as
one checked, documented :class:`CheckpointerOptions`."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math

import pytest
import torch

import spotrun
from spotrun.errors import ConfigError
from spotrun.storage import LocalStorage
from spotrun.train import options as options_module
from spotrun.train.options import CheckpointerOptions

#: The Checkpointer's arguments that are objects, not settings.
OBJECT_ARGUMENTS = ["state", "rank_state", "storage"]


def test_checkpointer_arguments_are_the_objects_and_the_options_with_their_defaults():
    """The signature ``Checkpointer.__init__`` builds the options from (by name) and each option's
    field: the same names and defaults, so neither can drift from the other."""
    parameters = dict(inspect.signature(spotrun.Checkpointer).parameters)
    objects = [name for name in parameters if name in OBJECT_ARGUMENTS]
    assert sorted(objects) == sorted(OBJECT_ARGUMENTS)
    settings = {name: p.default for name, p in parameters.items() if name not in OBJECT_ARGUMENTS}
    assert settings == {f.name: f.default for f in dataclasses.fields(CheckpointerOptions)}


def test_every_option_has_one_line_under_it():
    tree = ast.parse(inspect.getsource(options_module))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointerOptions").body
    for field_node, following in zip(body, body[1:]):
        if isinstance(field_node, ast.AnnAssign):
            name = field_node.target.id
            assert isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant), name
            assert "\n" not in following.value.value.strip(), name


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"interval_steps": -1}, "interval_steps must be >= 0 and check_interval_steps >= 1"),
        ({"check_interval_steps": 0}, "interval_steps must be >= 0 and check_interval_steps >= 1"),
        ({"save_timeout_s": 0}, "save_timeout_s must be > 0, got 0"),
        ({"save_timeout_s": math.nan}, "save_timeout_s must be > 0, got nan"),
        ({"on_save_in_flight": "queue"}, "on_save_in_flight must be one of \\('wait', 'skip'\\), got 'queue'"),
    ],
)
def test_bad_settings_are_refused_by_the_options_and_the_checkpointer_alike(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        CheckpointerOptions(**settings)
    with pytest.raises(ConfigError, match=message):
        spotrun.Checkpointer(
            {"w": torch.zeros(2)}, storage=LocalStorage(str(tmp_path)), handle_signals=False, **settings
        )


def test_the_settings_stay_attributes_and_setting_one_checks_it(tmp_path):
    ckpt = spotrun.Checkpointer(
        {"w": torch.zeros(2)},
        storage=LocalStorage(str(tmp_path)),
        handle_signals=False,
        interval_steps=5,
        on_save_in_flight="skip",
    )
    try:
        assert ckpt.options == CheckpointerOptions(interval_steps=5, on_save_in_flight="skip", handle_signals=False)
        assert (ckpt.interval_steps, ckpt.on_save_in_flight) == (5, "skip")
        ckpt.interval_steps = 7
        assert ckpt.options.interval_steps == 7 and ckpt.interval_steps == 7
        with pytest.raises(ConfigError, match="on_save_in_flight must be one of"):
            ckpt.on_save_in_flight = "queue"
        assert ckpt.on_save_in_flight == "skip"
        with pytest.raises(dataclasses.FrozenInstanceError):
            ckpt.options.interval_steps = 3  # type: ignore[misc]
        ckpt.background_saves = False  # the saves follow: this step's save is synchronous
        assert ckpt.end_of_step(7) is False
        assert ckpt.save_in_flight is None and ckpt.last_saved_step == 7
    finally:
        ckpt.close()
