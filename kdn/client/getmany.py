"""A GetMany answer's entries as ``Fetched`` (``kdn.client.received``), for the data plane's
reads (``kdn.client.dataplane.DataPlane.get_many`` / ``get_one``).

* ``place``: hand out one answer's entries from where the answer put them: a lease of the
  server's read arena (a copy-on-write view, kept for later reads when the answer gives a
  generation), a region of the client's shared segment (an owned view), or the answer's own
  bytes (inline); and say which were not written (no room: asked again, with their sizes).
* ``inline_entry``: an entry the answer carries inline (a small one asked for through the
  segment), its length checked.
* ``listed_entry``: an entry the read arena's directory lists (``kdn.transport.directory``),
  copied out of the arena with no call, where it is what was asked for.

They take the segment and the arena as they are and call nothing on the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kdn.client.received import Fetched, fetched
from kdn.codec import EncodedParts
from kdn.codec.format import parse_container
from kdn.errors import Corrupt, KDNError, LayoutMismatch, Unavailable
from kdn.layout import Expected
from kdn.v1 import kdn_pb2 as pb


class Placed(NamedTuple):
    """What ``place`` made of one GetMany answer."""

    entries: dict[int, Fetched]
    """The entries handed out, by index in the caller's keys."""
    again: list[int]
    """Entries present but not written (no room): to ask again."""
    sizes: list[int]
    """Their lengths, in the order of ``again``."""
    used: int
    """End of the region's used part (the rest of it may be freed)."""


def inline_entry(ref: pb.EntryRef) -> Fetched:
    """The entry a GetMany answer carries inline in ``ref`` (a small one asked for through the
    segment); Corrupt when its bytes are not the length the answer says."""
    if ref.length != len(ref.data):
        raise Corrupt(f"GetMany answered {len(ref.data)} bytes inline for an entry of "
                      f"{ref.length}")
    return fetched(ref.data, ref.tier, checked=ref.verified, whole=True)


def listed_entry(arena: Any, namespace: str, key: bytes, want: Expected) -> Fetched | None:
    """``key``'s entry where the read arena's directory lists it (``LeasedArena.find``: no
    call) and it is what is asked for (its layout, its tokens); None where it is not listed,
    or it does not check out (the server then answers: a mismatch as the error it is)."""
    found = arena.find(namespace or "default", key)
    if found is None:
        return None
    got, generation = found
    try:
        c = parse_container(got, verify=False)  # checked by the server as it was copied in
    except KDNError:
        return None
    try:
        want.check(c.header.layout, c.header.entry.tokens)
    except LayoutMismatch:
        return None
    arena.served(generation)
    return Fetched(EncodedParts(c.header.raw, list(c.frames)), "ram",  # type: ignore[arg-type]
                   True, True, c.header, got)


def place(resp: pb.GetManyResponse, todo: list[int], names: tuple[str, Expected],
          keys: Sequence[bytes], seg: Any, block: tuple[int, int] | None, arena: Any,
          unviewed: set[int], pinned: bool = False) -> Placed:
    """Hand out the entries of ``resp``, the answer for the keys ``todo`` (indices into
    ``keys``). ``names``: the namespace and what was asked of the entries (a kept lease
    answers only reads that ask the same); ``seg``/``block``: the segment and the region the
    call named (None: inline); ``arena``: the read arena where leases were asked for; each
    lease viewed is taken out of ``unviewed`` (the caller gives the rest back). ``pinned``:
    leased entries are viewed through the arena's mapping registered with CUDA. Corrupt
    when the answer holds more or fewer entries than keys asked for (which entry is whose is
    then not known), or places one where it can not be. The part of the region not handed
    out is the caller's to free (from ``Placed.used``) when this returns; where it raises,
    it is freed here (the server answered: it is done with the region)."""
    namespace, want = names
    used = block[0] if block is not None else 0
    entries: dict[int, Fetched] = {}
    again: list[int] = []
    sizes: list[int] = []
    try:
        if len(resp.entries) != len(todo):
            raise Corrupt(f"GetMany answered {len(resp.entries)} entries for {len(todo)} keys")
        for i, ref in zip(todo, resp.entries):
            if not ref.present:
                continue
            if not ref.written:
                again.append(i)
                sizes.append(ref.length)
                continue
            if ref.lease:
                if arena is None:
                    raise Corrupt("GetMany answered with a lease this client did not ask for")
                if ref.generation:  # kept before it is viewed: its views then never free it
                    arena.keep((namespace, keys[i], want), ref.lease, ref.offset,
                               ref.length, ref.generation_at, ref.generation, ref.tier)
                try:
                    view = arena.view(ref.lease, ref.offset, ref.length, pinned=pinned)
                except ValueError as exc:
                    if arena.closed:  # the server restarted while this call was answered
                        raise Unavailable(f"GetMany: {exc}") from None
                    raise Corrupt(f"GetMany: {exc}") from None
                unviewed.discard(ref.lease)
                entries[i] = fetched(view, ref.tier, True, ref.verified, pinned=view.readonly)
            elif seg is not None and len(ref.data):  # small, in the answer (``SMALL_ENTRY_BYTES``)
                entries[i] = inline_entry(ref)
            elif seg is not None and block is not None:
                if ref.offset < used or ref.offset + ref.length > block[0] + block[1]:
                    raise Corrupt(f"GetMany placed an entry at [{ref.offset}, "
                                  f"{ref.offset + ref.length}), outside the free part "
                                  f"[{used}, {block[0] + block[1]}) of its region")
                entries[i] = fetched(seg.owned(ref.offset, ref.length, used), ref.tier, True,
                                     ref.verified)
                used = (ref.offset + ref.length + 63) // 64 * 64
            else:
                entries[i] = fetched(ref.data, ref.tier, whole=True)
    except BaseException:
        if seg is not None and block is not None:
            seg.regions.free(used, block[0] + block[1] - used)
        raise
    return Placed(entries, again, sizes, used)
