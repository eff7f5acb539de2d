"""The tracer of ``kv_transfer.py``: the transports' tracing hook (``transport.tracer``,
``workers/kv/transfer/tracing.py``) turned into the benchmark's stamps.

Always, on a receiver: when a hand-off's KV was in place (the end of a timed span)
and when its receives were queued. With ``pace`` on, the host's pace through each
step of the sender's and receiver's work; with the timeline on, CUDA events around
every gather, send, receive and scatter plus host instants placed on the GPU's
clock."""

from __future__ import annotations

import time
from typing import Any

import torch

# The timeline's GPU spans: the event that opens one, and the label of what it covers.
_SPANS = {
    "gather_queued": ("gather_launch", lambda f: f"gather {f['first']}+{f['layers']}"),
    "message_queued": ("message_launch", lambda f: f"send {f['message']}"),
    "recv_queued": ("recv_launch", lambda f: f"recv {f['message']}"),
    "scatter_queued": ("scatter_launch", lambda f: f"scatter {f['first']}+{f['layers']}"),
}
# Host instants on the timeline.
_MARKS = {
    "announce_received": "host: announce",
    "finish_send": "host: finish_send",
    "done_received": "host: done frame",
    "last_scatter_done": "host: last scatter seen",
}


class Stamps:
    """One transport's tracer (set it as ``transport.tracer``).

    ``arrived[rid]``: the receiver's clock when the KV of ``rid`` was in place (after a
    device synchronize with ``sync_device``: the CPU transport scatters on the current
    stream). ``host[rid]``: ``posted_at``, when the receiver had queued every receive;
    with ``pace`` on, also the sender's gathers (with their event waits) and sends and
    the receiver's posting, in seconds (``*_s`` summed over the transfer, ``*_at``
    instants, ``*_each`` one a call). The stamps cost the host a few microseconds a
    call, so hand-offs are timed with ``pace`` off (and a sender's transport then has
    no tracer). ``gpu_marks``, a list while the timeline is on: (what, begin, end) CUDA
    events around each gather, send, receive and scatter, in queue order, and host
    instants (``host_mark``).
    """

    def __init__(self, device: torch.device, sync_device: bool = False):
        self.device = device
        self.sync_device = sync_device
        self.pace = False
        self.arrived: dict[str, float] = {}
        self.host: dict[str, dict[str, Any]] = {}
        self.gpu_marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] | None = None
        self._host_marks: dict[torch.cuda.Event, float] = {}  # host clock of each host mark
        self._mark_stream: torch.cuda.Stream | None = None
        self._open: dict[tuple[str, str], tuple[float, torch.cuda.Event | None]] = {}
        self._began: dict[tuple[str, str], float] = {}  # a gather's or a send's first step
        self._receiving: dict[str, dict[str, Any]] = {}  # by rid, until its receives are in

    def __call__(self, event: str, rid: str, at: float, **fields: Any) -> None:
        if event == "arrived":
            self._arrived(rid)
        elif event == "receives_posted":
            posted = self._receiving.pop(rid, {}) if self.pace else {}
            if posted:
                posted["post_s"] = at - posted["announce_read_at"]
            self.host[rid] = {**posted, "posted_at": at}  # what posted_first waits for
        elif self.pace:
            self._paced(event, rid, at, fields)

    def _paced(self, event: str, rid: str, at: float, fields: dict[str, Any]) -> None:
        if event in _MARKS:
            self.host_mark(_MARKS[event])
        if event in ("gather_begin", "message_begin"):
            self._began[rid, event] = at
            name = "gather_in_at_each" if event == "gather_begin" else "issue_in_at_each"
            self._sender(rid).setdefault(name, []).append(at)
        elif event.endswith("_launch"):
            if event == "recv_launch":
                if fields["message"] == 0:
                    self.host_mark("host: recv 0 call")
                posting = self._receiving.setdefault(rid, {"announce_read_at": at})
                posting.setdefault("recv_call_at_each", []).append(at)
            self._open_span(rid, event, fields["stream"])
        elif event in _SPANS:
            spent = self._close_span(rid, event, at, fields)
            if event == "gather_queued":
                self._gathered(rid, at, spent)
            elif event == "message_queued":
                self._sent(rid, at, spent)
        elif event == "announce_received":
            self._receiving[rid] = {"announce_read_at": at}

    def _sender(self, rid: str) -> dict[str, Any]:
        return self.host.setdefault(rid, {"issue_s": 0.0, "gather_s": 0.0, "nccl_send_s": 0.0})

    def _gathered(self, rid: str, at: float, call_s: float) -> None:
        h, spent = self._sender(rid), at - self._began.pop((rid, "gather_begin"), at)
        h["gather_s"] += spent
        h["issue_s"] += spent
        h.setdefault("gather_out_at_each", []).append(at)
        h.setdefault("gather_call_each", []).append(call_s)

    def _sent(self, rid: str, at: float, call_s: float) -> None:
        h, spent = self._sender(rid), at - self._began.pop((rid, "message_begin"), at)
        h["nccl_send_s"] += spent
        h["issue_s"] += spent
        h.setdefault("issue_each", []).append(spent)
        h.setdefault("send_call_each", []).append(call_s)
        h["last_issue_at"] = at

    def _open_span(self, rid: str, event: str, stream: torch.cuda.Stream) -> None:
        start = None
        if self.gpu_marks is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
        self._open[rid, event] = (time.perf_counter(), start)  # after this tracer's own work

    def _close_span(self, rid: str, event: str, at: float, fields: dict[str, Any]) -> float:
        """The host seconds of the call between the span's two events."""
        opened, label = _SPANS[event]
        begin, start = self._open.pop((rid, opened), (at, None))
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(fields["stream"])
            self.gpu_marks.append((label(fields), start, end))
        return at - begin

    def _arrived(self, rid: str) -> None:
        if self.sync_device:
            torch.cuda.synchronize(self.device)
        self.arrived[rid] = time.perf_counter()
        self.host_mark("host: in place")  # beside the receiver's end stamp

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
