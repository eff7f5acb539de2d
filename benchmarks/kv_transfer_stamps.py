"""The KV transports of ``kv_transfer.py``, instrumented: when a hand-off ends on the
receiver, the host time of each step of the sender's and receiver's work, and with
the timeline on, CUDA events around every gather, send, receive and scatter plus
host instants placed on the GPU's clock."""

from __future__ import annotations

import time

import torch

from splitserve.workers.kv.transfer.cpu_transport import CpuKVTransport
from splitserve.workers.kv.transfer.nccl_transport import NcclKVTransport


class _Stamp:
    """Records when a transfer's KV is in place on the receiver: the end of a timed span."""

    # The CPU transport's scatters are queued on the current stream, so its KV is in
    # place after a device synchronize; the NCCL transport's ``_finish_incoming`` has
    # already waited for its last scatter.
    sync_device = False

    def __init__(self, *args, **kwargs):
        self.arrived: dict[str, float] = {}
        super().__init__(*args, **kwargs)

    def _finish_incoming(self, inc) -> None:
        super()._finish_incoming(inc)
        if self.sync_device:
            torch.cuda.synchronize(self.device)
        self.arrived[inc.ticket.request_id] = time.perf_counter()


class StampedNccl(_Stamp, NcclKVTransport):
    """With ``pace`` on, also stamps the host work per transfer: the sender's gathers
    (with their event waits) and sends, and the receiver's posting of all receives and
    scatters. The stamps cost the host a few microseconds a call, so hand-offs are
    timed with ``pace`` off; the receiver then stamps only when it has posted."""

    def __init__(self, *args, **kwargs):
        self.pace = False
        self.host: dict[str, dict[str, float]] = {}
        # With --timeline: (what, begin, end) CUDA events around each gather, send,
        # receive and scatter, in queue order (None: off).
        self.gpu_marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] | None = None
        self._host_marks: dict[torch.cuda.Event, float] = {}  # host clock of each host mark
        self._mark_stream: torch.cuda.Stream | None = None
        self._announce_read_at = float("nan")  # the receiver's last announce frame
        super().__init__(*args, **kwargs)

    def _finish_incoming(self, inc) -> None:
        self.host_mark("host: last scatter seen")
        super()._finish_incoming(inc)
        self.host_mark("host: in place")  # beside the receiver's end stamp

    def finish_send(self, request_id, done) -> None:
        self.host_mark("host: finish_send")
        super().finish_send(request_id, done)

    def _on_done(self, conn, header) -> None:
        self.host_mark("host: done frame")
        super()._on_done(conn, header)

    def _on_frame(self, conn, header) -> None:
        if header["kind"] == "announce":
            self._announce_read_at = time.perf_counter()
            self.host_mark("host: announce")
        super()._on_frame(conn, header)

    def _span(self, what: str, stream: torch.cuda.Stream, queue) -> float:
        """``queue()``, with timing events around it on ``stream`` when the timeline is on;
        the host seconds ``queue()`` took."""
        if self.gpu_marks is None:
            begin = time.perf_counter()
            queue()
            return time.perf_counter() - begin
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record(stream)
        begin = time.perf_counter()
        queue()
        spent = time.perf_counter() - begin
        end.record(stream)
        self.gpu_marks.append((what, start, end))
        return spent

    def host_mark(self, what: str) -> None:
        """With the timeline on, an instant on the GPU's clock for a moment of the host:
        an event on an idle stream, which the GPU passes as soon as it is queued."""
        if self.gpu_marks is None:
            return
        if self._mark_stream is None:
            self._mark_stream = torch.cuda.Stream(self.device)
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._mark_stream)
        self._host_marks[event] = time.perf_counter()
        self.gpu_marks.append((what, event, event))

    def timeline(self) -> list[tuple[str, float, float]]:
        """(what, begin us, end us) of every marked span on the host's clock (both
        actors read the same monotonic clock), placed through the first host mark;
        clears them."""
        marks, self.gpu_marks = self.gpu_marks or [], []
        host, self._host_marks = self._host_marks, {}
        if not marks or not host:
            return []
        torch.cuda.synchronize(self.device)
        first = marks[0][1]
        anchor, host_s = next(iter(host.items()))
        offset_us = host_s * 1e6 - first.elapsed_time(anchor) * 1e3

        def at(event) -> float:
            return offset_us + first.elapsed_time(event) * 1e3

        return [(w, at(b), at(e)) for w, b, e in marks]

    def _host(self, rid: str) -> dict[str, float]:
        return self.host.setdefault(rid, {"issue_s": 0.0, "gather_s": 0.0, "nccl_send_s": 0.0})

    def _gather_layers(self, pair, out, send, end) -> None:
        if not self.pace:
            return super()._gather_layers(pair, out, send, end)
        h = self._host(out.ticket.request_id)
        begin = time.perf_counter()
        super()._gather_layers(pair, out, send, end)
        done = time.perf_counter()
        spent = done - begin
        h["gather_s"] += spent
        h["issue_s"] += spent
        h.setdefault("gather_in_at_each", []).append(begin)
        h.setdefault("gather_out_at_each", []).append(done)

    def _stage_layers(self, pair, out, send, first, layers, offset) -> None:
        if not self.pace:
            return super()._stage_layers(pair, out, send, first, layers, offset)
        queue = lambda: super(StampedNccl, self)._stage_layers(  # noqa: E731
            pair, out, send, first, layers, offset
        )
        spent = self._span(f"gather {first}+{layers}", pair.copy_stream, queue)
        self._host(out.ticket.request_id).setdefault("gather_call_each", []).append(spent)

    def _issue(self, pair, send) -> None:
        if not self.pace:
            return super()._issue(pair, send)
        h = self._host(pair.sending[0].ticket.request_id)
        nccl_send = pair.send
        h.setdefault("issue_in_at_each", []).append(time.perf_counter())

        def timed_send(message, buf, nbytes) -> None:
            queue = lambda: nccl_send(message, buf, nbytes)  # noqa: E731
            spent = self._span(f"send {message}", pair.lane(message).stream, queue)
            h.setdefault("send_call_each", []).append(spent)

        pair.send = timed_send
        begin = time.perf_counter()
        try:
            super()._issue(pair, send)
        finally:
            del pair.send
        end = time.perf_counter()
        h["nccl_send_s"] += end - begin
        h["issue_s"] += end - begin
        h.setdefault("issue_each", []).append(end - begin)
        h["last_issue_at"] = end

    def _unstage_layers(self, pair, recv, message, staging, offset, inc) -> None:
        if not self.pace:
            return super()._unstage_layers(pair, recv, message, staging, offset, inc)
        queue = lambda: super(StampedNccl, self)._unstage_layers(  # noqa: E731
            pair, recv, message, staging, offset, inc
        )
        self._span(f"scatter {message[0]}+{message[1]}", pair.copy_stream, queue)

    def _post_receives(self, pair, conn, rid, plan, layer_bytes) -> None:
        if not self.pace:
            super()._post_receives(pair, conn, rid, plan, layer_bytes)
            self.host[rid] = {"posted_at": time.perf_counter()}  # what posted_first waits for
            return
        begin = time.perf_counter()
        self.host_mark("host: posting")
        nccl_recv, called = pair.recv, []

        def marked_recv(i, buf, nbytes) -> None:
            if i == 0:
                self.host_mark("host: recv 0 call")
            called.append(time.perf_counter())
            self._span(f"recv {i}", pair.lane(i).stream, lambda: nccl_recv(i, buf, nbytes))

        pair.recv = marked_recv
        try:
            super()._post_receives(pair, conn, rid, plan, layer_bytes)
        finally:
            del pair.recv
        end = time.perf_counter()
        self.host[rid] = {
            "post_s": end - begin,
            "posted_at": end,
            "announce_read_at": self._announce_read_at,
            "posting_at": begin,
            "recv_call_at_each": called,
        }


class StampedCpu(_Stamp, CpuKVTransport):
    sync_device = True
