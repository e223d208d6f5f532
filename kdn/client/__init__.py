"""Client side of kdn: ``Client`` (sync), ``AsyncClient`` (asyncio), ``Retry``.

The names load on first use, so ``kdn.client.admin`` and the admin CLI import no torch: the
tensor side (``kdn.client.stream``, ``kdn.cache``) loads on the first tensor store or read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdn.lazy import lazy_exports

if TYPE_CHECKING:
    from kdn.client.aio import AsyncClient
    from kdn.client.client import Client, Fetched, KeyInfo, LookupResult, Retry
    from kdn.client.stream import LayerStream

__all__ = ["AsyncClient", "Client", "Fetched", "KeyInfo", "LayerStream", "LookupResult", "Retry"]

__getattr__, __dir__ = lazy_exports(
    __name__, {**dict.fromkeys(__all__, "kdn.client.client"), "AsyncClient": "kdn.client.aio",
               "LayerStream": "kdn.client.stream"},
    __all__)
