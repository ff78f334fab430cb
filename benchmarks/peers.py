"""The tools that ``checkpoint_vs_peers.py`` compares, each run on one live training state.

Every tool is a small class whose ``run(timer)`` does one interleaved round: save (durable:
files fsynced), evict the files from the page cache, restore into the live model and
optimizer (cold), remove the files. ``timer(figure, fn)`` times one piece. The same methods
serve the memory measurements (one child process per measurement, :data:`MEMORY_ACTIONS`).

A restore through ``Optimizer.load_state_dict`` installs new tensors as the optimizer's state;
:class:`TensorIdentity` copies their values back into the original tensors afterwards (outside
any timing), so that every tool, in every round, saves the same tensor objects, as a training
loop's periodic saves do (a stager that caches per source tensor, like DCP's, stays warm).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from collections.abc import Callable

import torch

from tests.support.memory_probe import background_saves_available, evict_from_page_cache
from tests.support.peak_memory import PeakMemory, measure

Timer = Callable[[str, Callable[[], object]], object]
DD_BLOCK_BYTES = 8 * 2**20

warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")


def device_sync(device: str) -> Callable[[], None]:
    """What a timing calls to wait for the device's queued work (nothing on the CPU)."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def describe_device(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return "the CPU"


def _on_cuda(model: torch.nn.Module) -> bool:
    return next(model.parameters()).device.type == "cuda"


def fsync_path(path: str) -> None:
    """fsync a file and its directory (a durable save, like LocalStorage's and DCP's)."""
    for target, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_RDONLY)):
        fd = os.open(target, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def flat_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the state by a flat name (safetensors' and memcpy's view of it)."""
    flat = {f"model/{k}": v for k, v in model.state_dict().items()}
    for index, per_param in enumerate(optimizer.state.values()):
        flat.update({f"optimizer/{index}/{k}": v for k, v in per_param.items() if isinstance(v, torch.Tensor)})
    return flat


class TensorIdentity:
    """Keeps the optimizer's state tensors the same objects across restores."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._original = {id(p): dict(state) for p, state in optimizer.state.items()}

    def reinstall(self) -> None:
        """Copy restored values into the original tensors and put those back."""
        for p, state in self._optimizer.state.items():
            for key, original in self._original[id(p)].items():
                current = state[key]
                if isinstance(original, torch.Tensor) and current is not original:
                    original.copy_(current)
                    state[key] = original


class Tool:
    """One tool on the live state, with a scratch directory of its own."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: str) -> None:
        self.model, self.optimizer, self.root = model, optimizer, root
        self.identity = TensorIdentity(optimizer)
        self.round = 0
        os.makedirs(root, exist_ok=True)

    def clear(self) -> None:
        """Remove this tool's files (done between rounds, outside timings)."""
        for name in os.listdir(self.root):
            if not name.startswith(("incarnations", "warm")):
                path = os.path.join(self.root, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)

    def path(self, name: str) -> str:
        return os.path.join(self.root, f"{name}-{self.round}")


class Spotrun(Tool):
    """``Checkpointer.save(step)`` (durable local storage) and ``Checkpointer.restore()``."""

    def __init__(self, model, optimizer, root) -> None:
        super().__init__(model, optimizer, root)
        import spotrun
        from spotrun.storage import LocalStorage

        self.ckpt = spotrun.Checkpointer(
            {"model": model, "optimizer": optimizer}, storage=LocalStorage(root), handle_signals=False
        )
        self.ckpt.restore()  # claims this start's incarnation (an empty root: step 0)

    def save(self) -> None:
        self.round += 1
        self.ckpt.save(self.round)

    def restore(self) -> None:
        if self.ckpt.restore() != self.round:
            raise RuntimeError("spotrun restored another step")

    def run(self, timer: Timer) -> None:
        self.clear()
        timer("spotrun save", self.save)
        evict_from_page_cache(self.root)
        timer("spotrun restore", self.restore)
        self.identity.reinstall()


class SpotrunBackground(Tool):
    """``Checkpointer(interval_steps=1, background_saves=True)``: ``end_of_step`` blocks for the
    stall, ``wait_for_save`` returns when the step is committed. One warm-up save first
    (it allocates the staging buffers; every later save reuses them)."""

    def __init__(self, model, optimizer, root) -> None:
        super().__init__(model, optimizer, root)
        if not background_saves_available():
            raise NotImplementedError("background saves not available")
        import spotrun
        from spotrun.storage import LocalStorage

        self.ckpt = spotrun.Checkpointer(
            {"model": model, "optimizer": optimizer},
            storage=LocalStorage(root),
            handle_signals=False,
            interval_steps=1,
            background_saves=True,
        )
        self.ckpt.restore()
        self.start()
        self.ckpt.wait_for_save()

    def start(self) -> None:
        self.round += 1
        self.ckpt.end_of_step(self.round)

    def run(self, timer: Timer) -> None:
        self.clear()
        started = timer("spotrun background stall", self.start)
        timer("spotrun background total", self.ckpt.wait_for_save, since=started)


class Dcp(Tool):
    """``torch.distributed.checkpoint.save`` / ``load`` of ``get_state_dict(model, optimizer)``
    (FileSystemWriter's defaults: one file per rank, files fsynced), ``set_state_dict`` after."""

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.round += 1
        dcp.save(self.state(), checkpoint_id=self.path("dcp"))

    def restore(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self.state()
        dcp.load(state, checkpoint_id=self.path("dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def run(self, timer: Timer) -> None:
        self.clear()
        timer("DCP save", self.save)
        evict_from_page_cache(self.root)
        timer("DCP load", self.restore)
        self.identity.reinstall()


class DcpAsync(Dcp):
    """``torch.distributed.checkpoint.async_save``: the call blocks for the stall (staging into
    CPU memory), the returned future completes with the save. ``reuse_stager``: one
    ``DefaultStager`` passed to every call (it caches its staging copies per source tensor),
    warmed up by one save; otherwise async_save's own stager, new for each save."""

    def __init__(self, model, optimizer, root, *, reuse_stager: bool) -> None:
        super().__init__(model, optimizer, root)
        self.label = "DCP async_save" + (" (reused stager)" if reuse_stager else "")
        self.stager = None
        self.future = None
        if reuse_stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Staging in the calling thread, as spotrun's (the stall ends when the copy is whole);
            # on a GPU into pinned memory with non-blocking copies, its fastest such setting
            cuda = _on_cuda(model)
            self.stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
            self.start()
            self.future.result()

    def start(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.round += 1
        self.future = dcp.async_save(self.state(), checkpoint_id=self.path("dcp-async"), async_stager=self.stager)

    def two_saves(self) -> None:
        for _ in range(2):
            self.start()
            self.future.result()

    def run(self, timer: Timer) -> None:
        self.clear()
        started = timer(f"{self.label} stall", self.start)
        timer(f"{self.label} total", lambda: self.future.result(), since=started)


class Safetensors(Tool):
    """``safetensors.torch.save_file`` + fsync; ``load_file`` + ``copy_`` into the live tensors."""

    def save(self) -> None:
        from safetensors.torch import save_file

        self.round += 1
        save_file(flat_tensors(self.model, self.optimizer), self.path("state.safetensors"))
        fsync_path(self.path("state.safetensors"))

    def restore(self) -> None:
        from safetensors.torch import load_file

        loaded = load_file(self.path("state.safetensors"))
        for name, tensor in flat_tensors(self.model, self.optimizer).items():
            tensor.copy_(loaded[name])

    def run(self, timer: Timer) -> None:
        self.clear()
        timer("safetensors save_file+fsync", self.save)
        evict_from_page_cache(self.root)
        timer("safetensors load_file+copy_", self.restore)


class TorchSave(Tool):
    """``torch.save`` of both state dicts + fsync; ``torch.load(weights_only=True)`` and
    ``load_state_dict`` of each."""

    def save(self) -> None:
        self.round += 1
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, self.path("state.pt"))
        fsync_path(self.path("state.pt"))

    def restore(self) -> None:
        state = torch.load(self.path("state.pt"), weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def run(self, timer: Timer) -> None:
        self.clear()
        timer("torch.save+fsync", self.save)
        evict_from_page_cache(self.root)
        timer("torch.load+load_state_dict", self.restore)
        self.identity.reinstall()


class Limits(Tool):
    """The machine: ``dd`` direct write (and direct read) of the state's bytes, and a copy of
    every tensor into buffers allocated (and touched) once, with torch's threads and with one."""

    def __init__(self, model, optimizer, root) -> None:
        super().__init__(model, optimizer, root)
        self.tensors = list(flat_tensors(model, optimizer).values())
        # On a GPU the floor of a stall is a device-to-host copy into pinned host buffers
        self.cuda = _on_cuda(model)
        self.buffers = [
            torch.zeros(t.shape, dtype=t.dtype, pin_memory=self.cuda) if self.cuda else torch.zeros_like(t)
            for t in self.tensors
        ]
        size_bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.blocks = -(-size_bytes // DD_BLOCK_BYTES)
        self.direct = True

    def dd(self, *operands: str) -> None:
        """``dd`` with direct I/O; where the filesystem refuses it (tmpfs), buffered I/O (said once)."""
        if not self.direct:
            operands = tuple(op for op in operands if op not in ("oflag=direct", "iflag=direct"))
        proc = subprocess.run(["dd", "bs=8M", "status=none", *operands], capture_output=True, text=True)
        if proc.returncode != 0 and self.direct:
            print(
                f"  dd refused direct I/O under {self.root} ({proc.stderr.strip()}): the limits are buffered I/O here",
                flush=True,
            )
            self.direct = False
            self.dd(*operands)
        elif proc.returncode != 0:
            raise RuntimeError(f"dd {' '.join(operands)} failed: {proc.stderr.strip()}")

    def memcpy(self) -> None:
        for buffer, tensor in zip(self.buffers, self.tensors):
            buffer.copy_(tensor, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()

    def memcpy_one_thread(self) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.memcpy()
        finally:
            torch.set_num_threads(threads)

    def run(self, timer: Timer) -> None:
        self.clear()
        self.round += 1
        path = self.path("dd")
        timer(
            "dd direct write",
            lambda: self.dd("if=/dev/zero", f"of={path}", f"count={self.blocks}", "oflag=direct", "conv=fsync"),
        )
        evict_from_page_cache(self.root)
        timer("dd direct read", lambda: self.dd(f"if={path}", "of=/dev/null", "iflag=direct"))
        # The floor is the faster of torch's threads and one thread: on a loaded machine the
        # threads of a parallel copy wait for each other (here up to 4x slower than one thread).
        timer("memcpy, torch's threads", self.memcpy)
        timer("memcpy, one thread", self.memcpy_one_thread)


def local_tools(model, optimizer, root: str) -> tuple[list[Tool], dict[str, str]]:
    """Every tool on the state; also figure prefix -> why a tool could not run."""
    factories: dict[str, Callable[[], Tool]] = {
        "spotrun": lambda: Spotrun(model, optimizer, f"{root}/spotrun"),
        "spotrun background": lambda: SpotrunBackground(model, optimizer, f"{root}/spotrun-bg"),
        "DCP": lambda: Dcp(model, optimizer, f"{root}/dcp"),
        "DCP async_save": lambda: DcpAsync(model, optimizer, f"{root}/dcp-async", reuse_stager=False),
        "DCP async_save (reused stager)": lambda: DcpAsync(
            model, optimizer, f"{root}/dcp-async-reused", reuse_stager=True
        ),
        "safetensors": lambda: Safetensors(model, optimizer, f"{root}/safetensors"),
        "torch.save": lambda: TorchSave(model, optimizer, f"{root}/torch-save"),
        "limits": lambda: Limits(model, optimizer, f"{root}/limits"),
    }
    tools, missing = [], {}
    for name, factory in factories.items():
        try:
            tools.append(factory())
        except NotImplementedError as exc:
            missing[name] = str(exc)
    return tools, missing


def _save_and_restore(make: Callable[..., Tool], name: str) -> Callable[..., dict[str, PeakMemory]]:
    """A tool's save, then its cold restore, each measured from its own (trimmed) baseline."""

    def action(model, optimizer, root) -> dict[str, PeakMemory]:
        tool = make(model, optimizer, root)
        peaks = {f"{name}-save": measure(tool.save)[1]}
        evict_from_page_cache(root)
        peaks[f"{name}-load"] = measure(tool.restore)[1]
        return peaks

    return action


def _two_async_saves(reuse_stager: bool, name: str) -> Callable[..., dict[str, PeakMemory]]:
    """Two async saves from the first call on (a reused stager allocates its copies then)."""

    def action(model, optimizer, root) -> dict[str, PeakMemory]:
        return {name: measure(lambda: DcpAsync(model, optimizer, root, reuse_stager=reuse_stager).two_saves())[1]}

    return action


#: Peers' memory measurements, in the form of :data:`tests.support.memory_probe.ACTIONS`.
MEMORY_ACTIONS: dict[str, Callable[..., dict[str, PeakMemory]]] = {
    "dcp": _save_and_restore(Dcp, "dcp"),
    "dcp-async-save": _two_async_saves(False, "dcp-async-save"),
    "dcp-async-save-reused-stager": _two_async_saves(True, "dcp-async-save-reused-stager"),
    "safetensors": _save_and_restore(Safetensors, "safetensors"),
    "torch": _save_and_restore(TorchSave, "torch"),
}
