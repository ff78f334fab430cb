"""Issue 26, point 2 (a key layout that spreads ranks over prefixes): where a spread step's files
lie, what its manifest records, and that the catalog, retention, gc, verify and restore follow
the manifest, never a guess; a manifest's layout is untrusted input.

In one process on a local root whose storage says it spreads (a LocalStorage subclass: the
option itself belongs to the object stores, tested on moto in test_spread_keys_s3.py).
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import data_file_key, spread_dir, step_dir, step_of_key
from spotrun.checkpoint.manifest import Manifest, SpreadLayout
from spotrun.checkpoint.verify import steps_to_verify, verify_step
from spotrun.cli import main
from spotrun.errors import ManifestError
from spotrun.storage import LocalStorage


class SpreadLocal(LocalStorage):
    """A local root written with the spread key layout (as an object store with
    ``key_layout="spread"`` writes it)."""

    def __init__(self, root: str) -> None:
        super().__init__(root, fsync=False)
        self.listed: list[str] = []

    def spreads_rank_keys(self, world_size: int) -> bool:
        return True

    def list(self, prefix: str = ""):
        self.listed.append(prefix)
        return super().list(prefix)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 32)


def save(storage, *steps: int, **options) -> torch.nn.Module:
    net = model()
    ckpt = spotrun.Checkpointer({"model": net}, storage=storage, handle_signals=False, **options)
    for step in steps:
        with torch.no_grad():
            net.weight.add_(step)
        ckpt.save(step)
    ckpt.close()
    return net


def manifest_doc(root: pathlib.Path, step: int) -> tuple[pathlib.Path, dict]:
    (path,) = (root / step_dir(step)).glob("manifest.i*.json")
    return path, json.loads(path.read_text())


def files_under(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_ranks_spread_prefix_is_its_last_digits_reversed():
    """Issue 26 point 2: the spread prefix is the writer rank's last digits, reversed, so the
    fastest-changing digit comes first: neighbouring ranks never share a first character, 100
    ranks take 100 prefixes, and rank r + 100 shares rank r's."""
    assert [spread_dir(r, 2) for r in (0, 1, 7, 10, 1234)] == ["00", "10", "70", "01", "43"]
    assert len({spread_dir(r, 2) for r in range(100)}) == 100
    assert all(spread_dir(r, 2)[0] != spread_dir(r + 1, 2)[0] for r in range(1000))
    assert all(spread_dir(r, 2) == spread_dir(r + 100, 2) for r in range(1000))


def test_a_data_files_key_follows_the_layout_and_the_manifest_stays_in_the_step_directory(tmp_path):
    """Issue 26 point 2: format 5 puts each rank's data files and index under its spread prefix,
    the manifest (the commit point the catalog looks for) in the step directory; the manifest
    records the layout. A plain local save keeps format 4, without the field."""
    name = "rank-00001.i000000003.safetensors"
    assert data_file_key(1200, 1, name, None) == f"step-000001200/{name}"
    assert data_file_key(1200, 1, name, SpreadLayout(2)) == f"10/step-000001200/{name}"

    save(SpreadLocal(str(tmp_path / "spread")), 1)
    _, doc = manifest_doc(tmp_path / "spread", 1)
    assert doc["format_version"] == 5 and doc["key_layout"] == {"kind": "spread", "digits": 2}
    listed = files_under(tmp_path / "spread")
    assert [f for f in listed if f.startswith("step-")] == [f"step-000000001/manifest.i{doc['incarnation']:09d}.json"]
    assert sorted(f"00/step-000000001/{f['path']}" for f in doc["files"]) == [f for f in listed if f.startswith("00/")]

    save(LocalStorage(str(tmp_path / "plain"), fsync=False), 1)
    _, doc = manifest_doc(tmp_path / "plain", 1)
    assert doc["format_version"] == 4 and "key_layout" not in doc


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.pop("key_layout"),
        lambda d: d.update(key_layout=None),
        lambda d: d.update(key_layout="spread"),
        lambda d: d.update(key_layout=[2]),
        lambda d: d.update(key_layout={"kind": "spread", "digits": 0}),
        lambda d: d.update(key_layout={"kind": "spread", "digits": 6}),
        lambda d: d.update(key_layout={"kind": "spread", "digits": True}),
        lambda d: d.update(key_layout={"kind": "spread", "digits": "2"}),
        lambda d: d.update(key_layout={"kind": "spread", "digits": 2.0}),
        lambda d: d.update(key_layout={"kind": "../..", "digits": 2}),
        lambda d: d.update(key_layout={"kind": "step", "digits": 2}),
        lambda d: d.update(key_layout={"kind": "spread", "digits": 2, "prefix": "../../etc"}),
        lambda d: d.update(format_version=4),  # a field format 4 does not have
    ],
    ids=[
        "missing",
        "null",
        "a-string",
        "a-list",
        "0-digits",
        "6-digits",
        "bool-digits",
        "string-digits",
        "float-digits",
        "unknown-kind",
        "step-kind",
        "extra-field",
        "in-format-4",
    ],
)
def test_a_manifest_whose_key_layout_is_not_exactly_a_known_one_is_refused(tmp_path, edit):
    """Issue 26 point 2 (security): the key layout says where files are read from, so a manifest
    (untrusted input) may give only ``{"kind": "spread", "digits": 1..5}``, in format 5 alone;
    anything else is a ManifestError, before any key is made from it."""
    save(SpreadLocal(str(tmp_path)), 1)
    _, doc = manifest_doc(tmp_path, 1)
    edit(doc)
    with pytest.raises(ManifestError, match="key_layout"):
        Manifest.from_json(json.dumps(doc).encode())


def test_every_key_a_valid_manifest_can_name_stays_under_the_root():
    """Issue 26 point 2 (security): whatever rank a file record names (any integer >= 0) and
    whatever digits the layout may have, the key is ``<digits>/step-N/<path>``: the spread
    component is made of decimal digits by spotrun, never taken from the manifest."""
    for digits in range(1, 6):
        for rank in (0, 1, 9, 10, 99_999, 10**30 + 7):
            key = data_file_key(3, rank, "rank-00000.i000000001.safetensors", SpreadLayout(digits))
            assert re.fullmatch(r"\d{%d}/step-000000003/rank-00000\.i000000001\.safetensors" % digits, key)
            assert step_of_key(key) == 3


def test_inspecting_a_spread_step_lists_its_prefixes_never_the_whole_root(tmp_path):
    """Issue 26 point 2 (listing cost): ``inspect_step`` lists the step directory and the spread
    prefixes its manifest records, whatever else the root holds; ``list_root`` finds the same
    objects in one listing."""
    storage = SpreadLocal(str(tmp_path))
    save(storage, 1, 2, 3)
    storage.listed.clear()
    info = catalog.inspect_step(storage, 2)
    assert info is not None and info.status == catalog.COMPLETE
    assert "" not in storage.listed
    assert {p for p in storage.listed if "step-" in p} == {"step-000000002/", "00/step-000000002/"}
    listed = {s.step: s for s in catalog.list_steps(storage)}
    assert {o.key for o in listed[2].objects} == {o.key for o in info.objects}
    assert info.object_count == len(info.manifest.files) + 1  # the files and the manifest


def test_a_missing_spread_file_makes_the_step_corrupt_and_restore_falls_back(tmp_path):
    """Issue 26 point 2: a file the manifest names under its spread prefix is looked for there;
    missing, the step is corrupt (``ls``, ``verify``) and a restore falls back to the step before."""
    storage = SpreadLocal(str(tmp_path))
    save(storage, 1, 2)
    _, doc = manifest_doc(tmp_path, 2)
    data = next(f for f in doc["files"] if f["path"].endswith(".safetensors"))
    (tmp_path / "00" / step_dir(2) / data["path"]).unlink()
    info = catalog.inspect_step(storage, 2)
    assert info.status == catalog.CORRUPT and data["path"] in info.problem
    net = model()
    ckpt = spotrun.Checkpointer({"model": net}, storage=storage, handle_signals=False)
    assert ckpt.restore() == 1
    ckpt.close()
    expected = model().weight.detach() + 1
    assert torch.equal(net.weight.detach(), expected)


def test_a_tampered_layout_is_followed_only_under_the_root_and_makes_the_step_corrupt(tmp_path):
    """Issue 26 point 2 (security): a manifest whose layout was changed to another valid one
    (3 digits instead of 2) sends the reader to ``000/step-N/``, under the root, where nothing
    is: the step is corrupt, nothing else is read."""
    storage = SpreadLocal(str(tmp_path))
    save(storage, 1)
    path, doc = manifest_doc(tmp_path, 1)
    doc["key_layout"]["digits"] = 3
    path.write_text(json.dumps(doc))
    info = catalog.inspect_step(storage, 1)
    assert info.status == catalog.CORRUPT and "missing" in info.problem
    assert "000/step-000000001/" in storage.listed


def test_retention_and_gc_delete_a_spread_steps_files_under_every_prefix(tmp_path, capsys):
    """Issue 26 point 2: retention (keep_last) deletes an old spread step's files under its
    spread prefix too; ``spotrun gc`` removes a killed writer's files under spread prefixes (a
    step without a manifest) and nothing of the complete step it keeps."""
    storage = SpreadLocal(str(tmp_path))
    save(storage, 1, 2, 3, keep_last=1)
    assert [s.step for s in catalog.list_steps(storage)] == [3]
    assert not [f for f in files_under(tmp_path) if "step-000000001" in f or "step-000000002" in f]
    leftovers = [
        "00/step-000000004/rank-00000.i000000009.safetensors",
        "73/step-000000004/rank-00037.i000000009.index.json",
    ]
    for key in leftovers:
        storage.put(key, b"a save that never committed")
    steps = {s.step: s for s in catalog.list_steps(storage)}
    assert steps[4].status == catalog.INCOMPLETE and {o.key for o in steps[4].objects} == set(leftovers)
    kept = files_under(tmp_path)
    assert main(["gc", str(tmp_path), "--incomplete-older-than-s", "0"]) == 0
    assert "step 4" in capsys.readouterr().out
    assert files_under(tmp_path) == [f for f in kept if f not in leftovers]
    (report,) = [verify_step(storage, info) for info in steps_to_verify(storage)]
    assert report.ok and report.step == 3
