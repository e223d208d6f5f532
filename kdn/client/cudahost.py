"""Page-locking host memory for CUDA (``cudaHostRegister``) on a device that has a CUDA context
already, so that no context is made on a GPU the process does not use.

The CUDA runtime acts on the calling thread's current device and first makes that device's
context where it has none. A process whose model is on cuda:1 while its current device is
cuda:0 (an engine that never calls ``torch.cuda.set_device``; any other thread of one that
does, the current device being per thread) would hold a context, some hundreds of MiB, on
cuda:0: another rank's or another engine's GPU. Registered memory is pinned for every device
under unified addressing (every 64-bit CUDA platform), so the call is made on a device with a
context: the current one where it has one, else the first that has one, as torch's own pinned
allocator chooses. Where none has, on the current device.

Used by the shared segment and the read arena (``kdn.client.shm``) and the pinned in-process
tier (``kdn.client.local``); torch is imported only when they call.
"""

from __future__ import annotations

import contextlib
from typing import Any


def register(ptr: int, size: int, flags: int = 0) -> bool:
    """``cudaHostRegister(ptr, size, flags)`` on a device with a context; True where CUDA took
    it."""
    import torch

    with _on_a_device_with_context(torch):
        return int(torch.cuda.cudart().cudaHostRegister(ptr, size, flags)) == 0


def unregister(ptr: int) -> None:
    """``cudaHostUnregister(ptr)`` on a device with a context."""
    import torch

    with _on_a_device_with_context(torch):
        torch.cuda.cudart().cudaHostUnregister(ptr)


def context_device(torch: Any) -> int | None:
    """The index of the device to call the runtime on: the current device where it has a
    context, else the first that has one; None where none has or torch can not tell."""
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has is None:  # a build without CUDA
        return None
    current = int(torch.cuda.current_device())
    if has(current):
        return current
    return next((i for i in range(torch.cuda.device_count()) if has(i)), None)


def _on_a_device_with_context(torch: Any) -> Any:
    index = context_device(torch)
    return torch.cuda.device(index) if index is not None else contextlib.nullcontext()
