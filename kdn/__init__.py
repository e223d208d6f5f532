"""kdn: a knowledge delivery network for LLMs.

Stores the KV caches a model computed for a text, keyed by a hash of that text, and gives them
back to engines so they skip the prefill. See README.md for the architecture.
"""

from kdn import keys
from kdn.cache import KVCache
from kdn.client import AsyncClient, Client, Retry
from kdn.errors import KDNError
from kdn.layout import DType, KVLayout, LayerLayout, RopeSpec

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "DType", "KDNError", "KVCache", "KVLayout", "LayerLayout",
           "Retry", "RopeSpec", "__version__", "keys"]
