"""The open-files limit of a ``kdn serve`` process.

Every connection the server holds is a descriptor, and the soft ``RLIMIT_NOFILE`` most shells
and systemd units start a process with (1,024) is below what the default bounds let clients
hold: gRPC's ``max_connections``, the data paths' admitted and pending connections, Redis pools
and the metrics port (``descriptors_needed``). Past it a new client is not refused but left
waiting (its call ends DEADLINE_EXCEEDED) with nothing logged. ``raise_nofile`` lifts the soft
limit to the hard one when ``kdn serve`` starts (``kdn.server.app.serve``: a server inside
another program's process, ``ServerThread``, leaves that program's limits alone) and warns
where the limit is still short.
"""

from __future__ import annotations

import logging
import resource

from kdn.server import metrics_http, netpath
from kdn.server.config import ServerConfig
from kdn.server.fastpath import MAX_PENDING, FastPath

log = logging.getLogger("kdn.server")
SPARE_FDS = 256
"""Descriptors beyond the connections: the disk tier's files, logs, the event loop, pipes."""


def descriptors_needed(config: ServerConfig) -> int:
    """Descriptors the configured bounds let the server hold at once (with gRPC's
    ``max_connections`` 0, no bound: counted as the default 1,024)."""
    need = (config.max_connections or 1024) + FastPath.max_connections + 2 * MAX_PENDING
    if config.data_port >= 0:
        need += netpath.MAX_CONNECTIONS + 2 * MAX_PENDING
    if config.metrics_port >= 0:
        need += metrics_http.MAX_CONNECTIONS + 1
    if config.redis_url:
        need += config.redis_max_connections
    return need + SPARE_FDS


def raise_nofile(config: ServerConfig) -> int:
    """Raise this process's soft open-files limit to its hard one (to what the bounds need
    where the hard one is unlimited); warns where it stays below ``descriptors_needed``. The
    soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = descriptors_needed(config)
    want = max(soft, need) if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:  # (a kernel's nr_open below an unlimited hard)
            log.debug("open files: the soft limit stays %d (%s)", soft, exc)
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("open files: the limit is %d (hard %s), below the %d descriptors this "
                    "server's connection bounds may hold (max_connections %d, the data paths, "
                    "%d spare): clients past it wait and time out; raise it (ulimit -n, "
                    "systemd LimitNOFILE=) or lower max_connections", soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard, need,
                    config.max_connections, SPARE_FDS)
    return soft
