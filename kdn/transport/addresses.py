"""Whether an address keeps traffic on this machine: the server's listening host (plaintext
without an API key is refused elsewhere) and the client's target (same host: the shared-memory
data plane). ``host_problem`` and ``address_problem`` say why a host or a target cannot be
dialled or listened on (a byte that is not UTF-8, decoded into a lone surrogate, which gRPC and
getaddrinfo's IDNA codec fail on with a raw UnicodeError); ``listen_host`` checks a server's."""

from __future__ import annotations

import ipaddress

from kdn.errors import ConfigError


def host_problem(host: str) -> str | None:
    """Why ``host`` names no host (text IDNA cannot encode: a lone surrogate, an empty or a
    too long label), or None. ASCII names, IP addresses and Unicode names (``例え.jp``) pass."""
    try:
        host.encode("idna")
    except UnicodeError as exc:
        reason = str(exc.__cause__ or exc).removeprefix("UnicodeError: ")
        return f"host {host!r} is not a host name a resolver takes ({reason})"
    return None


def address_problem(address: str) -> str | None:
    """Why the gRPC target ``address`` cannot be dialled (text UTF-8 cannot encode, a host
    ``host_problem`` refuses), or None; the port and the rest are its callers' to check."""
    try:
        address.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"address {address!r}: {address[exc.start:exc.end]!r} at character {exc.start} "
                "is a lone surrogate, not text (a byte that is not UTF-8?)")
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    return next(filter(None, map(host_problem, _target_hosts(address) or ())), None)


def listen_host(host: str, name: str) -> str:
    """The server option ``name``'s ``host`` without brackets (``[::1]``, as in an address,
    is ``::1``); ConfigError when ``host_problem`` refuses it."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if problem := host_problem(host):
        raise ConfigError(f"{name}: {problem}")
    return host


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
