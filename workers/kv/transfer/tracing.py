"""The tracing hook: named, timestamped steps of each KV transfer, for benchmarks and
debugging.

Set a transport's ``tracer`` (``transport.tracer = tracer``; None, the default,
costs each step one ``is not None`` test) and it is called at each step::

    tracer(event, request_id, at, **fields)

``at`` is ``time.perf_counter()`` when the step was taken. The call runs on the
thread that took it (the engine's, or a transport thread), at times under the
transport's lock: a tracer returns quickly, raises nothing and calls nothing of
the transport.
GPU work is traced when the host queues it, not when it runs: each gather, send,
receive and scatter is bracketed by ``*_launch`` (just before the call that queues
it on ``stream``, after the waits that order it) and ``*_queued`` (just after), so a
tracer can record CUDA events on ``stream`` around it.

The events, in the order one transfer passes them (NCCL's or CPU's only where
marked; ``first, layers`` name layers ``first .. first + layers - 1``)::

    sender
      send_started                    start_send opened it (NCCL: the announce is written)
      layer_ready        layer        send_layer took the layer
      gather_begin       first, layers          NCCL: the host starts queueing a gather
      gather_launch      first, layers, stream  NCCL: just before the gather's launch
      gather_queued      first, layers, stream  NCCL: just after it
      message_begin      message      NCCL: the host starts queueing a message's send
      message_launch     message, stream        NCCL: just before the NCCL send call
      message_queued     message, stream        NCCL: just after it
      finish_send        layers       finish_send took it: the rest of the plan (NCCL), then
                                      "done", go out next
      acked              ok           the receiver's answer came; the transfer ended
    receiver
      announce_received               NCCL: the transfer's announce frame was read
      recv_launch        message, stream        NCCL: just before a receive's NCCL call
      recv_queued        message, stream        NCCL: just after it
      scatter_launch     first, layers, stream  NCCL: just before a scatter's launch
      scatter_queued     first, layers, stream  NCCL: just after it
      receives_posted                 NCCL: every receive and scatter of it is queued
      layer_received     layer        CPU: a layer frame is scattered into the blocks
      done_received      layers       the "done" frame was read
      last_scatter_done               NCCL: the host saw its last scatter complete
      arrived                         the KV is in place; its event is queued for poll()
    either side
      failed             side, error  the transfer failed; its event is queued for poll()

An NCCL receiver receives a transfer it does not expect all the same (the pair
stays in step), so its receive events come for such a transfer too.
"""

from __future__ import annotations

from typing import Any, Protocol

EVENTS = (
    "send_started",
    "layer_ready",
    "gather_begin",
    "gather_launch",
    "gather_queued",
    "message_begin",
    "message_launch",
    "message_queued",
    "finish_send",
    "acked",
    "announce_received",
    "recv_launch",
    "recv_queued",
    "scatter_launch",
    "scatter_queued",
    "receives_posted",
    "layer_received",
    "done_received",
    "last_scatter_done",
    "arrived",
    "failed",
)


class Tracer(Protocol):
    """Receives each traced step of a transport's transfers (see the module docstring)."""

    def __call__(self, event: str, request_id: str, at: float, **fields: Any) -> None: ...
