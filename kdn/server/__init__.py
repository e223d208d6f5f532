"""Server side of kdn: config, the gRPC servicer and the process that runs it.

The names below are imported on first use (PEP 562), so ``import kdn.server.config`` (what
``kdn --help`` and ``kdn serve --help`` need) loads neither grpc nor the servicers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdn.lazy import lazy_exports

if TYPE_CHECKING:
    from kdn.server.app import Server, ServerThread, build_store, serve, start_server
    from kdn.server.config import ServerConfig, load_config

_HOME = {
    "Server": "kdn.server.app", "ServerThread": "kdn.server.app", "build_store": "kdn.server.app",
    "serve": "kdn.server.app", "start_server": "kdn.server.app",
    "ServerConfig": "kdn.server.config", "load_config": "kdn.server.config",
}

__all__ = ["Server", "ServerConfig", "ServerThread", "build_store", "load_config", "serve",
           "start_server"]


__getattr__, __dir__ = lazy_exports(__name__, _HOME, __all__)
