"""Server side of kdn: config, the gRPC servicer and the process that runs it."""

from kdn.server.app import Server, ServerThread, build_store, serve, start_server
from kdn.server.config import ServerConfig, load_config

__all__ = ["Server", "ServerConfig", "ServerThread", "build_store", "load_config", "serve",
           "start_server"]
