"""How the codec's numba kernels are compiled: ``kernel(fn)`` is ``numba.njit(cache=True,
nogil=True)(fn)`` (GIL-free, its machine code cached on disk for the next process), used by
``kdn.codec.rans`` and ``kdn.codec.gpu_plan`` for every kernel.

numba caches next to the module (``__pycache__``), else under ``NUMBA_CACHE_DIR`` or the user's
cache home; where none is writable (kdn installed read-only, a service user with
``HOME=/nonexistent``, a read-only root filesystem) ``cache=True`` raises RuntimeError 'cannot
cache function ...: no locator available' as the module is imported. Such a kernel is compiled
without the cache: at its first call in each process, as it would be the first time anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba


def kernel(fn: Callable[..., Any]) -> Any:
    """``fn`` compiled by numba in nopython mode, releasing the GIL; cached on disk where numba
    has somewhere to write its cache."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError as e:
        if "cannot cache function" not in str(e):
            raise
        return numba.njit(nogil=True)(fn)
