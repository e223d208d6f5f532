"""``AsyncClient``: the asyncio face of ``kdn.client.Client``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kdn.client.client import Client


class AsyncClient:
    """asyncio face of a Client: ``await AsyncClient(client).retrieve(key)``.

    Each method runs the Client's method on a worker thread, so the logic exists once. The
    worker thread's ``last_request_id`` is not the caller's: pass ``request_id`` to correlate.
    """

    def __init__(self, client: Client | str) -> None:
        self.client = client if isinstance(client, Client) else Client(client)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.client, name)
        if not callable(fn):
            return fn

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(fn, *args, **kwargs)

        return call

