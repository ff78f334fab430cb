"""``spotrun export --format hf`` (issue 11, item 3): a checkpoint's model weights as Hugging
Face sharded safetensors, loaded back with ``huggingface_hub``'s loader and with ``safetensors``
alone, compared bit for bit with the state the checkpoint holds.

The example trainer's checkpoint is the shared reference run (conftest.py: ``spotrun run`` of
``torchrun --nproc-per-node 2 -m spotrun.examples.train_gpt``, DDP, 30 steps); the sharded one
comes from tests/jobs/sharded_job.py (FSDP2 and tensor parallel on 2 ranks, uneven shards),
whose full tensors (``full_tensor()`` in the job itself) are the expected values.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import huggingface_hub
import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.manifest import Manifest, TensorRecord
from spotrun.checkpoint.restore import load_committed
from spotrun.cli import main
from spotrun.examples.gpt import GPT, GPTConfig
from spotrun.examples.train_gpt import parse_args
from spotrun.export.plan import parse_size, plan_export
from spotrun.storage import open_storage
from tests.support.paths import GOLDEN, JOBS, REPO
from tests.support.trainrun import REFERENCE_STEPS, TRAIN_ARGS

ROOT = REPO
WORKERS = JOBS
sys.path.insert(0, str(WORKERS))
import sharded_job  # noqa: E402  (its digest of a full tensor)


def spotrun_export(*args: object) -> subprocess.CompletedProcess:
    """``spotrun export ARGS...`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "spotrun", "export", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def fresh_gpt() -> GPT:
    """A new GPT of the reference run's architecture (its own random weights)."""
    args = parse_args(["--steps", str(REFERENCE_STEPS), *TRAIN_ARGS])
    return GPT(GPTConfig(block_size=args.block_size, width=args.width, depth=args.depth, heads=args.heads))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and -0.0 count)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8)
        )
    )


def tensors_in(directory: pathlib.Path) -> dict[str, tuple[str, torch.Tensor]]:
    """key -> (the file holding it, its tensor) over every .safetensors file, each key once."""
    held: dict[str, tuple[str, torch.Tensor]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for key, tensor in safetensors.torch.load_file(path).items():
            assert key not in held, f"{key} is in {held[key][0]} and {path.name}"
            held[key] = (path.name, tensor)
    return held


def test_the_example_trainers_export_loads_bit_identically_with_huggingface_hub(reference, tmp_path):
    """The example trainer's checkpoint, exported, loads with huggingface_hub and safetensors
    bit-identically."""
    _, saved, checkpoint = reference
    out = tmp_path / "hf"
    proc = spotrun_export(checkpoint, "--format", "hf", out, "--max-shard-size", "40KB")  # the newest step
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"exported step {REFERENCE_STEPS}, state 'model': ")

    model = fresh_gpt()
    huggingface_hub.load_torch_model(model, out, strict=True)  # every key of the model, no other
    for key, value in model.state_dict().items():
        assert same_bits(value, saved[f"model/{key}"]), key
    assert model.head.weight is model.tok_emb.weight  # the tie survives loading

    index = json.loads((out / "model.safetensors.index.json").read_text())
    held = tensors_in(out)
    files = sorted(p.name for p in out.iterdir())
    assert len(files) >= 4 and files == sorted({*index["weight_map"].values(), "model.safetensors.index.json"})
    assert index["weight_map"] == {key: name for key, (name, _) in held.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in held.values())
    for name in index["weight_map"].values():
        with safe_open(out / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}  # what transformers and huggingface_hub require

    with_safetensors = fresh_gpt()  # safetensors alone: its files into the model's own load_state_dict
    with_safetensors.load_state_dict({key: t for key, (_, t) in held.items()}, strict=True)
    assert all(same_bits(v, saved[f"model/{k}"]) for k, v in with_safetensors.state_dict().items())


def test_drop_tied_writes_the_shared_weight_once_for_safetensors_load_model(reference, tmp_path):
    _, saved, checkpoint = reference
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), "--step", str(REFERENCE_STEPS), str(out), "--drop-tied"]) == 0
    only = "model-00001-of-00001.safetensors"
    assert sorted(os.listdir(out)) == [only, "model.safetensors.index.json"]  # one file, still with its index
    with safe_open(out / only, "pt") as f:
        assert "head.weight" not in f.keys()
        assert f.metadata() == {"format": "pt", "head.weight": "tok_emb.weight"}
    model = fresh_gpt()
    missing, unexpected = safetensors.torch.load_model(model, out / only, strict=True)
    assert (missing, unexpected) == (set(), [])
    assert all(same_bits(v, saved[f"model/{k}"]) for k, v in model.state_dict().items())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, tuple[pathlib.Path, dict]]:
    """layout -> (checkpoint root saved by 2 ranks in that layout, the job's result with the
    digest of every full tensor at the save)."""
    base = tmp_path_factory.mktemp("sharded")
    layouts = ["fsdp", "tp"]
    jobs = [{"layout": k, "ckpt": str(base / k), "steps": 3} for k in layouts]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKERS / "sharded_job.py"),
            "--jobs",
            json.dumps(jobs),
            "--out",
            str(base / "out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {k: (base / k, r) for k, r in zip(layouts, json.loads((base / "out.json").read_text()))}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_a_sharded_checkpoint_exports_the_full_tensors_the_job_held(sharded, layout, tmp_path):
    root, result = sharded[layout]
    manifest = load_committed(open_storage(str(root)), 3, 0, 2).manifest
    writers = {c.writer for r in manifest.tensors.values() if r.chunks for c in r.chunks.chunks()}
    assert writers == {0, 1} and manifest.meshes  # each rank wrote its own shards
    assert main(["export", str(root), "--format", "hf", str(tmp_path / "hf")]) == 0
    exported = {key: sharded_job.digest(t) for key, (_, t) in tensors_in(tmp_path / "hf").items()}
    assert exported == {k.removeprefix("model/"): d for k, d in result["tensors"].items() if k.startswith("model/")}
    assert len(exported) == 4


@pytest.mark.parametrize("golden", ["golden-v1", "golden-v2", "golden-v3-sharded/checkpoint"])
def test_checkpoints_of_earlier_formats_export_their_model(golden, tmp_path):
    root = GOLDEN / golden
    assert main(["export", str(root), str(tmp_path / "hf")]) == 0
    exported = {key: t for key, (_, t) in tensors_in(tmp_path / "hf").items()}
    storage = open_storage(str(root))
    saved = load_committed(storage, catalog.newest_complete(storage).step, 0, 1).replicated["model"]
    assert exported.keys() == saved.keys()
    assert all(same_bits(exported[k], saved[k]) for k in saved)
    if golden.startswith("golden-v3"):  # full tensors digested by the job that wrote it
        digests = json.loads((GOLDEN / "golden-v3-sharded" / "digests.json").read_text())
        assert {k: sharded_job.digest(t) for k, t in exported.items()} == {
            k.removeprefix("model/"): d for k, d in digests.items() if k.startswith("model/")
        }


def save_one_step(root: pathlib.Path, state: dict, step: int = 1) -> None:
    ckpt = spotrun.Checkpointer(state, uri=str(root), handle_signals=False, background_saves=False)
    ckpt.restore()
    ckpt.save(step)
    ckpt.close()


def test_every_dtype_safetensors_holds_is_exported_bit_for_bit(tmp_path):
    f32 = torch.tensor([1.5, -0.0, float("inf"), 3e-45])  # -0.0 and a subnormal
    f32 = torch.cat([f32, torch.tensor([0x7FC12345], dtype=torch.int32).view(torch.float32)])  # a NaN payload
    weights = {
        "f32": f32,
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(7).to(torch.float16),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i64": torch.arange(5),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "f8_e4m3": torch.randn(4).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(4).to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    save_one_step(tmp_path / "ck", {"model": weights})
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0
    exported = {key: t for key, (_, t) in tensors_in(tmp_path / "hf").items()}
    assert exported.keys() == weights.keys()
    assert all(same_bits(exported[k], weights[k]) for k in weights)


def refused(capsys, *args: str) -> str:
    """The one error line of ``spotrun export ARGS`` (exit 2)."""
    assert main(["export", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spotrun: error: ")
    return err[0]


def test_export_refuses_clearly_and_writes_nothing(tmp_path, capsys):
    root, out = tmp_path / "ck", tmp_path / "hf"
    save_one_step(root, {"model": {"w": torch.ones(2)}, "extra": {"z": torch.ones(2, dtype=torch.complex64)}}, step=4)
    (root / "step-000000006").mkdir()
    (root / "step-000000006" / "rank-00000.i000000001.safetensors").write_bytes(b"cut")  # a save that never committed

    assert "step 4 has no state 'modle'; its states are extra, model" in refused(
        capsys, str(root), str(out), "--state", "modle"
    )
    assert "step 6 under" in (line := refused(capsys, str(root), str(out), "--step", "6"))
    assert "not complete (incomplete: no manifest" in line and "complete steps: 4" in line
    line = refused(capsys, str(root), str(out), "--state", "extra")
    assert "tensor 'z' has dtype complex64" in line
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert "notes.txt is not a directory" in refused(capsys, str(root), str(a_file))
    assert a_file.read_text() == "mine"
    [data] = (root / "step-000000004").glob("rank-*.safetensors")
    flipped = bytearray(data.read_bytes())
    flipped[-1] ^= 1
    data.write_bytes(flipped)
    line = refused(capsys, str(root), str(out))
    assert f"{data.name}: block 0" in line and "does not match its checksum" in line
    assert not out.exists()


def test_an_earlier_export_is_replaced_only_with_overwrite_and_other_files_stay(tmp_path, capsys):
    root, out = tmp_path / "ck", tmp_path / "hf"
    save_one_step(root, {"model": {"a": torch.ones(100), "b": torch.zeros(100)}})
    out.mkdir()
    (out / "config.json").write_text("{}")  # files of the model besides its weights do not block an export
    assert main(["export", str(root), str(out), "--max-shard-size", "400B"]) == 0
    assert sorted(os.listdir(out)) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    line = refused(capsys, str(root), str(out))
    assert "already holds exported weights (model-00001-of-00002.safetensors" in line and "--overwrite" in line
    assert main(["export", str(root), str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]  # the stale shards are gone
    assert "removed model-00001-of-00002.safetensors" in capsys.readouterr().out


@pytest.mark.slow
def test_export_from_and_to_s3_writes_the_same_files_as_a_local_export(reference, s3_bucket, tmp_path):
    _, _, checkpoint = reference
    source = open_storage(f"{s3_bucket.uri}/ck")
    for path in checkpoint.rglob("*"):
        if path.is_file():
            source.put(path.relative_to(checkpoint).as_posix(), path.read_bytes())
    assert (
        main(
            [
                "export",
                f"{s3_bucket.uri}/ck",
                f"{s3_bucket.uri}/hf",
                "--max-shard-size",
                "40KB",
                "--s3-endpoint-url",
                s3_bucket.endpoint_url,
            ]
        )
        == 0
    )
    local = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(local), "--max-shard-size", "40KB"]) == 0
    out = open_storage(f"{s3_bucket.uri}/hf")
    assert [o.key for o in out.list("")] == sorted(os.listdir(local))
    for name in os.listdir(local):
        assert out.get(name) == (local / name).read_bytes(), name


@pytest.mark.slow
def test_export_holds_one_output_file_and_bounded_buffers_not_the_model(tmp_path):
    """Peak extra resident memory of an export (tests/support/memory_probe.py, a fresh child process):
    a 96 MiB float32 model exported in files of 8 MiB holds at most one file's tensors, the
    local writer's three 8 MiB buffers and the reader's scratch (8 MiB): 40 MiB, well under the
    model, so an export that assembled the whole model (or even half of it) would fail."""
    from tests.support.memory_probe import EXPORT_SHARD_BYTES, MIB

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.memory_probe",
            "spotrun-export-hf",
            "--state-mib",
            "288",
            "--root",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("SPOTRUN_")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    model_bytes = result["state_bytes"] / 3  # parameters, of parameters + AdamW's two moments
    bound = EXPORT_SHARD_BYTES + 3 * 8 * MIB + 8 * MIB
    print(f"export of a {model_bytes / MIB:.0f} MiB model: {result['extra_bytes'] / MIB:.1f} MiB extra at peak")
    assert bound < model_bytes / 2
    assert result["extra_bytes"] <= bound


@pytest.mark.parametrize(
    "text, size_bytes",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("40KB", 40_000),
        ("2GiB", 2 * 2**30),
        ("1.5MiB", 3 * 2**19),
        ("123", 123),
        ("7 gb", 7 * 10**9),
        ("64B", 64),
    ],
)
def test_shard_sizes_count_as_hugging_face_counts_them(text, size_bytes):
    assert parse_size(text) == size_bytes


def test_files_are_cut_as_hugging_face_cuts_them_a_tensor_over_the_limit_alone():
    sizes = {"a": 30, "b": 30, "big": 500, "c": 50, "d": 10}  # float32 elements; the limit is 100 floats
    manifest = Manifest(
        step=7,
        world_size=1,
        files=[],
        rank_state=[{}],
        tensors={f"model/{k}": TensorRecord(file="f", dtype="float32", shape=[n]) for k, n in sizes.items()},
        state={"model": {k: {"__tensor__": f"model/{k}"} for k in sizes}, "step": 7},
    )
    plan = plan_export(manifest, "model", max_shard_size_bytes=400)
    # as huggingface_hub.split_torch_state_dict_into_shards: the big tensor's file is closed at once
    assert [[t.key for t in s.tensors] for s in plan.shards] == [["big"], ["a", "b"], ["c", "d"]]
    assert [s.filename for s in plan.shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert plan.total_size_bytes == 4 * sum(sizes.values())
