"""Whether an address keeps traffic on this machine: the server's listening host (plaintext
without an API key is refused elsewhere) and the client's target (same host: the shared-memory
data plane)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps traffic on this machine."""
    host = host.strip("[]").lower()
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC reads it: an IPv6 address in brackets (``[::1]:50051``; ``::1:50051``
    names another address)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _target_hosts(address: str) -> list[str] | None:
    """The hosts a gRPC target names (``host:port``, ``[v6]:port``, a bare host, behind a
    ``dns:``, ``ipv4:`` or ``ipv6:`` scheme, several in a list), or None for a target naming
    a DNS server of its own (``dns://authority/host:port``: it decides what a name means).
    Unix sockets are the callers' to tell apart."""
    target = address
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            if target.startswith("//"):  # dns://authority/host:port
                authority, _, target = target[2:].partition("/")
                if authority:
                    return None
            break
    if not target:
        return []
    hosts = []
    for part in target.split(","):  # ipv4:a:p,b:p lists several addresses
        if part.startswith("["):
            hosts.append(part[1:part.find("]")] if "]" in part else "")
        elif part.count(":") == 1:
            hosts.append(part.split(":")[0])
        else:
            hosts.append(part)  # no port, or a bare IPv6 address
    return hosts


def data_host(address: str) -> str:
    """The host of the gRPC target ``address`` (the first of a list), where the server's
    network data path listens too; "" for a unix socket or a target naming a DNS server of
    its own."""
    if address.startswith(("unix:", "unix-abstract:")):
        return ""
    hosts = _target_hosts(address)
    return hosts[0] if hosts else ""


def same_host(address: str) -> bool:
    """Whether the gRPC target ``address`` names only this machine: a unix socket, or
    loopback hosts (``localhost``, 127.0.0.0/8, ::1), also behind a ``dns:``, ``ipv4:`` or
    ``ipv6:`` scheme. A name that merely looks local (``127.0.0.1.example.com``) is not."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    hosts = _target_hosts(address)
    return bool(hosts) and all(is_loopback(h) for h in hosts or ())
