"""The write side of ``kdn.client.Client``: stores of one entry or many, asynchronous stores,
staged entries, and the messages of a Store / StoreMany stream.

A store encodes here (unless given an encoded or staged entry) and goes through the data plane
(``kdn.client.dataplane``: PutMany through the shared segment on the server's host, the network
data path on another, else inline gRPC), or as a Store stream (its header, then each frame in
the message the encoder wrote it in, ``encode_parts(wire=True)``: sent as it is, no copy). A
remote ``store_many`` sends a batch's entries of ``STREAM_ENTRY_BYTES`` or more (or more than
an inline PutMany carries, even one) by one StoreMany stream, before the rest (a whole batch
where the inline calls can't carry it and nothing else took it): entries one after another in
that form, or grouped for a server that said it reads that form
(``StoreManyResponse.reads_grouped``): every entry's header in one message, then every entry's
frames, each entry's ``total_bytes`` telling the server where its frames end. Every entry
stored is kept in the in-process tier, where there is one, once the server took it, and only
where the tier's order says it is what the server holds (``kdn.client.local``: each store is a
``LocalTier.write`` begun before it is sent).

Staged entries (``kdn.client.staged``) in the client's segment are stored by where they lie
(PutMany items the server seals on its copy); the others are sealed here and sent as any entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from kdn import codec
from kdn.client.dataplane import BATCH_BYTES, STREAM_ENTRY_BYTES, TOO_BIG, DataPlane, TooBig
from kdn.client.deadline import time_left
from kdn.client.entries import (
    check_encoded,
    check_encoding,
    check_entry,
    check_items,
    check_options,
    is_kv,
    is_staged,
)
from kdn.client.pending import PendingStore, Refused
from kdn.client.rpc import Rpc, traced
from kdn.client.shm import unanswered
from kdn.codec import EncodedParts
from kdn.codec.format import parse_header
from kdn.errors import Closed, Corrupt, InvalidArgument, KDNError, Status, TooLarge, again
from kdn.keys import check_key, check_namespace
from kdn.layout import KVLayout
from kdn.names import MAX_CALL_KEYS
from kdn.options import StoreOptions
from kdn.transport.wire import frame_message
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:
    from kdn.cache import KVCache
    from kdn.client.staged import Staged


class Writer:
    """``Client``'s writes (module docstring): ``rpc`` its channel, ``dataplane`` its batches,
    ``local`` its in-process tier (or None), ``namespace`` the default namespace,
    ``max_message_bytes`` the largest message the channel carries."""

    def __init__(self, rpc: Rpc, dataplane: DataPlane, local: Any, namespace: str,
                 max_message_bytes: int) -> None:
        self.rpc = rpc
        self.dataplane = dataplane
        self.local = local
        self.namespace = namespace
        self.max_message_bytes = max_message_bytes
        self._store_many_ok = True  # False once a server answered UNIMPLEMENTED (older)
        self._store_many_grouped = False  # True once a server said it reads grouped StoreMany
        self._refused = Refused()

    def _ns(self, namespace: str | None) -> str:
        return check_namespace(namespace or self.namespace)

    def writing(self, namespace: str, key: bytes, opts: pb.StoreOptions) -> Any:
        """The in-process tier's ``LocalWrite`` of a store of ``key`` with ``opts`` about to
        be sent (its copy there goes now; ``keep`` once stored, ``end`` once answered), or
        ``NOT_KEPT`` without a tier."""
        return NOT_KEPT if self.local is None else \
            self.local.write(namespace, key, opts.ttl_seconds)

    @traced("kdn.client.store")
    def store(
        self,
        key: bytes,
        kv: KVCache | EncodedParts | Staged,
        *,
        mode: str = "lossless",
        level: str = "",
        namespace: str | None = None,
        options: StoreOptions | None = None,
        layers_per_frame: int = 0,
        request_id: str | None = None,
    ) -> pb.StoreResponse:
        """Store ``kv`` (encoded here with ``mode``/``level`` unless already encoded); TTL, pin
        and durability come from ``options`` (defaults: ``StoreOptions()``). Frames hold
        ``layers_per_frame`` layers, or with 0 enough to fill ``codec.FRAME_TARGET_BYTES``."""
        key, kv, options = check_key(key), check_entry(kv), check_options(options)
        check_encoding(mode, level, layers_per_frame)
        if is_staged(kv):
            return self._store_staged(self._ns(namespace), [(key, kv)], options, request_id)[0]
        st = self._written_staged(kv, mode, level, layers_per_frame)
        if st is not None:  # the tensors copied straight into the segment: stored from there
            try:
                return self._store_staged(self._ns(namespace), [(key, st)], options,
                                          request_id)[0]
            finally:
                st.close()
        parts = encoded(kv, mode, level, layers_per_frame)
        opts = wire_options(options)
        ns = self._ns(namespace)
        with self.writing(ns, key, opts) as write:
            if self.dataplane.direct:  # through the shared segment (same host) or data path
                done = self.dataplane.put_many(ns, [(key, parts, opts)], request_id)[0]
                if not isinstance(done, TooBig):
                    write.keep(parts)
                    return done
            self._check_frames(parts)
            md = self.rpc.metadata(request_id)
            resp = self.rpc.call(lambda: self.rpc.store_call(
                store_messages(ns, key, parts, opts), timeout=time_left(self.rpc.timeout_s),
                metadata=md))
            write.keep(parts)
            return resp

    def _check_frames(self, parts: EncodedParts) -> None:
        """Refuse, before sending anything, a frame that can not travel in one message."""
        limit = self.max_message_bytes - 1024  # the message's own fields
        for i, frame in enumerate(parts.frames):
            if len(frame) > limit:
                raise TooLarge(
                    f"frame {i} is {len(frame)} bytes, more than one message may carry "
                    f"({self.max_message_bytes} bytes: Client(max_message_bytes=...) and the "
                    "server's max_message_bytes); store fewer tokens per entry (e.g. "
                    "EngineConfig.chunk_tokens) or raise both limits")


    @traced("kdn.client.store_many")
    def store_many(self, items: Sequence[tuple[bytes, KVCache | EncodedParts | Staged]], *,
                   mode: str = "lossless", level: str = "", namespace: str | None = None,
                   options: StoreOptions | None = None, layers_per_frame: int = 0,
                   request_id: str | None = None) -> list[pb.StoreResponse]:
        """Store many entries in as few calls as fit (see ``fetch_many``): through the shared
        segment on the server's host, else entries of ``STREAM_ENTRY_BYTES`` or more in one
        StoreMany stream (a message a frame) and the rest inline (PutMany, many a message).
        Each call's items are all checked before any is stored, those encoded elsewhere here
        (``check_encoded``) before the first of several calls: a bad item raises and stores
        none of them. A later call the server refuses for what it alone knows (quota, room,
        ``max_entry_bytes``) leaves the earlier calls' entries stored."""
        ns = self._ns(namespace)
        # every item checked before anything is written or sent
        items, options = check_items(items), check_options(options)
        check_encoding(mode, level, layers_per_frame)
        if len(items) > 1:  # checked whole: the batch may go in several calls
            check_encoded(items)
        if len(items) > 1 and self.dataplane.same_host.fast and all(
                self._writable(kv, mode, level, layers_per_frame) is not None
                for _, kv in items):  # every one validated before any is written
            done = self._store_kv_pipelined(ns, items, options, request_id)
            if done is not None:
                return done
        written: list[Staged] = []  # KV written straight into the segment (``_written_staged``)
        try:
            mine: list[tuple[bytes, KVCache | EncodedParts | Staged]] = []
            for k, kv in items:
                st = self._written_staged(kv, mode, level, layers_per_frame)
                if st is not None:
                    written.append(st)
                mine.append((k, kv if st is None else st))
            return self._store_many(mine, mode, level, ns, options, layers_per_frame,
                                    request_id)
        finally:
            for st in written:
                st.close()

    def _store_many(self, items: Sequence[tuple[bytes, KVCache | EncodedParts | Staged]],
                    mode: str, level: str, ns: str, options: StoreOptions | None,
                    layers_per_frame: int, request_id: str | None) -> list[pb.StoreResponse]:
        staged = [j for j, (_, kv) in enumerate(items) if is_staged(kv)]
        if staged:  # sent where they lie; the rest as below, each encoded before any is sent
            rest = [j for j, (_, kv) in enumerate(items) if not is_staged(kv)]
            encoded_rest = [(items[j][0], encoded(items[j][1], mode, level, layers_per_frame))
                            for j in rest]  # one the codec refuses raises with none stored
            out: list[pb.StoreResponse | None] = [None] * len(items)
            done_staged = self._store_staged(ns, [items[j] for j in staged],  # type: ignore[misc]
                                             options, request_id)
            for j, r in zip(staged, done_staged):
                out[j] = r
            for j, r in zip(rest, self._store_many(
                    encoded_rest, mode, level, ns, options, layers_per_frame,
                    request_id) if rest else []):
                out[j] = r
            return out  # type: ignore[return-value]
        opts = wire_options(options)
        enc = [(check_key(k), encoded(kv, mode, level, layers_per_frame), opts)
               for k, kv in items]
        writes = [self.writing(ns, k, o) for k, _, o in enc]
        try:
            return self._stored_many(ns, enc, self._sent_many(ns, enc, request_id), writes,
                                     options, request_id)
        finally:
            for write in writes:
                write.end()

    def _sent_many(self, ns: str, enc: list[tuple[bytes, EncodedParts, pb.StoreOptions]],
                   request_id: str | None) -> list[pb.StoreResponse | TooBig]:
        """``enc`` sent in batches (``_store_many``): each one's answer, or TooBig where no
        batch carried it."""
        most = min(STREAM_ENTRY_BYTES - 1, self.dataplane.put_inline_most)
        large = [j for j, (_, parts, _) in enumerate(enc)
                 if parts.nbytes > most] if not self.dataplane.direct else []
        if large and len(enc) > 1 and self._store_many_ok:  # remote: large entries stream
            streamed = self._store_streamed(ns, [enc[j] for j in large], request_id)
            if streamed is not None:
                rest = sorted(set(range(len(enc))) - set(large))
                done_rest = self.dataplane.put_many(ns, [enc[j] for j in rest], request_id)
                done: list[pb.StoreResponse | TooBig] = [TOO_BIG] * len(enc)
                for j, r in zip(large, streamed):
                    done[j] = r
                for j, r2 in zip(rest, done_rest):
                    done[j] = r2
                return done
        done = self.dataplane.put_many(ns, enc, request_id)
        if len(enc) > 1 and self._store_many_ok and all(isinstance(r, TooBig) for r in done):
            streamed = self._store_streamed(ns, enc, request_id)  # none sent: all in one
            if streamed is not None:
                return list(streamed)
        return done

    def _stored_many(self, ns: str, enc: list[tuple[bytes, EncodedParts, pb.StoreOptions]],
                     done: list[pb.StoreResponse | TooBig], writes: list[Any],
                     options: StoreOptions | None, request_id: str | None
                     ) -> list[pb.StoreResponse]:
        """``store_many``'s answers: every stored one kept in the in-process tier (its
        ``writes``), the items no batch carried stored one by one (each a write of its own)."""
        out = []
        for (k, parts, _), r, write in zip(enc, done, writes):
            if isinstance(r, TooBig):
                write.end()  # not sent: the store below is the key's write
                r = self.store(k, parts, namespace=ns, options=options, request_id=request_id)
            else:
                write.keep(parts)
            out.append(r)
        return out

    def _store_streamed(self, ns: str, items: list[tuple[bytes, EncodedParts, pb.StoreOptions]],
                        request_id: str | None) -> list[pb.StoreResponse] | None:
        """``items`` stored by one StoreMany stream (each entry's header, then its frames in
        the messages the encoder wrote; or grouped, every header first, to a server that said
        it reads that form: ``reads_grouped``; the server checks them all before it stores
        any); None from a server that has no StoreMany (then each is stored on its own). A
        grouped stream refused as a bad request is sent once more a header per entry: a
        server replaced by an older one at the same address (or one behind a balancer that
        mixes versions) refuses the form it does not read, and nothing was stored."""
        for _, parts, _ in items:
            self._check_frames(parts)
        md = self.rpc.metadata(request_id)
        grouped = grouped_store_messages(ns, items) if self._store_many_grouped else None
        try:
            resp = self.rpc.call(lambda: self.rpc.store_many_call(
                iter(grouped) if grouped is not None else
                itertools.chain.from_iterable([store_messages(ns, key, parts, opts)
                                               for key, parts, opts in items]),
                timeout=time_left(self.rpc.timeout_s), metadata=md))
        except KDNError as exc:
            if grouped is not None and exc.status is Status.INVALID_ARGUMENT:
                self._store_many_grouped = False
                return self._store_streamed(ns, items, request_id)
            if exc.status is not Status.UNIMPLEMENTED:
                raise
            self._store_many_ok = False
            return None
        self._store_many_grouped = resp.reads_grouped
        if len(resp.results) != len(items):
            raise KDNError(f"StoreMany answered {len(resp.results)} results for "
                           f"{len(items)} entries")
        return list(resp.results)


    def store_async(
        self,
        key: bytes,
        kv: KVCache | EncodedParts | Staged,
        *,
        mode: str = "lossless",
        level: str = "",
        namespace: str | None = None,
        options: StoreOptions | None = None,
        layers_per_frame: int = 0,
    ) -> PendingStore:
        """``store`` without waiting for the server's answer (as LMCache's put and vLLM's
        asynchronous save do): on the server's host the entry is written into the segment (a
        staged entry: named where it lies) and the call sent on this thread's fast-path
        connection; on another host its bytes go on this thread's network data path
        connection; at most ``ASYNC_DEPTH`` unanswered either way. Without either path, or
        without room, it is stored as ``store`` does and comes back answered (refused: its
        error raised as any's, not by this call). The server checks it as any store. Its
        answer is read by ``result()``, by this thread's next call of this client (every call
        waits for the thread's earlier stores first, so its reads see them), or by
        ``flush()``, which raises the first error since the last flush. A staged entry must
        not be written again until its store is answered (the server copies what it holds
        then); closed meanwhile, its region is kept until then, and a store not answered
        closes it and retires the region (``kdn.client.samehost``)."""
        key, kv, options = check_key(key), check_entry(kv), check_options(options)
        check_encoding(mode, level, layers_per_frame)
        ns = self._ns(namespace)
        opts = wire_options(options)
        parts: EncodedParts | None = None
        got: PendingStore | None = None
        if is_staged(kv) and self.local is None and self.dataplane.segment()[0] is not None \
                and self.dataplane.server_seals:
            got = self.dataplane.put_async(ns, key, opts, staged=kv)
        else:
            parts = kept = encoded(kv, mode, level, layers_per_frame)
            write = self.writing(ns, key, opts)

            def on_done(stored: bool) -> None:
                if stored:
                    write.keep(kept)
                write.end()

            try:
                got = self.dataplane.put_async(ns, key, opts, parts=parts, on_done=on_done)
                if got is None and self.dataplane.segment()[0] is None:  # another host
                    got = self.dataplane.put_async_net(ns, key, opts, parts, on_done=on_done)
            finally:
                if got is None:  # not sent: the store below is the key's write
                    write.end()
        if got is None:
            try:
                return PendingStore.answered(key, self.store(
                    key, parts if parts is not None else kv, namespace=ns, options=options))
            except Closed:
                raise
            except KDNError as exc:  # refused: reported as a store sent ahead is (flush)
                self._refused.errors.append(exc)
                return PendingStore.failed(key, exc)
        return got

    def flush(self) -> None:
        """Wait for this thread's asynchronous stores (``store_async``); raise the first error
        among those answered since the last flush (each also raises from its ``result()``)."""
        self.dataplane.settle_async()
        errors, self._refused.errors = self._refused.errors, []
        errors += self.dataplane.take_async_errors()
        if errors:  # a copy: its traceback holds this frame, which holds ``errors``
            raise again(errors[0])

    def stage(self, layout: KVLayout, tokens: int, *, start_position: int = 0) -> Staged:
        """A ``raw`` entry of ``tokens`` tokens of ``layout`` to fill in place and store without
        this client copying or hashing it (``kdn.client.staged``): in the shared segment on the
        server's host (registered with CUDA on a CUDA host), else in this process's memory."""
        from kdn.client.staged import Staged

        seg = self.dataplane.segment()[0]
        if seg is not None:
            seg.register_with_cuda()  # once; nothing where CUDA is not available
        return Staged(layout, tokens, start_position, seg)

    def _written_staged(self, kv: KVCache | EncodedParts | Staged, mode: str, level: str,
                        layers_per_frame: int) -> Staged | None:
        """``kv`` (a ``KVCache`` to store ``raw`` in frames of the default size) written
        straight into a staged entry in the shared segment, one copy of each tensor, for the
        server to seal as it copies it out (``kdn.client.staged``): the client neither encodes
        into memory of its own nor copies into the segment again nor hashes. None where that
        does not apply (another mode or frame size, no segment or no room in it, a server
        that does not seal, an in-process tier, which keeps the sealed bytes, a dtype whose
        bodies can not be viewed in place): the entry is then encoded as any."""
        seg = self._writable(kv, mode, level, layers_per_frame)
        return None if seg is None else self._write_kv(cast("KVCache", kv), seg)

    def _writable(self, kv: KVCache | EncodedParts | Staged, mode: str, level: str,
                  layers_per_frame: int) -> Any:
        """The segment ``kv`` is written into by ``_write_kv`` (a ``KVCache`` of at least
        one token to store ``raw`` in frames of the default size, validated here, to a server
        that seals, without an in-process tier), or None (anything but a ``KVCache``: what
        ``encoded`` takes, or refuses)."""
        if (mode != "raw" or level or layers_per_frame or self.local is not None
                or not is_kv(kv)):
            return None
        seg = self.dataplane.segment()[0]  # attached on first use: before ``server_seals``
        if seg is None or not self.dataplane.server_seals:
            return None
        kv.validate()  # shapes and dtype as the layout says (a copy would convert them)
        return seg if kv.num_tokens > 0 else None

    @staticmethod
    def _write_kv(kv: KVCache, seg: Any) -> Staged | None:
        """``kv`` written into a new staged entry in ``seg``; None where it has no room."""
        from kdn.client.staged import Staged

        on_cpu = all(k.is_cpu and v.is_cpu for k, v in kv.layers)
        try:  # from the CPU by bytes; from a device through tensor views (a DMA lands there)
            st = Staged(kv.layout, kv.num_tokens, kv.start_position, seg,
                        own_memory=False, tensors=not on_cpu)
        except InvalidArgument:
            return None
        if st.closed:  # no room in the segment
            return None
        try:
            if on_cpu:
                st.write(kv)
            else:
                for (k, v), (src_k, src_v) in zip(st.layers, kv.layers):
                    k.copy_(src_k)
                    v.copy_(src_v)
        except BaseException:
            st.close()
            raise
        return st

    def _store_kv_pipelined(self, ns: str, items: Sequence[tuple[bytes, Any]],
                            options: StoreOptions | None, request_id: str | None
                            ) -> list[pb.StoreResponse] | None:
        """``store_many`` of ``KVCache``s that ``_writable`` takes, every one validated
        before any is written: each written into the segment as the calls go
        (``SameHostPath.put_staged_pipelined``: the next call's entries written while the
        server copies the last call's out), the ones that found no room stored as any entry.
        None where the fast path is not there."""
        opts = wire_options(options)
        seg = self.dataplane.segment()[0]
        done = self.dataplane.same_host.put_staged_pipelined(
            ns, [(k, opts) for k, _ in items],
            lambda i: self._write_kv(items[i][1], seg))
        if done is None:
            return None
        rest = [j for j, r in enumerate(done) if r is None]
        if rest:
            for j, r in zip(rest, self._store_many(
                    [(items[j][0], encoded(items[j][1], "raw", "", 0)) for j in rest],
                    "raw", "", ns, options, 0, request_id)):
                done[j] = r
        return done  # type: ignore[return-value]

    def _store_staged(self, ns: str, items: Sequence[tuple[bytes, Staged]],
                      options: StoreOptions | None, request_id: str | None
                      ) -> list[pb.StoreResponse]:
        """``store``/``store_many`` of staged entries: those in the client's segment by
        where they lie (PutMany items the server seals on its copy, one call per ``BATCH_BYTES``
        or ``MAX_CALL_KEYS`` items), the others sealed here and sent as any entries; with an
        in-process tier (which keeps the bytes) or a server that does not seal
        (``AttachResponse.seals``), those in the segment are sealed here first and the server
        checks them as any store."""
        opts = wire_options(options)
        items = [(check_key(key), st) for key, st in items]
        seg, seg_id = self.dataplane.segment()
        sealing = self.local is None and self.dataplane.server_seals
        out: list[pb.StoreResponse | None] = [None] * len(items)
        batch: list[int] = []
        size = 0
        writes: dict[int, Any] = {}  # each item's write, begun as it joins a batch
        kept: dict[int, EncodedParts] = {}  # sealed here: kept in the tier once stored

        def send() -> None:
            req = pb.PutManyRequest(namespace=ns, segment_id=seg_id)
            for j in batch:
                key, st = items[j]
                at = st.region(seg)
                assert at is not None
                item = req.items.add(key=key, options=opts, seal=sealing)
                item.region.offset, item.region.length = at
            try:
                resp = self.dataplane.put_request(req, request_id)
            except BaseException as exc:
                if unanswered(exc):  # the server may still read these regions
                    for j in batch:
                        items[j][1].retire()
                raise
            if len(resp.results) != len(batch):
                raise KDNError(f"PutMany answered {len(resp.results)} results for "
                               f"{len(batch)} entries")
            for j, r in zip(batch, resp.results):
                out[j] = r
                if j in kept:
                    writes[j].keep(kept[j])

        try:
            for j, (key, st) in enumerate(items):
                if st.closed:
                    raise InvalidArgument(f"item {j}: store of a staged entry that was closed")
                if st.region(seg) is None:
                    continue
                if not sealing:  # sealed here: the tier keeps these bytes, or the server can't
                    kept[j] = st.sealed()
                if batch and (size + st.nbytes > BATCH_BYTES or len(batch) >= MAX_CALL_KEYS):
                    send()
                    batch, size = [], 0
                writes[j] = self.writing(ns, key, opts)
                batch.append(j)
                size += st.nbytes
            if batch:
                send()
        finally:
            for write in writes.values():
                write.end()
        rest = [j for j in range(len(items)) if out[j] is None]
        if rest:  # not in this client's segment: sealed here, sent as any entries
            for j, r in zip(rest, self.store_many(
                    [(items[j][0], items[j][1].sealed()) for j in rest], namespace=ns,
                    options=options, request_id=request_id)):
                out[j] = r
        return out  # type: ignore[return-value]


class NotKept:
    """The ``LocalWrite`` of a client without an in-process tier: nothing to keep or end."""

    def keep(self, parts: EncodedParts) -> bool:
        return False

    def end(self) -> None:
        pass

    def __enter__(self) -> NotKept:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


NOT_KEPT = NotKept()


def encoded(kv: KVCache | EncodedParts | Staged, mode: str, level: str,
             layers_per_frame: int) -> EncodedParts:
    if isinstance(kv, EncodedParts):
        return kv
    if is_staged(kv):  # sealed on its own bytes (the segment's way is ``Writer._store_staged``)
        return kv.sealed()
    return codec.encode_parts(cast("KVCache", kv), mode, level,
                              layers_per_frame=layers_per_frame, wire=True)


def wire_options(options: StoreOptions | None) -> pb.StoreOptions:
    opts = options or StoreOptions()
    return pb.StoreOptions(ttl_seconds=opts.ttl_s, pin=opts.pin,
                           durability=int(opts.durability))  # type: ignore[arg-type]


# -- the messages of a Store / StoreMany stream ---------------------------------------------

def store_header(namespace: str, key: bytes, parts: EncodedParts,
                 options: pb.StoreOptions) -> pb.StoreHeader:
    """The header of one entry on a Store (or StoreMany) stream; InvalidArgument for a
    container header that does not parse (as the server answers it)."""
    try:
        fingerprint = parse_header(parts.header).layout.fingerprint
    except Corrupt as exc:
        raise InvalidArgument(f"corrupt input: {exc}") from exc
    return pb.StoreHeader(
        namespace=namespace, key=key, container_header=parts.header,
        layout_fingerprint=fingerprint, total_bytes=parts.nbytes, options=options)


def frame_messages(parts: EncodedParts) -> Iterator[bytes]:
    """Each frame of ``parts`` in the message the encoder wrote it in (sent as it is), or one
    built for it."""
    wire = parts.messages()
    for i, frame in enumerate(parts.frames):
        yield wire[i] if wire is not None else frame_message(i, frame)


def store_messages(namespace: str, key: bytes, parts: EncodedParts,
                   options: pb.StoreOptions) -> Iterator[pb.StoreRequest | bytes]:
    """The messages of one entry on a Store (or StoreMany) stream: its header, then its
    frames (``frame_messages``). The header is made here, before the stream is handed to a
    call: an error raised while grpc iterates it is lost to "Exception iterating requests"."""
    head = pb.StoreRequest(header=store_header(namespace, key, parts, options))
    return itertools.chain((head,), frame_messages(parts))


GROUP_HEADER_BYTES = 4 << 20
"""A StoreMany is grouped (``grouped_store_messages``) while its headers take at most this
many bytes in their one message,"""
GROUP_ENTRIES = 4096
"""and it holds at most this many entries (the server's ``MAX_GROUPED_ENTRIES``)."""


def grouped_store_messages(namespace: str,
                           items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]]
                           ) -> list[Any] | None:
    """The messages of a grouped StoreMany of ``items``: every entry's header in one message,
    then each entry's frames (``frame_messages``); None for more than ``GROUP_ENTRIES``
    entries or headers of more than ``GROUP_HEADER_BYTES``. Measured on the raw service, 64
    entries of 1 MiB: a header message per entry cost 7 ms of an 80 ms stream against one
    message of all of them."""
    if len(items) > GROUP_ENTRIES:
        return None
    heads = pb.StoreRequest(headers=pb.StoreHeaders(headers=[
        store_header(namespace, key, parts, opts) for key, parts, opts in items]))
    if heads.ByteSize() > GROUP_HEADER_BYTES:
        return None
    return [heads, *(m for _, parts, _ in items for m in frame_messages(parts))]
