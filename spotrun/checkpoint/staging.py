"""Staging buffers for background saves: the state copied once per save into host memory
that is allocated on the first save and reused by every later one.

A background save writes from these copies while training goes on changing the live
tensors. Buffers are pinned when their source is on a GPU, and the device-to-host copies
are issued non-blocking on the current stream and waited for once, so they overlap each
other. A buffer is reallocated only when its tensor's shape or dtype changes; buffers of
names no longer saved are freed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from spotrun.checkpoint.stream import byte_view, copy_bytes

#: Host copies are split into pieces of at most this many bytes, copied by several threads.
COPY_PIECE_BYTES = 16 * 2**20
#: Most threads copying host tensors at once.
MAX_COPY_THREADS = 8


class StagingBuffers:
    """Host copies of the tensors a rank writes, reused from save to save.

    Host-to-host copies are ``memmove`` calls in pieces of :data:`COPY_PIECE_BYTES`, run by
    as many threads as torch's intra-op setting (``torch.get_num_threads()``, at most
    :data:`MAX_COPY_THREADS`), threads that sleep between saves (torch's own parallel copy
    spins its threads at a barrier, which a busy machine punishes: see
    :func:`~spotrun.checkpoint.stream.copy_bytes`).

    Not thread-safe: the training thread stages, and must not stage again while a
    background save still reads the previous copies (at most one save in flight).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[torch.Tensor, bool]] = {}  # name -> (buffer, pinned)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def size_bytes(self) -> int:
        """Host memory held by the buffers, in bytes."""
        return sum(b.numel() * b.element_size() for b, _ in self._buffers.values())

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` (any device) into the buffers; returns name -> host copy
        (contiguous, same shape and dtype). Returns once every copy is complete."""
        staged: dict[str, torch.Tensor] = {}
        from_cuda = False
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in tensors.items():
            tensor = tensor.detach()
            pin = tensor.device.type == "cuda"
            buffer, pinned = self._buffers.get(name, (None, False))
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or pinned != pin:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
                self._buffers[name] = (buffer, pin)
            if pin:
                buffer.copy_(tensor, non_blocking=True)
            elif tensor.is_contiguous():
                target, source = byte_view(buffer), byte_view(tensor)
                pieces.extend(
                    (target[a : a + COPY_PIECE_BYTES], source[a : a + COPY_PIECE_BYTES])
                    for a in range(0, target.numel(), COPY_PIECE_BYTES)
                )
            else:
                buffer.copy_(tensor)
            from_cuda = from_cuda or pin
            staged[name] = buffer
        for name in set(self._buffers) - set(tensors):
            del self._buffers[name]
        self._copy(pieces)
        if from_cuda:
            torch.cuda.current_stream().synchronize()
        return staged

    def _copy(self, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        threads = max(1, min(torch.get_num_threads(), MAX_COPY_THREADS))
        if threads == 1 or len(pieces) < 2:
            for target, source in pieces:
                copy_bytes(target, source)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spotrun-stage")
        for future in [self._pool.submit(copy_bytes, target, source) for target, source in pieces]:
            future.result()

    def release(self) -> None:
        """Free every buffer and the copy threads (the next :meth:`stage` allocates again)."""
        self._buffers.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
