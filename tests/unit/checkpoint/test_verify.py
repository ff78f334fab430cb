"""`spotrun verify`: a good checkpoint passes, and every kind of damage is named by step, file
and reason, on local roots and on the moto server.

Checkpoints: a one-process Checkpointer save (format 4; a 1.3 MiB weight, so its file has two
1 MiB checksum blocks, and a complex64 buffer, stored as bytes), an FSDP2 save on 2 ranks with
real torchrun and gloo (format 4, chunks of every tensor on both ranks), and the checked-in
golden checkpoints of formats 1 to 3 (verified where they lie: verify writes nothing).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import spotrun
from spotrun.checkpoint import fencing
from spotrun.checkpoint.verify import steps_to_verify, verify_step
from spotrun.cli import human_size, main
from spotrun.storage import LocalStorage, open_storage
from tests.support.ckpt_files import manifest_path, shard_path
from tests.support.paths import GOLDEN, JOBS, REPO

DATA = GOLDEN
GOLDEN = {
    "v1": (DATA / "golden-v1", 12),
    "v2": (DATA / "golden-v2", 7),
    "v3": (DATA / "golden-v3-sharded" / "checkpoint", 3),
}
WORKER = JOBS / "sharded_job.py"
BLOCK_BYTES = 2**20


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(512, 640)  # weight: 1.25 MiB of float32
        self.register_buffer("phase", torch.randn(4, dtype=torch.complex64))  # no safetensors code


def save_tiny(uri: str, step: int = 1) -> None:
    storage = LocalStorage(uri, fsync=False) if "://" not in uri else open_storage(uri)
    ckpt = spotrun.Checkpointer({"model": Net()}, storage=storage, handle_signals=False)
    ckpt.save(step)
    ckpt.close()


def verify(*args: str, capsys) -> tuple[int, list[str], str]:
    """Run ``spotrun verify ARGS`` in this process: (exit code, stdout lines, stderr)."""
    code = main(["verify", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def listed(root: pathlib.Path, step: int) -> str:
    """``"1.3 MiB, 6 tensors"``: the size of the files and the tensors the step's manifest lists."""
    manifest = json.loads(manifest_path(root, step).read_text())
    return f"{human_size(sum(f['size_bytes'] for f in manifest['files']))}, {len(manifest['tensors'])} tensors"


def tree_state(root: pathlib.Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def flip(path: pathlib.Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("verify") / "tiny"
    save_tiny(str(root))
    return root


@pytest.fixture
def tiny_copy(tiny, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(tiny, tmp_path / "ck"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> pathlib.Path:
    """Step 3 of an FSDP2 job on 2 ranks."""
    base = tmp_path_factory.mktemp("sharded")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    jobs = json.dumps([{"layout": "fsdp", "ckpt": str(base / "fsdp"), "steps": 3}])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            "--jobs",
            jobs,
            "--out",
            str(base / "out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return base / "fsdp"


# --- sound checkpoints pass ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_checkpoints_of_formats_1_to_3_pass_and_are_left_untouched(name, capsys):
    root, step = GOLDEN[name]
    before = tree_state(root)
    code, lines, err = verify(root, capsys=capsys)
    assert (code, err) == (0, "")
    algorithm = "sha256" if name in ("v1", "v2") else "blake3-chunks"
    assert lines == [f"step {step}: ok (1 file, {listed(root, step)}; {algorithm})"]
    assert tree_state(root) == before


def test_a_fresh_format_4_checkpoint_passes_reading_each_byte_once(tiny, capsys):
    before = tree_state(tiny)
    code, lines, _ = verify(tiny, capsys=capsys)
    assert code == 0
    assert lines == [f"step 1: ok (2 files, {listed(tiny, 1)}; blake3-chunks, sha256)"]
    assert tree_state(tiny) == before

    class Counting(LocalStorage):
        read_bytes: dict[str, int] = {}

        def _read_into(self, key, offset, views):
            Counting.read_bytes[key] = Counting.read_bytes.get(key, 0) + sum(len(v) for v in views)
            super()._read_into(key, offset, views)

        def _get(self, key):
            data = super()._get(key)
            Counting.read_bytes[key] = Counting.read_bytes.get(key, 0) + len(data)
            return data

    storage = Counting(str(tiny))
    [info] = steps_to_verify(storage)
    report = verify_step(storage, info)
    assert report.ok and report.verified
    header_bytes = 8 + int.from_bytes(shard_path(tiny, 1).read_bytes()[:8], "little")
    # each file once; a data file's header once more, for the tensor checks
    assert {k: n for k, n in Counting.read_bytes.items() if k.startswith("step-000000001/rank-")} == {
        f"step-000000001/{f.path}": f.size_bytes + (header_bytes if f.path.endswith(".safetensors") else 0)
        for f in info.manifest.files
    }


def test_a_sharded_fsdp2_checkpoint_passes(sharded, capsys):
    code, lines, _ = verify(sharded, "--step", "3", capsys=capsys)
    assert code == 0
    assert lines[0].startswith("step 3: ok (4 files, ") and lines[0].endswith("; blake3-chunks, sha256)")


# --- damage is named: step, file, reason -----------------------------------------------------


def test_a_flipped_data_byte_names_the_file_and_the_block(tiny_copy, capsys):
    shard = shard_path(tiny_copy, 1)
    flip(shard, BLOCK_BYTES + 100)  # inside the weight, in the second 1 MiB block
    code, lines, _ = verify(tiny_copy, "--step", "1", capsys=capsys)
    assert code == 1
    size = shard.stat().st_size
    assert lines[0] == f"step 1: {shard.name}: digest mismatch in bytes {BLOCK_BYTES}-{size} (blake3-chunks)"
    assert lines[1].startswith("step 1: 1 problem (2 files, ")


def test_a_flipped_header_byte_names_the_tensor_missing_from_the_file(tiny_copy, capsys):
    shard = shard_path(tiny_copy, 1)
    flip(shard, shard.read_bytes().index(b'"model/proj.weight"') + 1)  # "model/" -> "lodel/"
    code, lines, _ = verify(tiny_copy, capsys=capsys)
    assert code == 1
    assert lines[:2] == [
        f"step 1: {shard.name}: digest mismatch in bytes 0-{BLOCK_BYTES} (blake3-chunks)",
        f"step 1: {shard.name}: tensor model/proj.weight missing from the file",
    ]


def test_a_header_that_no_longer_parses_is_named(tiny_copy, capsys):
    shard = shard_path(tiny_copy, 1)
    flip(shard, shard.read_bytes().index(b"{"))  # "{" -> "z"
    code, lines, _ = verify(tiny_copy, capsys=capsys)
    assert code == 1
    assert f"step 1: {shard.name}: digest mismatch in bytes 0-{BLOCK_BYTES} (blake3-chunks)" in lines
    assert any(line.startswith(f"step 1: {shard.name}: the safetensors header does not parse") for line in lines)


def test_a_truncated_file_is_named_with_both_sizes(tiny_copy, capsys):
    shard = shard_path(tiny_copy, 1)
    size = shard.stat().st_size
    os.truncate(shard, size - 1000)
    code, lines, _ = verify(tiny_copy, "--step", "1", capsys=capsys)
    assert code == 1
    assert lines[0] == f"step 1: {shard.name}: has {size - 1000} bytes, manifest recorded {size}"


def test_a_missing_file_is_named(tiny_copy, capsys):
    shard = shard_path(tiny_copy, 1)
    size = shard.stat().st_size
    shard.unlink()
    code, lines, _ = verify(tiny_copy, "--step", "1", capsys=capsys)
    assert code == 1
    assert lines[0] == f"step 1: {shard.name}: missing (the manifest records {size} bytes)"


def rewrite_without(shard: pathlib.Path, tensor: str) -> None:
    """Replace a shard by a valid safetensors file of the same tensors but one (the manifest
    unchanged): what a tool that rewrote the file, or a copy of the wrong file, leaves."""
    tensors = load_file(str(shard))
    del tensors[tensor]
    save_file(tensors, str(shard))


@pytest.mark.parametrize("fmt", ["v2", "v3", "v4"])
def test_a_shard_rewritten_without_a_tensor_names_the_missing_tensor(fmt, tiny, tmp_path, capsys):
    root = pathlib.Path(shutil.copytree(tiny if fmt == "v4" else GOLDEN[fmt][0], tmp_path / "ck"))
    step = 1 if fmt == "v4" else GOLDEN[fmt][1]
    shard = shard_path(root, step)
    missing = {"v2": "model/bias", "v3": "model/up.bias", "v4": "model/proj.bias"}[fmt]
    rewrite_without(shard, missing)
    code, lines, _ = verify(root, "--step", step, capsys=capsys)
    assert code == 1
    assert f"step {step}: {shard.name}: tensor {missing} missing from the file" in lines
    assert any(line.startswith(f"step {step}: {shard.name}: has ") for line in lines)


def test_in_a_sharded_checkpoint_a_flipped_byte_and_an_edited_index_are_each_named(sharded, tmp_path, capsys):
    root = pathlib.Path(shutil.copytree(sharded, tmp_path / "ck"))
    shard = next((root / "step-000000003").glob("rank-00001.*.safetensors"))
    flip(shard, shard.stat().st_size - 3)
    index = next((root / "step-000000003").glob("rank-00000.*.index.json"))
    index.write_text(index.read_text().replace('"model/up.weight@0,0"', '"model/up.weight@0,1"'))
    code, lines, _ = verify(root, "--step", "3", capsys=capsys)
    assert code == 1
    assert lines[:-1] == [
        f"step 3: {index.name}: digest mismatch (sha256)",
        f"step 3: {shard.name}: digest mismatch in bytes 0-{shard.stat().st_size} (blake3-chunks)",
    ]


def test_a_chunk_missing_from_its_file_names_the_chunk(sharded, tmp_path, capsys):
    root = pathlib.Path(shutil.copytree(sharded, tmp_path / "ck"))
    shard = next((root / "step-000000003").glob("rank-00001.*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data.replace(b'"model/down.weight@6,0"', b'"model/down.weight@6,9"', 1))
    code, lines, _ = verify(root, "--step", "3", capsys=capsys)
    assert code == 1
    assert f"step 3: {shard.name}: tensor model/down.weight@6,0 missing from the file" in lines


# --- which steps, and what counts as a problem -----------------------------------------------


@pytest.fixture
def three_steps(tmp_path) -> pathlib.Path:
    """Step 1 sound, step 2 with a flipped byte, step 3 incomplete (no manifest)."""
    root = tmp_path / "ck"
    save_tiny(str(root), 1)
    save_tiny(str(root), 2)
    flip(shard_path(root, 2), 5000)
    save_tiny(str(root), 3)
    manifest_path(root, 3).unlink()
    return root


def test_all_reports_each_step_and_fails_only_for_the_corrupt_one(three_steps, capsys):
    code, lines, _ = verify(three_steps, "--all", capsys=capsys)
    assert code == 1
    shard2 = shard_path(three_steps, 2).name
    assert lines[0].startswith("step 1: ok (")
    assert lines[1] == f"step 2: {shard2}: digest mismatch in bytes 0-{BLOCK_BYTES} (blake3-chunks)"
    assert lines[2].startswith("step 2: 1 problem (")
    assert lines[3] == "step 3: incomplete, not verified (no manifest: the save never committed)"
    assert lines[4] == "3 steps: 1 ok, 1 with problems, 1 not verified (incomplete or fenced)"

    code, out, _ = verify(three_steps, "--all", "--json", capsys=capsys)
    report = json.loads("\n".join(out))
    assert code == 1 and report["ok"] is False
    assert [(s["step"], s["verified"], s["ok"]) for s in report["steps"]] == [
        (1, True, True),
        (2, True, False),
        (3, False, True),
    ]
    assert report["steps"][1]["problems"] == [
        {"file": shard2, "reason": f"digest mismatch in bytes 0-{BLOCK_BYTES} (blake3-chunks)"}
    ]


def test_an_incomplete_step_is_no_problem_under_all_but_is_when_named(three_steps, capsys):
    shutil.rmtree(three_steps / "step-000000002")
    code, lines, _ = verify(three_steps, "--all", capsys=capsys)
    assert code == 0 and lines[-1] == "2 steps: 1 ok, 0 with problems, 1 not verified (incomplete or fenced)"
    code, lines, _ = verify(three_steps, "--step", "3", capsys=capsys)
    assert code == 1
    assert lines == ["step 3: incomplete, not a committed checkpoint: no manifest: the save never committed"]


def test_a_fenced_step_is_listed_not_verified_and_no_problem_under_all(tmp_path, capsys):
    save_tiny(str(tmp_path), 1)  # incarnation 0
    fencing.claim(LocalStorage(str(tmp_path), fsync=False), resumed_step=None, run_id="r")  # 1 starts over
    code, lines, _ = verify(tmp_path, "--all", capsys=capsys)
    assert code == 0
    assert lines[0].startswith("step 1: fenced, not verified (")
    code, lines, _ = verify(tmp_path, "--step", "1", capsys=capsys)
    assert code == 1 and lines[0].startswith("step 1: fenced, not a committed checkpoint: ")


def test_by_default_the_newest_complete_step_and_newer_corrupt_ones_are_verified(three_steps, capsys):
    code, lines, _ = verify(three_steps, capsys=capsys)  # step 2: complete by its sizes, corrupt by its digest
    assert code == 1 and len(lines) == 2 and lines[-1].startswith("step 2: 1 problem (")
    shard2 = shard_path(three_steps, 2)
    size = shard2.stat().st_size
    os.truncate(shard2, 100)  # now corrupt by its size: a restart resumes from step 1
    code, lines, _ = verify(three_steps, capsys=capsys)
    assert code == 1
    assert lines[0].startswith("step 1: ok (")
    assert lines[1] == f"step 2: {shard2.name}: has 100 bytes, manifest recorded {size}"
    shutil.rmtree(three_steps / "step-000000002")
    code, lines, _ = verify(three_steps, capsys=capsys)
    assert code == 0 and len(lines) == 1 and lines[0].startswith("step 1: ok (")


def test_spotrun_errors_exit_2_with_one_line(tmp_path, three_steps, capsys):
    done = subprocess.run(
        [sys.executable, "-m", "spotrun", "verify", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"spotrun: error: no such directory: {tmp_path / 'nothing'}\n"
    (tmp_path / "empty").mkdir()
    for args, message in [
        ((three_steps, "--step", "9"), f"no step 9 under {three_steps}"),
        ((tmp_path / "empty",), f"no complete checkpoint under {tmp_path / 'empty'} to verify"),
        (("ftp://host/ck",), None),
    ]:
        code, lines, err = verify(*args, capsys=capsys)
        assert (code, lines) == (2, []), args
        [line] = err.splitlines()
        assert line == f"spotrun: error: {message}" if message else line.startswith("spotrun: error: ")


# --- S3 -------------------------------------------------------------------------------------


def test_on_s3_a_good_checkpoint_passes_and_a_replaced_object_is_named(s3_bucket, capsys):
    uri = f"{s3_bucket.uri}/job"
    save_tiny(uri)
    code, lines, _ = verify(uri, capsys=capsys)
    assert code == 0 and lines[0].startswith("step 1: ok (2 files, ")

    storage = open_storage(uri)
    [info] = steps_to_verify(storage)
    shard = next(f.path for f in info.manifest.files if f.path.endswith(".safetensors"))
    key = f"step-000000001/{shard}"
    data = bytearray(storage.get(key))
    data[BLOCK_BYTES + 7] ^= 0x80
    storage.put(key, bytes(data))
    code, lines, _ = verify(uri, "--all", capsys=capsys)
    assert code == 1
    assert lines[0] == f"step 1: {shard}: digest mismatch in bytes {BLOCK_BYTES}-{len(data)} (blake3-chunks)"

    code, lines, err = verify(f"s3://{s3_bucket.name}-missing/job", capsys=capsys)  # no such bucket
    assert (code, lines) == (2, []) and err.startswith("spotrun: error: ") and len(err.splitlines()) == 1
