"""Who may own and read a secret file the server is given (the auth file, the TLS private key),
and who may write a file it trusts (the client-CA bundle, the config file).

``check_private`` and ``check_trusted`` run at start-up (``ServerConfig``, ``load_config``);
a refusal is one ``ConfigError`` line naming the file and the fix, which ``kdn serve`` prints
before exiting.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
from pathlib import Path

from kdn.errors import ConfigError

log = logging.getLogger("kdn.server.config")


def _owned_here(name: str, path: Path) -> tuple[os.stat_result, int]:
    """``path``'s status and this server's uid, or ConfigError where a user other than this
    server's or root owns it (that user could rewrite it)."""
    st = path.stat()
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigError(f"{name}: {path} is owned by uid {st.st_uid}, neither this server's "
                          f"user (uid {me}) nor root: that user could rewrite it; run chown "
                          f"{me} {path}")
    return st, me


def check_trusted(name: str, path: Path) -> None:
    """Refuse a file that decides who is who (the client-CA bundle: a CA added to it signs
    certificates a tenants file's ``subjects:`` or ``mtls_role`` make admins; the config file)
    that a user other than the server's own or root may write: one owned by another user, or
    writable by other users, or by a group other than its owner's own (a user-private group,
    as umask 002 systems give each user: named as its owner, the owner's primary group, no
    other member; OpenSSH as Debian builds it accepts the same). Reading it is open to anyone
    (it holds no secret)."""
    st = _owned_here(name, path)[0]
    mode = st.st_mode & 0o777
    if mode & 0o022 and not (mode & 0o002 == 0 and owners_own_group(st.st_uid, st.st_gid)):
        raise ConfigError(f"{name}: {path} can be written by "
                          f"{'other users' if mode & 0o002 else 'its group'} (mode "
                          f"{oct(mode)}), who could rewrite it; its owner should run "
                          f"chmod 644 {path}")


def owners_own_group(uid: int, gid: int) -> bool:
    """Whether group ``gid`` is user ``uid``'s private group, no one else's (see
    ``check_trusted``); False where either is unknown to the system."""
    try:
        owner, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    return (owner.pw_gid == gid and group.gr_name == owner.pw_name
            and not set(group.gr_mem) - {owner.pw_name})


def check_private(name: str, path: Path) -> None:
    """Refuse a secret file (the auth file, the TLS private key) that others may read or write.

    Its owner must be the server's user or root: another user could rewrite it and give
    itself an admin key (a configuration manager writing it runs as root). Any access for
    other users is refused. Access for the file's group is refused too when the file belongs
    to the server's own user, root for a server run as root (the group then serves nobody but
    other users); when root owns it and the server runs as another user
    (as Kubernetes mounts secrets with an ``fsGroup``, or a configuration manager), the group
    is how this server reads it and reading is accepted, as PostgreSQL accepts a root-owned
    key of mode 0640 at most: a group that may write it (or run it) is refused (anyone in it
    could add an admin key of their own).
    """
    st, me = _owned_here(name, path)
    mode = st.st_mode & 0o777
    if mode & 0o007:
        raise ConfigError(f"{name}: {path} can be read by other users (mode {oct(mode)}); "
                          f"run chmod 600 {path}")
    if mode & 0o070 and st.st_uid == me:
        raise ConfigError(f"{name}: {path} can be read by its group (mode {oct(mode)}) though "
                          f"this server's user owns it; run chmod 600 {path}")
    if mode & 0o030:
        raise ConfigError(f"{name}: {path} can be written or run by its group (mode "
                          f"{oct(mode)}); its owner should run chmod 640 {path}")
    if mode & 0o070:
        log.info("%s: %s is read through its group (mode %s, owner uid %d)", name, path,
                 oct(mode), st.st_uid)
