"""The receiver's state machine: one transfer from ``expect`` to its arrival.

    expect(ticket)                the blocks are reserved; the receive path gets
                                  ready (``RecvPath.expect``)          EXPECTING
    first layer frame (cpu) or announce (nccl), on a sender's connection
                                                                       RECEIVING
    "done" frame                  the receive path waits for the KV (``settle``);
                                  every layer in: an event with the first token,
                                  and an ok "ack"; else the transfer fails and
                                  the ack carries the error

The sender's cancel, or the end of its connection, fails the transfer. Its
deadline waits for the first frame (``start_timeout_s``: the prefill may queue),
then runs ``timeout_s`` from there (``transfers.py``); deadlines and cancels on
this side are the transport's (``transport.py``).
"""

from __future__ import annotations

import time
from typing import Any

from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.base import TransferEvent
from splitserve.workers.kv.transfer.control import Listener
from splitserve.workers.kv.transfer.data_path import RecvPath
from splitserve.workers.kv.transfer.framing import Connection
from splitserve.workers.kv.transfer.ticket import TransferDone, TransferTicket, token_slots
from splitserve.workers.kv.transfer.transfers import Incoming, Transfers
from splitserve.workers.output.request_output import FirstTokenTimes


class Receiver:
    """The decode side of a transport: its listener and its transfers' states."""

    def __init__(
        self,
        kv_cache: KVCache,
        transfers: Transfers,
        listener: Listener,
        path: RecvPath,
    ):
        self.kv_cache = kv_cache
        self.transfers = transfers
        self.listener = listener
        self.path = path

    def start(self) -> None:
        """Accept senders from now on."""
        self.listener.start(self._on_frame, self._on_closed)

    def expect(self, ticket: TransferTicket) -> None:
        t = ticket
        slots = token_slots(t.block_ids, t.block_size, t.start_token, t.num_tokens)
        # Not blocking: the engine may have a step queued (async scheduling).
        slots = slots.to(self.kv_cache.k[0].device, non_blocking=True)
        incoming = Incoming(ticket, slots, self.transfers.start_deadline())
        self.path.expect(incoming)
        with self.transfers.lock:
            self.transfers.incoming[ticket.request_id] = incoming

    def close(self) -> None:
        self.listener.close()

    def _on_frame(self, conn: Connection, header: dict[str, Any], payload: bytearray) -> None:
        kind = header["kind"]
        if kind == "done":
            self._on_done(conn, header)
        elif kind == "cancel":
            self._on_cancel(header["request_id"])
        else:
            self.path.on_frame(conn, header, payload)

    def _on_done(self, conn: Connection, header: dict[str, Any]) -> None:
        rid = header["request_id"]
        if self.transfers.tracer is not None:
            at = time.perf_counter()
            self.transfers.tracer("done_received", rid, at, layers=header["layers"])
        with self.transfers.lock:
            incoming = self.transfers.incoming.get(rid)
        if incoming is not None:
            error = self.path.settle(incoming, header["layers"])  # not under the lock
            if error is not None:
                with self.transfers.lock:
                    self.transfers.fail(rid, "recv", error)
        ack: dict[str, Any] = {"kind": "ack", "request_id": rid, "ok": True}
        with self.transfers.lock:
            incoming = self.transfers.incoming.get(rid)
            if incoming is None:
                ack.update(ok=False, error="the decode worker no longer expects this request")
            elif incoming.layers_received != incoming.ticket.num_layers:
                error = (
                    f"received {incoming.layers_received} of {incoming.ticket.num_layers} KV layers"
                )
                ack.update(ok=False, error=error)
                self.transfers.fail(rid, "recv", error)
            else:
                self.transfers.end(rid, "recv")  # the receive path's release: KV in place
                if self.transfers.tracer is not None:
                    self.transfers.tracer("arrived", rid, time.perf_counter())
                top = [tuple(t) for t in header["top_logprobs"]]
                drafts = list(header.get("draft_token_ids", []))
                scales = list(header.get("kv_scales", []))
                times = header.get("first_token_times")
                done = TransferDone(
                    rid, header["first_token"], header["logprob"], top, drafts, scales,
                    FirstTokenTimes(**times) if times else None,
                )  # fmt: skip
                self.transfers.add_event(TransferEvent(rid, "recv", True, done=done))
        conn.send(ack)

    def _on_cancel(self, request_id: str) -> None:
        with self.transfers.lock:
            if request_id in self.transfers.incoming:
                self.transfers.fail(request_id, "recv", "the prefill worker cancelled the transfer")

    def _on_closed(self, conn: Connection, error: OSError) -> None:
        self.path.disconnected(conn)
        with self.transfers.lock:
            lost = [r for r, i in self.transfers.incoming.items() if i.conn is conn]
            for rid in lost:
                self.transfers.fail(rid, "recv", f"prefill worker went away mid-transfer: {error}")
