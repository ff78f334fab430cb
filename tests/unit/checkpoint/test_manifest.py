"""Manifest format: golden files from earlier versions still load; bad input is a clear error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.manifest import FORMAT_VERSION, Manifest
from spotrun.errors import ManifestError
from spotrun.storage import LocalStorage
from tests.support.paths import GOLDEN

GOLDEN_V1 = GOLDEN / "golden-v1"


def golden_doc() -> dict:
    return json.loads((GOLDEN_V1 / "step-000000012" / "manifest.json").read_text())


def test_golden_v1_checkpoint_still_loads(tmp_path):
    shutil.copytree(GOLDEN_V1, tmp_path / "ck")
    model = torch.nn.Linear(2, 2)
    extra: dict = {}
    ckpt = spotrun.Checkpointer(
        {"model": model, "extra": extra}, storage=LocalStorage(str(tmp_path / "ck")), handle_signals=False
    )
    assert ckpt.restore() == 12
    assert torch.equal(model.weight, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(model.bias, torch.tensor([0.5, -0.5]))
    assert extra == {"epoch": 2, "betas": (0.9, 0.95), "ids": {0: "a"}}


def test_golden_manifest_round_trips():
    raw = (GOLDEN_V1 / "step-000000012" / "manifest.json").read_bytes()
    manifest = Manifest.from_json(raw)
    assert manifest.step == 12 and manifest.world_size == 1
    assert Manifest.from_json(manifest.to_json()) == manifest


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format_version=FORMAT_VERSION + 1), "upgrade spotrun"),
        (lambda d: d.update(format="something-else"), "not a spotrun checkpoint manifest"),
        (lambda d: d.update(step="12"), "step must be an integer"),
        (lambda d: d.update(world_size=0), "world_size must be an integer >= 1"),
        (lambda d: d["files"][0].update(path="../../etc/passwd"), "escapes the step directory"),
        (lambda d: d["files"][0].update(size_bytes=-1), "size_bytes"),
        (lambda d: d.update(rank_state=[]), "one per rank"),
        (lambda d: d.pop("tensors"), "tensors"),
        (lambda d: d.update(aliases={"a": "nowhere"}), "unknown tensor"),
    ],
)
def test_malformed_manifest_is_refused_with_a_clear_message(mutate, message):
    doc = golden_doc()
    mutate(doc)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(json.dumps(doc).encode(), where="test manifest")


@pytest.mark.parametrize("raw", [b"", b"{not json", b"\xff\xfe", b"[1, 2]", b'{"x": NaN}'])
def test_garbage_manifest_is_refused(raw):
    with pytest.raises(ManifestError):
        Manifest.from_json(raw)


def test_malformed_manifest_marks_step_corrupt_and_is_skipped(tmp_path):
    shutil.copytree(GOLDEN_V1, tmp_path / "ck")
    bad = tmp_path / "ck" / "step-000000020"
    shutil.copytree(tmp_path / "ck" / "step-000000012", bad)
    (bad / "manifest.json").write_text("{truncated")
    storage = LocalStorage(str(tmp_path / "ck"))
    steps = {s.step: s for s in catalog.list_steps(storage)}
    assert steps[20].status == catalog.CORRUPT and "not valid JSON" in steps[20].problem
    assert catalog.newest_complete(storage).step == 12
