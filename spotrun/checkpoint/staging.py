"""Staging buffers for background saves: the state copied once per save into host memory
that is allocated on the first save and reused by every later one.

A background save writes from these copies while training goes on changing the live
tensors. Buffers are pinned when their source is on a GPU, and the device-to-host copies
are issued non-blocking on the current stream and waited for once, so they overlap each
other. A buffer is reallocated only when its tensor's shape or dtype changes; buffers of
names no longer saved are freed.
"""

from __future__ import annotations

import torch

from spotrun.checkpoint.stream import byte_view, copy_bytes


class StagingBuffers:
    """Host copies of the tensors a rank writes, reused from save to save.

    Not thread-safe: the training thread stages, and must not stage again while a
    background save still reads the previous copies (at most one save in flight).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def size_bytes(self) -> int:
        """Host memory held by the buffers, in bytes."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` (any device) into the buffers; returns name -> host copy
        (contiguous, same shape and dtype). Returns once every copy is complete."""
        staged: dict[str, torch.Tensor] = {}
        from_cuda = False
        for name, tensor in tensors.items():
            tensor = tensor.detach()
            buffer = self._buffers.get(name)
            pin = tensor.device.type == "cuda"
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype \
                    or buffer.is_pinned() != pin:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
                self._buffers[name] = buffer
            if pin:
                buffer.copy_(tensor, non_blocking=True)
            elif tensor.is_contiguous():
                copy_bytes(byte_view(buffer), byte_view(tensor))  # one thread: see copy_bytes
            else:
                buffer.copy_(tensor)
            from_cuda = from_cuda or pin
            staged[name] = buffer
        for name in set(self._buffers) - set(tensors):
            del self._buffers[name]
        if from_cuda:
            torch.cuda.current_stream().synchronize()
        return staged

    def release(self) -> None:
        """Free every buffer (the next :meth:`stage` allocates again)."""
        self._buffers.clear()
