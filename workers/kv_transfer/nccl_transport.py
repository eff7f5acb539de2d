"""KV transport over NCCL: one 2-rank communicator per (prefill sender, decode receiver) pair.

The control frames (hello, layer headers, done, ack, cancel) travel over the
base class's TCP connection; the layer bytes travel over NCCL, matched to the
headers by order: a pair's sends and receives are issued in header order on
both sides.

Making a pair (the first ``start_send`` from a sender to a receiver)::

    sender (rank 0)                              receiver (rank 1)
    _on_connect: unique id, pair key
      rendezvous(ticket, key, id)   -- Ray call -->  join(key, id): rank 1, in a thread
      rank 0 (blocks until rank 1 is in), then a small warm-up send/recv
      "hello" {pair: key}           -- TCP ------->  _on_hello: this connection uses that pair

``rendezvous`` is the caller's: in serving it calls the decode worker that
``ticket.owner`` names, which calls ``join``; ``join`` returns at once.

Moving layers (each pair has an NCCL stream and a copy stream, on both sides)::

    sender    per message: the copy stream waits on the compute stream and one
              kernel gathers the message's layers ([layers, 2, tokens, heads,
              head_dim], K then V) into a staging buffer; the header frames go
              out; the NCCL stream waits for the gather and sends
    receiver  on the message's first header: the NCCL stream receives into a
              staging buffer, then one kernel on the copy stream scatters it
              into the ticket's slots

Streams are per pair, not per transport: a receive waiting for its sender must
not hold up another pair's (two senders and two receivers sharing one stream
each could wait on each other for ever). The compute stream never waits for
the transport, so layers move while later layers compute.

``layers_per_message`` > 1 coalesces up to that many layers into one NCCL
message (fewer, larger messages run nearer the link's peak; worth it when many
layers are ready at once, not when each layer waits for its compute): a
transfer's messages hold 1, 2, 4, ... layers up to that cap, so its first send
starts at once. The first header of a message carries ``chunk`` (its layer
ids) and ``nbytes``; the others carry no data. Headers of a cancelled or
unknown request still receive (into scratch), so every send finds its receive
and the pair stays in step.

Staging buffers come from the caching allocator: each is allocated on the
stream that writes it and ``record_stream``-ed on the one that reads it, so
the allocator reuses it only after its send (or scatter) has completed.

Failure: a communicator whose peer died cannot be reused (its pending kernels
never finish). It is aborted (``comm.abort()`` ends them), dropped, and its TCP
connection closed, when the connection is lost, when an NCCL call fails, or
when a receive is still pending at its transfer's deadline. The other side sees
the connection close and aborts its end; the next ``start_send`` to that
receiver connects again and makes a new communicator. Only the rank-1 thread of
a rendezvous whose sender never came can linger (NCCL cannot abort a
communicator that is still being created); it holds no transfer.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve.workers.kv_cache import KVCache
from splitserve.workers.kv_transfer.base import Incoming, KVTransport, Outgoing, Peer, TransferState
from splitserve.workers.kv_transfer.framing import Connection
from splitserve.workers.kv_transfer.ticket import TransferDone, TransferTicket

try:
    import cupy
    import numpy
    from cupy.cuda import nccl
except ImportError as e:  # pragma: no cover - machines without cupy
    raise ImportError(
        "the nccl KV transport needs cupy with NCCL (cupy-cuda12x or cupy-cuda13x)"
    ) from e

logger = logging.getLogger(__name__)

Rendezvous = Callable[[TransferTicket, str, bytes], Any]

_WARMUP_BYTES = 32 << 20  # the first send/recv of a pair connects its channels
_SPIN_S = 0.02  # how long a wait spins on an event before it sleeps between queries


@dataclass(eq=False)
class _Pair:
    """This side of one 2-rank communicator, and the streams that use it."""

    key: str
    comm: Any  # nccl.NcclCommunicator
    peer_rank: int
    nccl_stream: torch.cuda.Stream
    copy_stream: torch.cuda.Stream  # gather (sender) or scatter (receiver)
    conn: Connection | None = None  # its control connection
    aborted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)  # NCCL calls vs abort


@dataclass
class _Chunk:
    """The layers of one NCCL message that is not sent yet."""

    capacity: int
    headers: list[dict[str, Any]] = field(default_factory=list)


class NcclKVTransport(KVTransport):
    name = "nccl"

    def __init__(
        self,
        kv_cache: KVCache,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        owner: str = "",
        rendezvous: Rendezvous | None = None,
        layers_per_message: int = 1,
        fused_copy: bool = True,
    ):
        if layers_per_message < 1:
            raise ValueError(f"layers_per_message must be at least 1, got {layers_per_message}")
        self.rendezvous = rendezvous  # needed to send; a receive-only worker may leave it None
        self.layers_per_message = layers_per_message  # sender side; receivers follow headers
        self._send_pairs: dict[Peer, _Pair] = {}
        self._recv_pairs: list[_Pair] = []
        self._joined: dict[str, _Pair | Exception] = {}  # by pair key, until its hello
        self._joined_cv = threading.Condition()
        # Each accepted connection has its own serve thread (base._serve_peer):
        # the pair of the connection a thread serves is thread-local.
        self._local = threading.local()
        super().__init__(kv_cache, host=host, timeout_s=timeout_s, owner=owner)
        self.fused_copy = fused_copy and _FusedCopy.supports(kv_cache)
        self._fused = _FusedCopy.build(kv_cache) if self.fused_copy else None

    # ---- making pairs ---------------------------------------------------------

    def join(self, pair_key: str, unique_id: bytes) -> None:
        """Become rank 1 of the sender's communicator ``pair_key``; returns at once."""

        def run() -> None:
            try:
                pair: _Pair | Exception = self._make_pair(pair_key, unique_id, rank=1)
            except Exception as e:
                logger.warning("joining NCCL communicator %s failed: %s", pair_key, e)
                pair = e
            with self._joined_cv:
                self._joined[pair_key] = pair
                self._joined_cv.notify_all()

        threading.Thread(target=run, name="kv-nccl-join", daemon=True).start()

    def _on_connect(self, peer: Peer, ticket: TransferTicket) -> None:
        me, them = self.owner or self.address, ticket.owner or ticket.address
        key = f"{me}->{them}#{uuid.uuid4().hex[:12]}"
        try:
            if self.rendezvous is None:
                raise ValueError(
                    "the nccl KV transport needs rendezvous=... to send: a callable "
                    "(ticket, pair_key, unique_id) that makes the receiver call join()"
                )
            uid = unique_id()
            self.rendezvous(ticket, key, uid)
            pair = self._connect_rank0(key, uid)
        except BaseException:
            peer.conn.close()
            raise
        pair.conn = peer.conn
        with self._lock:
            self._send_pairs[peer] = pair
        peer.post({"kind": "hello", "pair": key})

    def _connect_rank0(self, key: str, uid: bytes) -> _Pair:
        """Rank 0 blocks until rank 1 is in: do it in a thread, bounded by the timeout."""
        box: dict[str, Any] = {}
        gave_up = threading.Event()

        def run() -> None:
            try:
                box["pair"] = self._make_pair(key, uid, rank=0)
            except Exception as e:
                box["error"] = e
            if gave_up.is_set() and "pair" in box:
                self._abort(box["pair"], "made after its rendezvous timed out")

        thread = threading.Thread(target=run, name="kv-nccl-connect", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            gave_up.set()
            raise ConnectionError(
                f"NCCL communicator {key}: the receiver did not join within {self.timeout_s:.0f} s"
            )
        if "error" in box:
            raise ConnectionError(f"NCCL communicator {key} failed: {box['error']}") from box[
                "error"
            ]
        return box["pair"]

    def _make_pair(self, key: str, uid: bytes, rank: int) -> _Pair:
        device = self.device
        with cupy.cuda.Device(device.index):
            comm = communicator(uid, rank)
        pair = _Pair(key, comm, 1 - rank, torch.cuda.Stream(device), torch.cuda.Stream(device))
        # NCCL connects a pair's channels during its first send/recv, with both
        # ranks in the call: do that here, not under the first real transfer.
        with torch.cuda.stream(pair.nccl_stream):
            warm = torch.zeros(_WARMUP_BYTES, dtype=torch.uint8, device=device)
            op = comm.send if rank == 0 else comm.recv
            op(warm.data_ptr(), _WARMUP_BYTES, nccl.NCCL_UINT8, pair.peer_rank, _ptr(pair))
        pair.nccl_stream.synchronize()
        return pair

    def _on_hello(self, conn: Connection, header: dict[str, Any]) -> None:
        key = header["pair"]
        deadline = time.monotonic() + self.timeout_s
        with self._joined_cv:
            while key not in self._joined:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectionError(
                        f"NCCL communicator {key} was not joined within {self.timeout_s:.0f} s"
                    )
                self._joined_cv.wait(left)
            pair = self._joined.pop(key)
        if isinstance(pair, Exception):
            raise ConnectionError(f"joining NCCL communicator {key} failed: {pair}")
        pair.conn = conn
        with self._lock:
            self._recv_pairs.append(pair)
        self._local.pair = pair

    # ---- sender ---------------------------------------------------------------

    def _send_layer_data(self, out: Outgoing, header: dict[str, Any]) -> None:
        pair = out.extra.get("pair")
        if pair is None:
            with self._lock:
                pair = self._send_pairs.get(out.peer)
            if pair is None:
                return  # the connection is gone: the transfer has failed already
            out.extra["pair"] = pair
        chunk = out.extra.get("chunk")
        if chunk is None:
            # Messages grow 1, 2, 4, ... up to layers_per_message, so the first send
            # starts at once when many layers are ready together.
            remaining = out.ticket.num_layers - header["layer"]
            n = message_layers(self.layers_per_message, out.layers_sent, remaining)
            chunk = out.extra["chunk"] = _Chunk(n)
        chunk.headers.append(header)
        if len(chunk.headers) == chunk.capacity:
            self._flush(out)

    def finish_send(self, request_id: str, done: TransferDone) -> None:
        with self._lock:
            out = self._outgoing.get(request_id)
        if out is not None and out.state == TransferState.SENDING:
            self._flush(out)  # a partly filled message goes before "done"
        super().finish_send(request_id, done)

    def _flush(self, out: Outgoing) -> None:
        chunk: _Chunk | None = out.extra.pop("chunk", None)
        if chunk is None or not chunk.headers:
            return
        pair: _Pair = out.extra["pair"]
        layers = [h["layer"] for h in chunk.headers]
        # The copy stream waits for every layer of the message to be computed.
        pair.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(pair.copy_stream):
            data = self._staging(len(layers), out.ticket)
            self.gather(layers, out.src_slots, data)
        out.src_slots.record_stream(pair.copy_stream)
        nbytes = data.numel() * data.element_size()
        chunk.headers[0].update(chunk=layers, nbytes=nbytes)
        # Headers go first, so the receiver posts its recv while this side enqueues the
        # send; neither side ever waits for the other's frame before its NCCL call.
        for h in chunk.headers:
            out.peer.post(h)
        gathered = torch.cuda.Event()
        gathered.record(pair.copy_stream)
        error = None
        with pair.lock, torch.cuda.stream(pair.nccl_stream):  # (also the CUDA device)
            if pair.aborted:
                return  # the peer is gone and this transfer has failed with it
            pair.nccl_stream.wait_event(gathered)
            try:
                pair.comm.send(data.data_ptr(), nbytes, nccl.NCCL_UINT8, pair.peer_rank, _ptr(pair))
            except nccl.NcclError as e:
                error = e
        data.record_stream(pair.nccl_stream)
        if error is not None:
            self._abort(pair, f"NCCL send failed: {error}")  # fails the transfer via _peer_lost

    def _peer_lost(self, peer: Peer, error: str) -> None:
        super()._peer_lost(peer, error)
        with self._lock:
            pair = self._send_pairs.pop(peer, None)
        if pair is not None:
            self._abort(pair, error)

    # ---- receiver -------------------------------------------------------------

    def _recv_layer_data(self, inc: Incoming | None, header: dict, payload: bytearray) -> None:
        layers = header.get("chunk")
        if layers is None:
            return  # this layer's bytes came with the first header of its message
        pair: _Pair | None = getattr(self._local, "pair", None)
        if pair is None:
            raise ConnectionError("a KV layer frame arrived before the hello frame")
        nbytes = header["nbytes"]
        if inc is not None:
            error = _check_message(inc.ticket, layers, nbytes)
            if error is not None:
                self._fail(inc.ticket.request_id, "recv", error)
                inc = None  # still receive the bytes, so the pair stays in step
        error = None
        with pair.lock, torch.cuda.stream(pair.nccl_stream):
            if pair.aborted:
                raise ConnectionError(f"NCCL communicator {pair.key} was aborted")
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            try:
                pair.comm.recv(buf.data_ptr(), nbytes, nccl.NCCL_UINT8, pair.peer_rank, _ptr(pair))
            except nccl.NcclError as e:
                error = e
        if error is not None:
            self._abort(pair, f"NCCL recv failed: {error}")
            raise ConnectionError(f"NCCL recv failed: {error}")
        if inc is None:
            return  # scratch: the allocator reuses it only after the recv (same stream)
        t = inc.ticket
        shape = (len(layers), 2, t.num_transfer_tokens, t.layout.num_kv_heads, t.layout.head_dim)
        kv = buf.view(t.layout.torch_dtype).view(shape)
        received = torch.cuda.Event()
        received.record(pair.nccl_stream)
        pair.copy_stream.wait_event(received)
        with torch.cuda.stream(pair.copy_stream):
            self.scatter(layers, inc.dst_slots, kv)
            scattered = torch.cuda.Event()
            scattered.record(pair.copy_stream)
        buf.record_stream(pair.copy_stream)
        inc.dst_slots.record_stream(pair.copy_stream)
        inc.extra.update(pair=pair, scattered=scattered)

    def _on_done(self, conn: Connection, header: dict[str, Any]) -> None:
        # Wait for the last scatter here, outside the lock; base._on_done then finds it done.
        rid = header["request_id"]
        with self._lock:
            inc = self._incoming.get(rid)
        scattered = inc.extra.get("scattered") if inc is not None else None
        if scattered is not None:
            pair = inc.extra["pair"]
            if not _wait(scattered, pair, inc.deadline):
                error = f"the KV of {rid} was not received by the transfer's deadline"
                self._abort(pair, error)
                with self._lock:
                    self._fail(rid, "recv", error)
        super()._on_done(conn, header)

    def _finish_incoming(self, inc: Incoming) -> None:
        scattered = inc.extra.get("scattered")
        if scattered is not None:
            scattered.synchronize()  # done already (see _on_done)

    def _release_incoming(self, inc: Incoming) -> None:
        """No scatter may write into the blocks after this returns."""
        scattered, pair = inc.extra.get("scattered"), inc.extra.get("pair")
        if scattered is None or scattered.query():
            return
        if _wait(scattered, pair, max(inc.deadline, time.monotonic() + 1.0)):
            return
        # A receive still pending at the deadline has no live sender: abort it, so
        # the scatters behind it run (on garbage) and finish before the blocks go.
        self._abort(pair, f"a KV receive of {inc.ticket.request_id} was still pending")
        if not _wait(scattered, None, time.monotonic() + self.timeout_s):
            logger.error("KV scatter of %s still pending after abort", inc.ticket.request_id)

    def _on_disconnect(self, conn: Connection) -> None:
        pair: _Pair | None = getattr(self._local, "pair", None)
        if pair is not None and pair.conn is conn:
            self._abort(pair, "the prefill worker's connection ended")

    # ---- gather / scatter -----------------------------------------------------

    def gather(self, layers: list[int], slots: torch.Tensor, out: torch.Tensor) -> None:
        """``out[j] = [K, V][slots]`` of ``layers[j]`` (``[layers, 2, tokens, ...]``), on the
        current stream."""
        self._copy(True, layers, slots, out)

    def scatter(self, layers: list[int], slots: torch.Tensor, kv: torch.Tensor) -> None:
        """The inverse: ``[K, V][slots] = kv[j]`` for ``layers[j]``, on the current stream."""
        self._copy(False, layers, slots, kv)

    def _copy(self, gather: bool, layers: list[int], slots: torch.Tensor, buf: torch.Tensor):
        consecutive = list(layers) == list(range(layers[0], layers[0] + len(layers)))
        if self.fused_copy and self._fused is not None and consecutive:
            try:
                self._fused(gather, layers[0], slots, buf, self.device)
                return
            except Exception as e:  # e.g. no NVRTC: the torch ops below do the same
                logger.warning("fused KV copy failed (%s); using torch index ops", e)
                self._fused = None
        for j, layer in enumerate(layers):
            for cache, rows in zip(self.kv_cache.layer(layer), (buf[j, 0], buf[j, 1])):
                if gather:
                    torch.index_select(as_words(cache), 0, slots, out=as_words(rows))
                else:
                    as_words(cache).index_copy_(0, slots, as_words(rows))

    # ---- both -----------------------------------------------------------------

    def _abort(self, pair: _Pair, reason: str) -> None:
        with pair.lock:
            if pair.aborted:
                return
            pair.aborted = True
            logger.info("aborting NCCL communicator %s: %s", pair.key, reason)
            pair.comm.abort()
        if pair.conn is not None:
            pair.conn.close()
        with self._lock:
            if pair in self._recv_pairs:
                self._recv_pairs.remove(pair)
            for peer in [p for p, q in self._send_pairs.items() if q is pair]:
                del self._send_pairs[peer]

    def _staging(self, num_layers: int, ticket: TransferTicket) -> torch.Tensor:
        spec = self.kv_cache.spec
        shape = (num_layers, 2, ticket.num_transfer_tokens, spec.num_kv_heads, spec.head_dim)
        return torch.empty(shape, dtype=spec.dtype, device=self.device)

    def close(self) -> None:
        super().close()
        with self._lock:
            pairs = list(self._send_pairs.values()) + list(self._recv_pairs)
        for pair in pairs:
            self._abort(pair, "transport closed")


def _check_message(ticket: TransferTicket, layers: list[int], nbytes: int) -> str | None:
    """An error when a message does not fit the ticket, else None."""
    if any(not 0 <= layer < ticket.num_layers for layer in layers):
        return f"KV message names layers {layers}, the ticket has {ticket.num_layers}"
    lay = ticket.layout
    elem = torch.empty((), dtype=lay.torch_dtype).element_size()
    expected = len(layers) * 2 * ticket.num_transfer_tokens * lay.num_kv_heads * lay.head_dim * elem
    if nbytes != expected:
        return f"KV message of layers {layers} has {nbytes} bytes, expected {expected}"
    return None


def _wait(event: torch.cuda.Event, pair: _Pair | None, deadline: float) -> bool:
    """Wait for ``event``; False at the deadline or when ``pair`` is aborted."""
    spin_until = time.monotonic() + _SPIN_S
    while not event.query():
        if pair is not None and pair.aborted:
            return False
        now = time.monotonic()
        if now > deadline:
            return False
        time.sleep(0 if now < spin_until else 0.0005)
    return True


def _ptr(pair: _Pair) -> int:
    return pair.nccl_stream.cuda_stream


_COPY_SOURCE = r"""
// buf is [layers, 2, tokens, row] (K then V of each layer); table holds the K and V
// cache pointers of every layer (K0, V0, K1, V1, ...). Row (j, kv, t) of buf is the
// row at slots[t] of layer first + j. One block moves one row, in 16-byte words.
__device__ __forceinline__ void kv_rows(bool to_buf, unsigned long long table, int first,
        unsigned long long slots, long long tokens, int words, unsigned long long buf) {
    long long row = blockIdx.x;
    long long t = row % tokens;
    long long jkv = row / tokens;
    ulonglong2* cache = reinterpret_cast<ulonglong2*>(
        reinterpret_cast<const long long*>(table)[2 * first + jkv]);
    cache += reinterpret_cast<const long long*>(slots)[t] * words;
    ulonglong2* rows = reinterpret_cast<ulonglong2*>(buf) + row * words;
    for (int w = threadIdx.x; w < words; w += blockDim.x) {
        if (to_buf) rows[w] = cache[w]; else cache[w] = rows[w];
    }
}

extern "C" __global__ void kv_gather(unsigned long long table, int first,
        unsigned long long slots, long long tokens, int words, unsigned long long buf) {
    kv_rows(true, table, first, slots, tokens, words, buf);
}

extern "C" __global__ void kv_scatter(unsigned long long table, int first,
        unsigned long long slots, long long tokens, int words, unsigned long long buf) {
    kv_rows(false, table, first, slots, tokens, words, buf);
}
"""


class _FusedCopy:
    """Gathers (scatters) K and V of consecutive layers in one kernel launch.

    The torch path (``index_select`` / ``index_copy_`` per layer, in ``_copy``) is its
    reference and its fallback: two launches a layer cost more CPU time than the
    copies take on the GPU, which throttles a transfer of many ready layers.
    """

    def __init__(self, kv_cache: KVCache):
        k0 = kv_cache.k[0]
        self.words = k0.shape[-2] * k0.shape[-1] * k0.element_size() // 16
        ptrs = [t.data_ptr() for kv in zip(kv_cache.k, kv_cache.v) for t in kv]
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=k0.device)
        with cupy.cuda.Device(k0.device.index):
            module = cupy.RawModule(code=_COPY_SOURCE)
            self.kernels = {True: module.get_function("kv_gather")}
            self.kernels[False] = module.get_function("kv_scatter")
        self.streams: dict[int, Any] = {}  # cupy views of torch streams

    @staticmethod
    def supports(kv_cache: KVCache) -> bool:
        k0 = kv_cache.k[0]
        return k0.shape[-2] * k0.shape[-1] * k0.element_size() % 16 == 0

    @classmethod
    def build(cls, kv_cache: KVCache) -> _FusedCopy | None:
        try:
            return cls(kv_cache)
        except Exception as e:
            logger.warning("fused KV copy unavailable (%s); using torch index ops", e)
            return None

    def __call__(self, gather: bool, first: int, slots, buf, device) -> None:
        ptr = torch.cuda.current_stream(device).cuda_stream
        stream = self.streams.get(ptr)
        if stream is None:
            stream = self.streams[ptr] = cupy.cuda.ExternalStream(ptr)
        rows = buf.numel() * buf.element_size() // (16 * self.words)
        args = (
            numpy.uint64(self.table.data_ptr()),
            numpy.int32(first),
            numpy.uint64(slots.data_ptr()),
            numpy.int64(slots.numel()),
            numpy.int32(self.words),
            numpy.uint64(buf.data_ptr()),
        )
        with cupy.cuda.Device(device.index), stream:
            self.kernels[gather]((rows,), (min(self.words, 256),), args)


def message_layers(cap: int, sent: int, remaining: int) -> int:
    """Layers in a transfer's next message: 1, 2, 4, ... up to ``cap``."""
    return min(cap, sent + 1, remaining)


def as_words(kv: torch.Tensor) -> torch.Tensor:
    """Token rows of ``kv`` (``[..., heads, head_dim]``, contiguous) as a 2-D view.

    In 8-byte words where a row divides evenly: the gather and scatter kernels then
    move a quarter as many elements as in bf16, and run about that much faster.
    """
    rows = kv.view(-1, kv.shape[-2] * kv.shape[-1])
    if rows.shape[1] * rows.element_size() % 8 == 0:
        return rows.view(torch.int64)
    return rows


def unique_id() -> bytes:
    """A new NCCL unique id, as bytes (it travels in Ray calls)."""
    uid = nccl.get_unique_id()
    if isinstance(uid, bytes):  # cupy >= 14
        return uid
    return bytes(b & 0xFF for b in uid)  # older cupy: a tuple of C chars


def communicator(uid: bytes, rank: int) -> Any:
    """Rank ``rank`` of a 2-rank communicator on the current device; blocks until both join."""
    try:
        return nccl.NcclCommunicator(2, uid, rank)
    except TypeError:  # older cupy takes the id as a tuple of C chars (signed on x86-64)
        return nccl.NcclCommunicator(2, tuple(b - 256 if b > 127 else b for b in uid), rank)
