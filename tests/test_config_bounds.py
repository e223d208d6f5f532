"""Server settings past what their parts hold, refused by name before ``kdn serve`` starts
(``load_config``): a huge count or timeout passed "> 0, finite" and broke deep inside redis-py;
an empty metrics host or a setting's variable in another case; and a metrics host that is not
this machine's, named at start as such (``tests.test_config_cli``: the other settings)."""

from __future__ import annotations

import socket

import pytest

from kdn.errors import ConfigError
from kdn.server.config import load_config
from kdn.server.observe import Metrics


@pytest.mark.parametrize("source,match", [
    # redis-py's pool filled memory with 1e12 slots at start; 1e10 s overflowed its sockets
    # (a traceback at start; with 1e300 s of WAIT, every store failed INTERNAL)
    ({"flags": {"redis_max_connections": str(10**12)}}, "redis_max_connections must be a "
                                                        "whole number in 1..65536"),
    ({"flags": {"redis_timeout_s": "1e10"}}, "redis_timeout_s must be a number > 0 and at "
                                             "most 86400 seconds"),
    ({"env": {"KDN_REDIS_WAIT_TIMEOUT_S": "1e300"}}, "redis_wait_timeout_s must be a number"),
    ({"flags": {"redis_wait_timeout_s": "0"}}, "redis_wait_timeout_s must be a number > 0"),
    ({"env": {"KDN_METRICS_HOST": ""}}, "metrics_host: must not be empty"),  # (blamed the port)
    # a setting's name in another case: with KDN_PORT beside it, the environment's order won
    ({"env": {"KDN_port": "3333"}}, "$KDN_port: no such setting; did you mean KDN_PORT?"),
    ({"env": {"KDN_PORT": "2222", "KDN_Port": "3333"}}, "$KDN_Port: no such setting"),
])
def test_settings_past_their_bounds_are_named(source: dict, match: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=source.get("env", {}), flags=source.get("flags"))
    assert match in str(info.value)
    assert load_config(env={}, flags={"redis_max_connections": "65536",
                                      "redis_timeout_s": "86400"}).redis_max_connections == 65536


def test_a_metrics_host_not_of_this_machine_is_named_not_the_port() -> None:
    """It said 'can not listen on the metrics port ...; pick another with --metrics-port'."""
    with pytest.raises(OSError, match="metrics host '192.0.2.1'.*--metrics-host"):
        Metrics(dict).serve_http("192.0.2.1", 0)  # TEST-NET-1: no machine's own address
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="metrics port .*--metrics-port"):
            Metrics(dict).serve_http("127.0.0.1", taken.getsockname()[1])
