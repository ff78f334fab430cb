"""Issue 8, section 4: every torch dtype is stored bit-exactly or refused before training,
and a committed step that cannot be decoded falls back instead of crash-looping.

Single process, no process group, local storage in ``tmp_path`` (as tests/unit/checkpoint/test_checkpoint.py).
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

import spotrun
from spotrun.checkpoint import catalog
from spotrun.checkpoint.layout import data_file_key, step_dir
from spotrun.checkpoint.shard import sha256_hex
from spotrun.errors import StateSerializationError
from tests.support.ckpt_files import chunk_files, manifest_path, storage_at

pytestmark = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental", "ignore:torch.quantize_per_tensor"
)

#: Every dtype the installed torch exposes as an attribute of the ``torch`` module.
ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
#: The dtypes the issue names, which must round-trip wherever this torch has them.
MUST_ROUND_TRIP = [
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "bool",
        "complex32",
        "complex64",
        "complex128",
        "uint16",
        "uint32",
        "uint64",
        "float4_e2m1fn_x2",
        "bits8",
        "bits16",
        "bits1x8",
        "bits2x4",
        "bits4x2",
    )
    if hasattr(torch, name)
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` with random bytes (0/1 for bool); quantized dtypes by quantizing."""
    gen = torch.Generator().manual_seed(seed)
    if torch.empty(0, dtype=dtype).is_quantized:
        return torch.quantize_per_tensor(torch.randn(shape, generator=gen), 0.1, 3, dtype)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def bytes_of(t: torch.Tensor) -> bytes:
    """The tensor's values as bytes, in logical (row-major) order: what 'bit-exact' compares."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def torch_refuses(dtype: torch.dtype) -> bool:
    """Whether torch itself cannot checkpoint this dtype: quantized (scale and zero point are
    not in the bytes), or torch cannot even copy a tensor of it."""
    probe = torch.empty(1, dtype=dtype)
    if probe.is_quantized:
        return True
    try:
        probe.clone()
    except RuntimeError:  # NotImplementedError: "copy_kernel" not implemented for 'UInt3'
        return True
    return False


class Buffers(torch.nn.Module):
    """A linear layer plus named buffers (MX block scales, packed FP4, ...)."""

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        for name, value in buffers.items():
            self.register_buffer(name, value)


def make_state(dtype: torch.dtype, seed: int) -> tuple[Buffers, dict]:
    model = Buffers({"buf": random_tensor(dtype, (3, 5), seed)})
    extra = {
        "scalar": random_tensor(dtype, (), seed + 1),
        "transposed": random_tensor(dtype, (5, 3), seed + 2).t(),  # not contiguous
        "empty": random_tensor(dtype, (0, 4), seed + 3),
    }
    return model, extra


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_4_every_torch_dtype_round_trips_or_is_refused(tmp_path, dtype):
    """Each dtype of the installed torch: saved and restored bit-exactly (module buffer,
    0-dim, non-contiguous and empty tensors), or refused by ``restore()`` before training
    naming the key and the dtype, with nothing written.

    A dtype torch cannot create a tensor of passes by asserting that torch refuses it; in
    torch 2.13 there is none: every dtype can hold data (a uint8 buffer views as any). Refused:
    the quantized dtypes (qint8, quint8, qint32, quint4x2, quint2x4), and the shell dtypes
    int1..int7 and uint1..uint7, which torch cannot copy (``clone``/``copy_`` raise
    ``NotImplementedError``), so no module could load them back either.
    """
    try:
        model, extra = make_state(dtype, seed=1)
    except (RuntimeError, TypeError):  # a dtype that cannot hold data at all: torch refuses it
        with pytest.raises((RuntimeError, TypeError)):
            torch.empty(1, dtype=dtype)
        assert dtype not in MUST_ROUND_TRIP
        return
    ckpt = spotrun.Checkpointer({"model": model, "extra": extra}, storage=storage_at(tmp_path), handle_signals=False)
    if torch_refuses(dtype):
        assert dtype not in MUST_ROUND_TRIP
        with pytest.raises(StateSerializationError) as refused:
            ckpt.restore()
        assert "'model/buf'" in str(refused.value) and str(dtype) in str(refused.value)
        with pytest.raises(StateSerializationError):
            ckpt.save(1)
        assert list(tmp_path.iterdir()) == []
        return
    assert ckpt.restore() == 0
    ckpt.save(1)
    saved = {"buf": bytes_of(model.buf), **{k: bytes_of(v) for k, v in extra.items()}}

    model2, extra2 = make_state(dtype, seed=100)  # other contents: all must come from the step
    ckpt2 = spotrun.Checkpointer({"model": model2, "extra": extra2}, storage=storage_at(tmp_path), handle_signals=False)
    assert ckpt2.restore() == 1
    assert model2.buf.dtype == dtype and model2.buf.shape == (3, 5)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in extra2.items()} == {
        k: (v.dtype, tuple(v.shape)) for k, v in extra.items()
    }
    assert {"buf": bytes_of(model2.buf), **{k: bytes_of(v) for k, v in extra2.items()}} == saved


def mx_buffers(seed: int) -> dict[str, torch.Tensor]:
    return {
        "scales": random_tensor(torch.float8_e8m0fnu, (4, 2), seed),
        "packed": random_tensor(torch.float4_e2m1fn_x2, (4, 8), seed + 1),
    }


def test_4_float8_e8m0_and_fp4_buffers_round_trip(tmp_path):
    """The issue's input: step 1 clean, step 2 with an MX scale buffer (float8_e8m0fnu) and a
    packed FP4 buffer (float4_e2m1fn_x2) -> step 2 commits and restores exactly."""
    model = Buffers({})
    ckpt = spotrun.Checkpointer({"model": model}, storage=storage_at(tmp_path), handle_signals=False)
    assert ckpt.restore() == 0
    ckpt.save(1)
    for name, value in mx_buffers(seed=5).items():
        model.register_buffer(name, value)
    ckpt.save(2)
    assert [(s.step, s.status) for s in catalog.list_steps(storage_at(tmp_path))] == [(1, "complete"), (2, "complete")]

    model2 = Buffers(mx_buffers(seed=50))
    ckpt2 = spotrun.Checkpointer({"model": model2}, storage=storage_at(tmp_path), handle_signals=False)
    assert ckpt2.restore() == 2
    for name in ("scales", "packed"):
        restored, original = getattr(model2, name), getattr(model, name)
        assert restored.dtype == original.dtype and restored.shape == original.shape
        assert bytes_of(restored) == bytes_of(original)
    assert torch.equal(model2.lin.weight, model.lin.weight)


def _as_old_writer(tmp_path) -> None:
    """Rewrite committed step 2 the way spotrun 0.1 wrote it: its float8_e8m0fnu tensor under
    safetensors' own ``F8_E8M0`` code (which safetensors' torch wrapper cannot read back), in a
    format-1 manifest whose size and checksum match the new file."""
    mpath = manifest_path(tmp_path, 2)
    doc = json.loads(mpath.read_text())
    (name,) = [n for n, r in doc["tensors"].items() if r["dtype"] == "float8_e8m0fnu"]
    (path,) = chunk_files(tmp_path, 2)[name]
    shard = tmp_path / data_file_key(2, 0, path, None)  # a local root: the step directory
    # the file keeps its other tensors (a file too small for the tensors its manifest lists is
    # a corrupt step before any dtype is looked at: issue 21)
    tensors = safetensors_load(shard.read_bytes())
    tensors[name] = torch.ones(3, dtype=torch.float8_e8m0fnu)
    data = safetensors_save(tensors)
    shard.write_bytes(data)
    # format 1: whole tensors named by file, each file's SHA-256, no index files
    for tensor_name, record in doc["tensors"].items():
        (holding,) = chunk_files(tmp_path, 2)[tensor_name]
        doc["tensors"][tensor_name] = {
            "file": holding,
            "dtype": record["dtype"],
            "shape": record["shape"],
            "offsets": None,
        }
    doc["files"] = [f for f in doc["files"] if f["path"].endswith(".safetensors")]
    for file_record in doc["files"]:
        content = (tmp_path / data_file_key(2, file_record["rank"], file_record["path"], None)).read_bytes()
        for field in ("algorithm", "chunk_bytes", "digest"):
            file_record.pop(field, None)
        file_record.update(size_bytes=len(content), sha256=sha256_hex(content))
    doc["format_version"] = 1
    mpath.write_text(json.dumps(doc))


def _dtype_this_torch_lacks(tmp_path) -> None:
    """A manifest naming a dtype that a newer torch may have and this one does not."""
    mpath = manifest_path(tmp_path, 2)
    doc = json.loads(mpath.read_text())
    doc["tensors"]["extra/scales"]["dtype"] = "float8_e3m4x"
    mpath.write_text(json.dumps(doc))


def _refused_dtype(tmp_path) -> None:
    """A manifest claiming the stored bytes are a quantized tensor (never written by spotrun)."""
    mpath = manifest_path(tmp_path, 2)
    doc = json.loads(mpath.read_text())
    doc["tensors"]["extra/scales"]["dtype"] = "qint8"
    mpath.write_text(json.dumps(doc))


def _undecodable_skeleton(tmp_path) -> None:
    """A state skeleton whose int-keyed dict has an unhashable key."""
    mpath = manifest_path(tmp_path, 2)
    doc = json.loads(mpath.read_text())
    doc["state"]["extra"] = {"__dict__": [[["not", "hashable"], 1]]}
    mpath.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "damage",
    [_as_old_writer, _dtype_this_torch_lacks, _refused_dtype, _undecodable_skeleton],
    ids=["native-F8_E8M0-shard", "dtype-this-torch-lacks", "quantized-dtype", "undecodable-state-skeleton"],
)
def test_4_undecodable_committed_step_falls_back(tmp_path, caplog, damage):
    """A committed step whose shard or manifest declares a dtype this reader cannot decode:
    restore() falls back to step 1 and un-commits step 2 (no exception, no crash loop), and
    training can save step 2 again."""
    model = torch.nn.Linear(3, 3)
    extra: dict = {"epoch": 1}
    ckpt = spotrun.Checkpointer({"model": model, "extra": extra}, storage=storage_at(tmp_path), handle_signals=False)
    ckpt.save(1)
    weight_at_1 = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    extra.update(epoch=2, scales=torch.ones(3, dtype=torch.float8_e8m0fnu))
    ckpt.save(2)
    damage(tmp_path)
    assert catalog.inspect_step(storage_at(tmp_path), 2).status == "complete"

    model2, extra2 = torch.nn.Linear(3, 3), {}
    ckpt2 = spotrun.Checkpointer({"model": model2, "extra": extra2}, storage=storage_at(tmp_path), handle_signals=False)
    with caplog.at_level(logging.WARNING):
        assert ckpt2.restore() == 1
    assert torch.equal(model2.weight, weight_at_1) and extra2 == {"epoch": 1}
    assert "checkpoint step 2 failed verification" in caplog.text and "falling back to step 1" in caplog.text
    assert catalog.inspect_step(storage_at(tmp_path), 2).status == "corrupt"
    assert list((tmp_path / step_dir(2)).glob("rejected-manifest*.json"))
    ckpt2.save(2)  # training gets through step 2 again
    assert catalog.inspect_step(storage_at(tmp_path), 2).status == "complete"
    assert (
        spotrun.Checkpointer(
            {"model": torch.nn.Linear(3, 3), "extra": {}}, storage=storage_at(tmp_path), handle_signals=False
        ).restore()
        == 2
    )
