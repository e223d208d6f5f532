"""The read arena's directory: where a same-host client finds an entry without a call.

A tenant's read arena (``kdn.server.arena``) lists the entries it holds in a table at its
start, so that a client that maps the arena (``kdn.client.shm.LeasedArena``) reads a small
entry it never read before with no call at all: a 4 KiB read is then a hash, a few loads and
a copy, where a call costs two Python stacks and a socket round trip.

Layout (little-endian u64 words; the arena's first page is its header):

- header word 1: ``MAGIC`` (a directory follows; an arena without it has none);
- header word 2: the directory's byte offset in the arena; word 3: its number of sets (a power
  of two);
- the directory: ``sets`` sets of ``WAYS`` buckets of ``BUCKET_WORDS`` words each:
  ``generation, tag0, tag1, start, offset, length`` and two spare words.

A bucket lists one slot: its ``generation`` is the slot's (``kdn.server.arena``: unique in the
arena, written at the slot's first byte ``start`` while the slot is the key's copy), 0 while
the bucket is empty or being written. ``tag0, tag1`` name the entry (``tag``: its namespace and
key; the arena is one tenant's). A key's set is ``tag0 % sets``.

Why a read never returns a value the server no longer holds, nor a torn one: the server
writes a bucket's generation last, and zeroes it and the slot's word before the slot is dropped
(the key written again, deleted, evicted), under the key's lock, before the call that changed
the key answers; a slot's pages are reused only after that. A reader (``find``) checks the
slot's word against the bucket's generation before it copies the entry and checks both again
after; the copy is then the slot's bytes, whole, and the slot was the key's value all along.
Entries with a time to live are never listed (their expiry would pass unseen).

That argument needs each process's stores seen by the other in the order they were made, and
loads kept in order: x86-64's total store order gives both, and Python reaches no memory
barrier to give them elsewhere. So clients read the directory on x86-64 only
(``ORDERED_STORES``); elsewhere every read asks the server. A hash of the copy would not do
instead: a bucket read half old, half new can name another key's entry, whole and intact."""

from __future__ import annotations

import hashlib
import platform
from typing import Any

import numpy as np

from kdn.transport.regions import ALIGN

ORDERED_STORES = platform.machine().lower() in {"x86_64", "amd64"}
"""Whether this machine keeps stores and loads in order across processes (module docstring)."""
MAGIC = 0x6B646E2D64697201
"""Header word 1 of an arena with a directory (``kdn-dir`` and the format's version)."""
HEADER_MAGIC, HEADER_OFFSET, HEADER_SETS = 1, 2, 3
WAYS = 4
BUCKET_WORDS = 8
BUCKET_BYTES = BUCKET_WORDS * 8
ENTRY_BYTES = 8 << 10
"""Arena bytes per bucket: a small entry takes two pages of the arena (its word, header and
body), so the directory can list every small entry the arena holds."""
SHARE = 64
"""An arena keeps a directory where it takes at most 1/SHARE of it (256 KiB arenas on)."""
_MASK = (1 << 64) - 1


def tag(namespace: str, key: bytes) -> tuple[int, int]:
    """The two words that name ``key`` of ``namespace`` in a directory (never (0, 0))."""
    d = hashlib.blake2b(namespace.encode() + b"/" + key, digest_size=16,
                        person=b"kdn-directory").digest()
    t0, t1 = int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")
    return (t0, t1) if t0 or t1 else (1, 0)


def geometry(arena_bytes: int, page: int) -> tuple[int, int]:
    """(offset, sets) of the directory of an arena of ``arena_bytes``: right after its header
    page, as many buckets as ``ENTRY_BYTES`` fit in the arena (a power of two of sets, 16 at
    least)."""
    sets = 16
    while sets * 2 * WAYS * ENTRY_BYTES <= arena_bytes:
        sets *= 2
    return page, sets


def directory_bytes(sets: int, page: int) -> int:
    """The directory's bytes, whole pages."""
    n = sets * WAYS * BUCKET_BYTES
    return (n + page - 1) // page * page


def read_geometry(words: Any, size: int) -> tuple[int, int] | None:
    """(first word, sets) of the directory an arena's header announces; None when it has none
    or what it says does not fit the arena (``words``: the arena as u64 words)."""
    if len(words) < 4 or int(words[HEADER_MAGIC]) != MAGIC:
        return None
    offset, sets = int(words[HEADER_OFFSET]), int(words[HEADER_SETS])
    if offset % BUCKET_BYTES or sets <= 0 or sets & (sets - 1) or \
            offset + sets * WAYS * BUCKET_BYTES > size:
        return None
    return offset // 8, sets


def find(words: Any, source: Any, first: int, sets: int, name: tuple[int, int],
         size: int) -> tuple[memoryview, int] | None:
    """A copy of the entry the directory lists under ``name`` (``tag``), read as the module
    docstring says, and its slot's generation; None when it lists none or the entry changed
    while it was read.
    ``words`` and ``source``: the arena as u64 words and as bytes; ``first``, ``sets``: the
    directory (``read_geometry``)."""
    t0, t1 = name
    base = first + (t0 & (sets - 1)) * WAYS * BUCKET_WORDS
    for b in range(base, base + WAYS * BUCKET_WORDS, BUCKET_WORDS):
        gen, w0, w1, start, offset, length = words[b : b + 6].tolist()
        if not gen or w0 != t0 or w1 != t1:
            continue
        if start % 8 or start + 8 > size or length <= 0 or offset + length > size:
            return None
        at = start // 8
        if int(words[at]) != gen:
            return None
        room = np.empty(length + ALIGN, dtype=np.uint8)  # aligned as in the arena: the
        skew = (offset - room.ctypes.data) % ALIGN  # frames are viewed in place
        np.copyto(room[skew : skew + length], source[offset : offset + length])
        if int(words[at]) != gen or int(words[b]) != gen:
            return None
        return memoryview(room)[skew : skew + length], gen  # type: ignore[arg-type]
    return None


def list_slot(words: Any, first: int, sets: int, name: tuple[int, int], generation: int,
              start: int, offset: int, length: int, way: int) -> int:
    """Write the bucket of ``name`` (a slot of ``generation`` at ``start``, its entry
    [offset, offset + length)) into way ``way`` of its set, generation last; the bucket's word
    index."""
    t0, t1 = name
    b = first + ((t0 & (sets - 1)) * WAYS + way) * BUCKET_WORDS
    words[b] = 0
    words[b + 1 : b + 6] = [t0, t1, start, offset, length]
    words[b] = generation & _MASK
    return b


def ways_of(words: Any, first: int, sets: int, name: tuple[int, int]) -> list[int]:
    """The bucket word indices of ``name``'s set, in way order."""
    base = first + (name[0] & (sets - 1)) * WAYS * BUCKET_WORDS
    return [base + w * BUCKET_WORDS for w in range(WAYS)]
