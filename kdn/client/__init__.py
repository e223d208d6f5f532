"""Client side of kdn: ``Client`` (sync), ``AsyncClient`` (asyncio), ``Retry``."""

from kdn.client.client import AsyncClient, Client, Fetched, KeyInfo, LookupResult, Retry

__all__ = ["AsyncClient", "Client", "Fetched", "KeyInfo", "LookupResult", "Retry"]
