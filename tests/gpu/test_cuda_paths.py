"""spotrun's CUDA paths on a real GPU: pinned staging, device-to-host copies issued together and
waited for once, every CUDA generator restored exactly, restores into device tensors, and NCCL
jobs (on every device the machine has) resumed bit-exactly. Issue 26, point 7.

Marked ``gpu`` and skipped where CUDA is not available (CI has no GPU): ``benchmarks/gpu_check.sh``
runs them with the engine benchmark on a GPU machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from spotrun.checkpoint.staging import StagingBuffers
from spotrun.state.rng import RNGState
from spotrun.storage import LocalStorage
from tests.support.paths import JOBS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda_tensors(count: int, numel: int = 1 << 20) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(7)
    return {f"t{i}": torch.randn(numel, device="cuda", generator=generator) for i in range(count)}


def test_staging_of_device_tensors_uses_pinned_buffers_reused_from_save_to_save():
    """A background save copies device tensors into pinned host buffers, allocated at the first
    save and reused by the next (same memory), holding the values of the moment it staged."""
    staging = StagingBuffers()
    tensors = _cuda_tensors(3)
    first = staging.stage(tensors)
    assert all(buffer.is_pinned() and buffer.device.type == "cpu" for buffer in first.values())
    assert all(torch.equal(first[n], t.cpu()) for n, t in tensors.items())
    pointers = {n: b.data_ptr() for n, b in first.items()}
    for tensor in tensors.values():
        tensor.add_(1.0)
    second = staging.stage(tensors)
    assert {n: b.data_ptr() for n, b in second.items()} == pointers
    assert all(torch.equal(second[n], t.cpu()) for n, t in tensors.items())
    staging.release()


def test_device_to_host_copies_are_issued_together_and_waited_for_once():
    """The copies of a stage are asynchronous copies on the current stream with a single wait at
    the end, so they queue back to back instead of each waiting for the last; when ``stage``
    returns, every copy is complete (the stream has no work left)."""
    from torch.profiler import ProfilerActivity, profile

    staging = StagingBuffers()
    tensors = _cuda_tensors(6)
    staging.stage(tensors)  # allocates the pinned buffers outside the profile
    torch.cuda._sleep(50_000_000)  # work queued ahead of the copies: stage must wait for it
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        staged = staging.stage(tensors)
        assert torch.cuda.current_stream().query(), "stage returned before its copies completed"
    runtime_calls = [event.name for event in prof.events() if event.name.startswith("cuda")]
    assert runtime_calls.count("cudaMemcpyAsync") >= len(tensors), runtime_calls
    assert "cudaMemcpy" not in runtime_calls, runtime_calls  # no copy that waits on its own
    assert runtime_calls.count("cudaStreamSynchronize") == 1, runtime_calls
    assert all(torch.equal(staged[n], t.cpu()) for n, t in tensors.items())
    staging.release()


def test_every_cuda_generator_is_restored_exactly():
    """Draws after a restore of the RNG state equal the draws after the capture, on every device."""
    devices = range(torch.cuda.device_count())
    for index in devices:
        torch.cuda.manual_seed_all(100 + index)
        torch.rand(3, device=f"cuda:{index}")
    captured = RNGState().state_dict()
    expected = [torch.rand(5, device=f"cuda:{i}").cpu() for i in devices]
    torch.cuda.manual_seed_all(999)
    RNGState().load_state_dict(captured)
    assert all(torch.equal(torch.rand(5, device=f"cuda:{i}").cpu(), expected[i]) for i in devices)


def test_a_checkpoint_of_device_state_restores_into_device_tensors_exactly(tmp_path):
    """Model and optimizer on the GPU, saved and restored in a fresh Checkpointer: every tensor is
    back on its device with the saved bytes, and the CUDA generator continues as it would have."""
    import spotrun

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.5)).cuda()
        optimizer = torch.optim.AdamW(model.parameters())
        return model, optimizer

    model, optimizer = make()
    model(torch.randn(4, 32, device="cuda")).sum().backward()
    optimizer.step()
    ckpt = spotrun.Checkpointer(
        {"model": model, "optimizer": optimizer}, storage=LocalStorage(tmp_path), handle_signals=False
    )
    ckpt.restore()
    ckpt.save(1)
    ckpt.close()
    expected_draw = torch.rand(4, device="cuda").cpu()
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    saved_moments = [s["exp_avg"].cpu().clone() for s in optimizer.state.values()]

    torch.manual_seed(1)  # another start: other weights, another CUDA stream of numbers
    fresh, fresh_optimizer = make()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    restarted = spotrun.Checkpointer(
        {"model": fresh, "optimizer": fresh_optimizer}, storage=LocalStorage(tmp_path), handle_signals=False
    )
    assert restarted.restore() == 1
    restarted.close()
    for name, tensor in fresh.state_dict().items():
        assert tensor.device.type == "cuda"
        assert torch.equal(tensor.cpu(), saved[name]), name
    moments = [s["exp_avg"] for s in fresh_optimizer.state.values()]
    assert all(m.device.type == "cuda" for m in moments)
    assert all(torch.equal(m.cpu(), s) for m, s in zip(moments, saved_moments))
    assert torch.equal(torch.rand(4, device="cuda").cpu(), expected_draw)


def _torchrun(tmp_path: pathlib.Path, name: str, layout: str, steps: int, stop_at: int | None) -> dict:
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTRUN_")}
    if stop_at is not None:
        env["SPOTRUN_STOP_AT_STEP"] = str(stop_at)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(torch.cuda.device_count()),
        str(JOBS / "cuda_job.py"),
        "--ckpt",
        str(tmp_path / f"ckpt-{layout}-{name.split('-')[0]}"),
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--layout",
        layout,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_an_nccl_job_stopped_and_resumed_on_every_device_matches_the_uninterrupted_run(tmp_path, layout):
    """NCCL on every device of the machine (one rank per device; with one device, world size 1
    still takes the NCCL paths): an emergency stop at step 9, a resume, and the losses after the
    resume and the final weights equal an uninterrupted run's bit for bit (background saves of
    device state every 4 steps, CUDA generators restored, DDP or FSDP2 DTensors on the device)."""
    reference = _torchrun(tmp_path, "reference-run", layout, 20, None)
    stopped = _torchrun(tmp_path, "interrupted-first", layout, 20, 9)
    assert stopped["step"] == 9
    resumed = _torchrun(tmp_path, "interrupted-second", layout, 20, None)
    assert resumed["restored"] == 9
    assert resumed["losses"] == {k: v for k, v in reference["losses"].items() if int(k) > 9}
    assert resumed["final"] == reference["final"]
