"""Which ``KDN_*`` environment variables are kdn's: a server setting (``KDN_`` plus its name in
capitals), one of ``OTHER_VARIABLES`` (read by clients, the CLI and the scripts), or a
variable Kubernetes wrote for a Service named ``kdn`` (``kubernetes_link``). Any other one is
refused as a misspelling (``check_variables``), so a typo is not quietly ignored.

Kubernetes' service links: a pod gets, for every Service of its namespace (unless its spec
says ``enableServiceLinks: false``), Docker-link variables named after the Service: for
``kdn``, ``KDN_SERVICE_HOST``, ``KDN_SERVICE_PORT[_<PORT NAME>]``, ``KDN_PORT=tcp://IP:PORT``
and ``KDN_PORT_<N>_TCP[_PROTO|_PORT|_ADDR]``. They are not settings: skipped, and
``KDN_PORT`` of that form replaces the image's port number, so it is not taken as the port
(``load_config`` warns of it, naming ``enableServiceLinks: false``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping

from kdn.errors import ConfigError

OTHER_VARIABLES = frozenset({
    "KDN_ADDRESS", "KDN_API_KEY", "KDN_FLEET",     # clients and the admin CLI
    "KDN_RAG_STATE", "KDN_CACHE_DIR",              # kdn rag, the model cache
    "KDN_TORCH_INDEX", "KDN_BOOTSTRAP_DRY_RUN",    # scripts/bootstrap.sh
    "KDN_TORCH_SPEC", "KDN_EXTRAS", "KDN_SKIP_SLIM", "KDN_PEERS_REEXEC",  # scripts, tests
    "KDN_MALLOC_TUNING", "KDN_REAL_KV",           # the allocator's tuning, GPU checks' KV
})
"""``KDN_*`` variables that are not server settings (any other one is refused as a typo)."""

_LINK_NAME = re.compile(r"^KDN_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?"
                        r"|PORT_[0-9]+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)$")
_LINK_URL = re.compile(r"^(tcp|udp|sctp)://[^\s/]+:[0-9]+$")
LINKS_HINT = ("Kubernetes' service link of a Service named kdn; set enableServiceLinks: false "
              "in the pod's spec")


def kubernetes_link(name: str, value: str) -> bool:
    """Whether ``name=value`` is a variable Kubernetes sets for a Service named ``kdn``:
    ``KDN_SERVICE_HOST``, ``KDN_PORT_50051_TCP_ADDR``, ..., or ``KDN_PORT=tcp://IP:PORT``."""
    if name == "KDN_PORT":
        return bool(_LINK_URL.match(value.strip()))
    return bool(_LINK_NAME.match(name))


def check_variables(env: Mapping[str, str], settings: Iterable[str]) -> None:
    """Refuse a ``KDN_*`` variable of ``env`` that is neither one of ``settings`` (as
    ``KDN_<NAME>``, in capitals: ``KDN_port`` beside ``KDN_PORT`` was the environment's order
    deciding), one of ``OTHER_VARIABLES`` nor a Kubernetes service link, naming the
    nearest one."""
    known = set(settings)
    for k in sorted(env):
        if not k.startswith("KDN_") or k in OTHER_VARIABLES or kubernetes_link(k, env[k]) \
                or k[4:].lower() in known and k[4:].isupper():  # KDN_port: not KDN_PORT's
            continue
        names = sorted(known | {v[4:].lower() for v in OTHER_VARIABLES})
        near = difflib.get_close_matches(k[4:].lower(), names, n=1)
        hint = f"did you mean KDN_{near[0].upper()}? " if near else ""
        raise ConfigError(f"${k}: no such setting; {hint}`kdn serve --help` lists them "
                          "(each is KDN_ plus its name in capitals)")
