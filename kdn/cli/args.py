"""argparse types for names (the rules of ``kdn.names``): a malformed namespace, tenant or key
on the command line is a usage error (exit 2, the rule in the message), not a server call."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kdn.errors import InvalidArgument
from kdn.names import check_namespace, check_tenant, parse_hex_key, parse_hex_prefix


def name_type(check: Callable[[str], object], what: str, *, empty: bool = False
              ) -> Callable[[str], str]:
    """An argparse ``type`` that checks the argument with ``check`` and returns it unchanged;
    with ``empty`` "" passes too (a filter that means "all")."""

    def parse(text: str) -> str:
        if empty and text == "":
            return text
        try:
            check(text)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    parse.__name__ = what  # argparse names the type in its messages
    return parse


NAMESPACE = name_type(check_namespace, "namespace")
NAMESPACE_FILTER = name_type(check_namespace, "namespace", empty=True)
TENANT_FILTER = name_type(check_tenant, "tenant", empty=True)
HEX_KEY = name_type(parse_hex_key, "key")
HEX_PREFIX = name_type(parse_hex_prefix, "key prefix", empty=True)
