"""kdn: a knowledge delivery network for LLMs.

Stores the KV caches a model computed for a text, keyed by a hash of that text, and gives them
back to engines so they skip the prefill. See README.md for the architecture.

The names below are imported on first use (PEP 562), so ``import kdn.layout``, ``kdn.codec``,
``kdn.keys`` or ``kdn.errors`` loads neither grpc nor the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdn.lazy import lazy_exports

if TYPE_CHECKING:
    from kdn import keys
    from kdn.cache import KVCache
    from kdn.client import AsyncClient, Client, Retry
    from kdn.client.blend import RemotePiece
    from kdn.client.rpc import TLSOptions
    from kdn.errors import KDNError
    from kdn.layout import DType, KVLayout, LayerLayout, RopeSpec
    from kdn.options import Durability, StoreOptions

__version__ = "0.1.0"

_HOME = {
    "AsyncClient": "kdn.client", "Client": "kdn.client", "Retry": "kdn.client",
    "KVCache": "kdn.cache", "KDNError": "kdn.errors", "DType": "kdn.layout",
    "KVLayout": "kdn.layout", "LayerLayout": "kdn.layout", "RopeSpec": "kdn.layout",
    "Durability": "kdn.options", "StoreOptions": "kdn.options", "keys": "kdn.keys",
    "RemotePiece": "kdn.client.blend", "TLSOptions": "kdn.client.rpc",
}

__all__ = ["AsyncClient", "Client", "DType", "Durability", "KDNError", "KVCache", "KVLayout",
           "LayerLayout", "RemotePiece", "Retry", "RopeSpec", "StoreOptions", "TLSOptions",
           "__version__", "keys"]


__getattr__, __dir__ = lazy_exports(__name__, _HOME, __all__)
