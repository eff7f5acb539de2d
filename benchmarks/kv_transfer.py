"""KV hand-off between two GPUs through the NCCL transport, against raw NCCL send/recv.

    python benchmarks/kv_transfer.py [--tokens 4096] [--repeat 10] [--layer-gap-us 0 500]
        [--json [PATH]]

Two Ray actors, one GPU each (each sees only its own, as a Serve replica does;
--all-gpus-visible for both), hold a Qwen3-8B-shaped KV cache (36 layers,
8 KV heads, head dim 128, bf16): block size 16 on the sender, 32 on the
receiver, the prompt's blocks drawn at random from a cache four times its size.
One hand-off moves every layer of a --tokens prompt (4096: 36 x 16.8 MB), all
layers ready at the start (the catch-up case; in serving each layer waits for
its compute). As in an engine, the sender's host queues each layer's compute (a
kernel, empty here) before reporting the layer with ``send_layer``: a host that
queued nothing before the hand-off is cold, and its first calls cost two to four
times as much.

- transport: from just before the first ``send_layer`` (sender) to the moment
  the receiver's transport has the last layer scattered into its blocks
  (its ``arrived`` trace event, receiver). Both actors read the host's monotonic
  clock. Effective GB/s counts gather, send, receive and scatter. Rows for
  several ``layers_per_message`` m (1 = per layer; more = coalesced, in
  messages of 1, 2, 4, ... up to m layers and back down, ``message_plan``; with
  --max-message-mb, fewer layers where m would pass that size: ``transfer_plan``).
- one by one (--layer-gap-us G > 0): the sender's compute stream sleeps G us
  before each layer, as if computing it (send_layer is called as each layer is
  queued, as in serving). "tail" is the time from the end of the last layer's
  compute to the receiver having it all: what a prefill's TTFT pays.
- raw NCCL (the baseline, same actors, same run): send/recv of the same bytes
  between preallocated buffers, the receives posted first; one message of all
  the bytes, and the transport's message pattern.
- gather / scatter alone: the transport's index_select / index_copy_ kernels
  for all layers on one GPU, without any transfer.
- cpu: the CPU transport (bytes in the TCP frames) on a --cpu-tokens prompt.
- host times (--pace: each row timed again with host stamps, which slow the host
  by a few microseconds a call; the rows themselves are timed without them): the
  sender's gathers (one launch per layer, with their event waits) and sends, and
  the receiver's posting of every receive and scatter, summed per transfer; and
  the sender's pace, printed under each row (JSON ``host_pace_us``): when each
  ``send_layer`` returned, when each gather and each message's issue began (us
  from the start), and the host time of each gather launch, NCCL send call and
  message issue; the receiver's, when it read the announce frame and called each
  receive. The stamps come through the transports' tracing hook
  (``kv_transfer_stamps.py``).
- --timeline: one more hand-off with CUDA events around each gather, send,
  receive and scatter, and host instants on the GPU's clock (the sender's
  start, the receiver's "done" frame and end stamp), printed per GPU (where
  the wire waits shows there).
- --first-message-layers F: the plan ramps F, 2F, 4F, ... layers up to the cap
  and back down (rows for each F).

Each figure is the median of --repeat runs after --warmup runs. The last run of
each mode goes into zeroed receiver slots and its KV is checked against the
sender's (a checksum per layer).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import math
import os
import platform
import random
import secrets
import sys
import threading
import time
from pathlib import Path
from statistics import median

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_transfer_stamps  # noqa: E402
from kv_transfer_stamps import Stamps  # noqa: E402

from splitserve.workers.kv.cache import KVCache  # noqa: E402
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.kv.transfer.cpu_transport import CpuKVTransport
from splitserve.workers.kv.transfer.nccl_pair import (
    communicator,
    transfer_plan,
    unique_id,
    wait_event,
)
from splitserve.workers.kv.transfer.nccl_transport import NcclKVTransport
from splitserve.workers.kv.transfer.ticket import TransferDone, TransferTicket, token_slots

LAYERS, HEADS, DIM = 36, 8, 128  # Qwen3-8B
DTYPE = torch.bfloat16
DEFAULT_JSON = "docs/perf/kv_transfer_nccl.json"


class Worker:
    """One side: a KV cache on the actor's GPU, both transports, and raw NCCL buffers."""

    def __init__(
        self,
        role: str,
        block_size: int,
        tokens: int,
        cpu_tokens: int,
        env: dict[str, str],
        auth_key: str,  # the control plane's key, the same on both sides
        seed: int,
        device: str,
    ):
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.update(env)  # before any communicator: NCCL reads its settings once
        self.device = torch.device(device)
        self.tokens = tokens
        need = math.ceil(tokens / block_size)
        spec = KVLayout(LAYERS, HEADS, DIM, block_size, DTYPE)
        self.cache = KVCache(spec, 4 * need + 1, self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for t in self.cache.k + self.cache.v:
            t[1:] = torch.randn(t[1:].shape, generator=gen, device=self.device).to(DTYPE)
        self.blocks = random.Random(seed).sample(range(1, self.cache.num_blocks), need)
        self.peer = None
        self.role = role
        self.transports = {
            "nccl": NcclKVTransport(
                self.cache, owner=role, rendezvous=self._rendezvous, auth_key=auth_key
            ),
            "cpu": CpuKVTransport(self.cache, owner=role, auth_key=auth_key),
        }
        self.stamps = {"nccl": Stamps(self.device), "cpu": Stamps(self.device, sync_device=True)}
        self._trace()
        self.cpu_tokens = cpu_tokens
        self.raw = None
        self.raw_issue_s: list[float] = []
        self.sleep_cycles_per_us = self._calibrate_sleep()
        self.busy_before_us = 0.0
        self.busy_with = "sleep"
        self._hog: torch.Tensor | None = None  # the copies of ``busy_with="copy"``
        self._copy_us = 0.0

    def set_busy_before_us(self, us: float, busy_with: str = "sleep") -> None:
        self.busy_before_us, self.busy_with = us, busy_with

    def _busy(self, us: float) -> None:
        """Keep the GPU working for about ``us``: spinning (``sleep``) or streaming memory
        (``copy``: 256 MB device copies, as a prefill's matmuls keep HBM busy)."""
        if self.busy_with == "sleep":
            torch.cuda._sleep(int(us * self.sleep_cycles_per_us))
            return
        if self._hog is None:
            self._hog = torch.empty(2, 256 << 20, dtype=torch.uint8, device=self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                self._hog[1].copy_(self._hog[0])
            end.record()
            end.synchronize()
            self._copy_us = start.elapsed_time(end) * 100
        for _ in range(max(1, round(us / self._copy_us))):
            self._hog[1].copy_(self._hog[0])

    # ---- set-up --------------------------------------------------------------

    def set_peer(self, peer) -> None:
        self.peer = peer

    def _rendezvous(self, ticket: TransferTicket, pair_key: str, unique_id: bytes) -> None:
        ray.get(self.peer.join.remote(pair_key, unique_id))

    def join(self, pair_key: str, unique_id: bytes) -> None:
        self.transports["nccl"].join(pair_key, unique_id)

    def set_layers_per_message(self, n: int, first: int = 2) -> None:
        self.transports["nccl"].options.layers_per_message = n
        self.transports["nccl"].options.first_message_layers = first

    def set_max_message_bytes(self, nbytes: int | None) -> None:
        self.transports["nccl"].options.max_message_bytes = nbytes

    def set_lanes(self, lanes: int) -> None:
        """Before the first hand-off: the communicators of the pair the sender makes."""
        self.transports["nccl"].options.lanes = lanes

    def lanes(self) -> int:
        return self.transports["nccl"].options.lanes

    def set_nccl_stream_priority(self, priority: int) -> None:
        """Before the first hand-off: the priority of the pair's NCCL stream."""
        self.transports["nccl"].options.stream_priority = priority

    def set_timeline(self, on: bool) -> None:
        self.stamps["nccl"].gpu_marks = [] if on else None
        self.set_pace(on)

    def set_pace(self, on: bool) -> None:
        self.stamps["nccl"].pace = on
        self._trace()

    def _trace(self) -> None:
        """A receiver's transports always trace (the arrival stamps the end of a timed
        hand-off); a sender's only with pace on, so that its hot path pays nothing in
        the timed runs."""
        for kind, transport in self.transports.items():
            stamps = self.stamps[kind]
            transport.tracer = stamps if self.role == "decode" or stamps.pace else None

    def timeline(self) -> list[tuple[str, float, float]]:
        return self.stamps["nccl"].timeline()

    def watchdog(self, seconds: float) -> None:
        faulthandler.dump_traceback_later(seconds, exit=False)

    # ---- one hand-off --------------------------------------------------------

    def num_tokens(self, kind: str) -> int:
        return self.cpu_tokens if kind == "cpu" else self.tokens

    def expect(self, kind: str, rid: str) -> bytes:
        t = self.transports[kind]
        ticket = t.make_ticket(rid, self.blocks, 0, self.num_tokens(kind), LAYERS)
        t.expect(ticket)
        return ticket.pack()

    def send(
        self, kind: str, ticket: bytes, gap_us: float = 0, posted_first: bool = False
    ) -> tuple[float, float]:
        """Send every layer, each after a compute-stream sleep of ``gap_us`` (an empty
        kernel at 0); return the sender's clock just before the first layer and when the
        last sleep ended.
        ``posted_first``: start only once the receiver has queued its receives (as it
        has in serving, where the announce goes out before the prefill computes)."""
        t, ticket = self.transports[kind], TransferTicket.unpack(ticket)
        t.start_send(ticket, self.blocks)
        if posted_first:
            ray.get(self.peer.posted.remote(ticket.request_id))
        if self.busy_before_us:  # a GPU that was computing, not idle, when the layers come
            with torch.cuda.device(self.device):
                self._busy(self.busy_before_us)
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        if kind == "nccl":
            self.stamps["nccl"].host_mark("host: start")
        returned = []
        with torch.cuda.device(self.device):
            for layer in range(LAYERS):
                # The layer's compute: a kernel the host queues before reporting the layer,
                # as an engine does; it returns at once when gap_us is 0.
                torch.cuda._sleep(int(gap_us * self.sleep_cycles_per_us))
                t.send_layer(ticket.request_id, layer)
                returned.append(time.perf_counter())
            computed = torch.cuda.Event()
            computed.record()
        if kind == "nccl":  # the host's pace: when each send_layer returned
            host = self.stamps["nccl"].host
            host.setdefault(ticket.request_id, {})["send_layer_at_each"] = returned
        t.finish_send(ticket.request_id, TransferDone(ticket.request_id, 1))
        if not gap_us:
            return start, start
        while not computed.query():
            time.sleep(0)
        return start, time.perf_counter()

    def _calibrate_sleep(self) -> float:
        """GPU clock cycles per microsecond of ``torch.cuda._sleep``."""
        cycles = 20_000_000
        with torch.cuda.device(self.device):
            times = []
            for _ in range(3):
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) * 1e3)
        return cycles / median(times)

    def posted(self, rid: str, timeout: float = 10.0) -> None:
        """Wait until this receiver has queued the receives of ``rid``."""
        deadline = time.monotonic() + timeout
        while "posted_at" not in self.stamps["nccl"].host.get(rid, {}):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the receives of {rid} were not posted")
            time.sleep(0.0001)

    def host_times(self, rid: str) -> dict[str, float]:
        return self.stamps["nccl"].host.pop(rid, {})

    def finished(
        self, kind: str, rid: str, timeout: float = 60.0
    ) -> tuple[bool, str | None, float]:
        """Wait for the transfer's event; (ok, error, receiver clock when the KV was in place)."""
        t, deadline = self.transports[kind], time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in t.poll():
                if e.request_id == rid:
                    return e.ok, e.error, self.stamps[kind].arrived.get(rid, float("nan"))
            time.sleep(0.0005)
        return False, "no event", float("nan")

    # ---- checks --------------------------------------------------------------

    def _slots(self, tokens: int) -> torch.Tensor:
        return token_slots(self.blocks, self.cache.block_size, 0, tokens).to(self.device)

    def checksums(self, tokens: int) -> list[int]:
        """Per layer, a position-weighted sum of the prompt's K and V bits."""
        slots, sums = self._slots(tokens), []
        for k, v in zip(self.cache.k, self.cache.v):
            x = torch.stack((_flat(k)[slots], _flat(v)[slots])).view(torch.int16).flatten()
            w = torch.arange(x.numel(), device=self.device) % 65521 + 1
            sums.append(int((x.to(torch.int64) * w).sum()))
        return sums

    def clear(self, tokens: int) -> None:
        slots = self._slots(tokens)
        for k, v in zip(self.cache.k, self.cache.v):
            _flat(k)[slots] = 0
            _flat(v)[slots] = 0
        torch.cuda.synchronize(self.device)

    # ---- gather / scatter alone ----------------------------------------------

    def copy_alone_ms(self, op: str, fused: bool, repeat: int = 5) -> float:
        """GPU time of the transport's gather (or scatter) of every layer, no transfer."""
        t = self.transports["nccl"].copier
        if fused and t.kernel is None:
            return float("nan")  # the kernels did not compile here
        slots = self._slots(self.tokens)
        buf = torch.empty((LAYERS, 2, self.tokens, HEADS, DIM), dtype=DTYPE, device=self.device)
        copy = t.gather if op == "gather" else t.scatter
        t.fused_copy, times = fused, []
        with torch.cuda.device(self.device):  # the events go on this device's stream
            for _ in range(repeat + 2):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                copy(0, slots, buf)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        t.fused_copy = True
        return median(times[2:])

    def set_fused_copy(self, fused: bool) -> None:
        self.transports["nccl"].copier.fused_copy = fused  # raises where they did not compile

    # ---- raw NCCL --------------------------------------------------------------

    def raw_connect(self, nbytes: int) -> None:
        """Sender: a separate communicator with the peer, and a buffer of ``nbytes``."""
        uid = unique_id()
        joined = self.peer.raw_join.remote(uid, nbytes)
        self._raw_setup(uid, 0, nbytes)
        ray.get(joined)

    def raw_join(self, uid: bytes, nbytes: int) -> None:
        self._raw_setup(uid, 1, nbytes)

    def _raw_setup(self, uid: bytes, rank: int, nbytes: int) -> None:
        import cupy

        with cupy.cuda.Device(self.device.index):
            self.raw = communicator(uid, rank)
        self.raw_stream = torch.cuda.Stream(self.device)
        self.raw_buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.device)
        # NCCL connects a peer during the first send/recv, and both ranks must be in it:
        # do that now, so a posted receive never waits on the CPU for the sender.
        self._raw_ops([nbytes], send=rank == 0)
        torch.cuda.synchronize(self.device)

    def _raw_ops(self, sizes: list[int], send: bool) -> None:
        from cupy.cuda import nccl

        op = self.raw.send if send else self.raw.recv
        offset, base = 0, self.raw_buf.data_ptr()
        with torch.cuda.device(self.device):
            for size in sizes:
                peer = 1 if send else 0
                op(base + offset, size, nccl.NCCL_UINT8, peer, self.raw_stream.cuda_stream)
                offset += size

    def raw_post(self, sizes: list[int]) -> None:
        """Receiver: post the receives, and stamp the clock when they are done."""
        self._raw_ops(sizes, send=False)
        done = torch.cuda.Event()
        done.record(self.raw_stream)

        def stamp() -> None:  # the transport's own wait: a zero sleep would add its slack
            wait_event(done, None, time.monotonic() + 60)
            self.raw_done_at = time.perf_counter()

        self.raw_waiter = threading.Thread(target=stamp, daemon=True)
        self.raw_waiter.start()

    def raw_send(self, sizes: list[int]) -> float:
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self._raw_ops(sizes, send=True)
        self.raw_issue_s.append(time.perf_counter() - start)
        return start

    def raw_issue_ms(self) -> float:
        """Median host time of issuing the raw sends, then forget them."""
        issue, self.raw_issue_s = self.raw_issue_s, []
        return median(issue) * 1e3 if issue else float("nan")

    def raw_finished(self) -> float:
        self.raw_waiter.join()
        return self.raw_done_at


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, *cache.shape[2:])


# ---- driver ----------------------------------------------------------------------


def time_transport(
    sender, receiver, kind: str, tag: str, warmup: int, repeat: int, gap_us=0, posted_first=False
):
    """Median seconds of one hand-off and of its tail after the last layer's compute,
    whether the last one arrived intact, and the median host times (seconds, relative to
    the start where they are instants)."""
    times, tails, host = [], [], []
    for i in range(warmup + repeat):
        last = i == warmup + repeat - 1
        if last:
            ray.get(receiver.clear.remote(ray.get(receiver.num_tokens.remote(kind))))
        rid = f"{tag}-{i}"
        ticket = ray.get(receiver.expect.remote(kind, rid))
        # The receiver waits from before the start, as a decode worker's loop does: a
        # Ray call arriving at the end would hold its GIL while the last frames come in.
        arrival = receiver.finished.remote(kind, rid)
        start, computed = ray.get(sender.send.remote(kind, ticket, gap_us, posted_first))
        ok, error, end = ray.get(arrival)
        sent_ok, sent_error, _ = ray.get(sender.finished.remote(kind, rid))
        if not (ok and sent_ok):
            raise RuntimeError(f"{rid} failed: receiver {error!r}, sender {sent_error!r}")
        h = {}
        if kind == "nccl":
            h = ray.get([sender.host_times.remote(rid), receiver.host_times.remote(rid)])
            h = {**h[0], **h[1]}
            for key, value in h.items():  # host instants, from the sender's start
                if key.endswith("_at"):
                    h[key] = value - start
                elif key.endswith("_at_each"):
                    h[key] = [at - start for at in value]
        if i >= warmup:
            times.append(end - start)
            tails.append(end - computed)
            host.append(h)
    tokens = ray.get(receiver.num_tokens.remote(kind))
    intact = ray.get(sender.checksums.remote(tokens)) == ray.get(receiver.checksums.remote(tokens))
    host_median = {key: _median_of(h[key] for h in host) for key in host[0]}
    return median(times), median(tails), intact, host_median


def _median_of(values):
    """The median of numbers, or of equal-length lists element by element."""
    values = list(values)
    if isinstance(values[0], list):
        return [median(column) for column in zip(*values)]
    return median(values)


def record_timeline(
    sender,
    receiver,
    layer_bytes: int,
    layers_per_message: int = 8,
    first: int = 1,
    posted_first: bool = False,
    max_bytes: int | None = None,
) -> list:
    """One hand-off with CUDA events around every gather, send, receive and scatter,
    and host instants (the sender's start; the receiver's announce, done frame and end
    stamp); prints and returns (side, what, begin us, end us) of both GPUs, in
    microseconds from the sender's start."""
    ray.get(sender.set_layers_per_message.remote(layers_per_message, first))
    ray.get([side.set_fused_copy.remote(True) for side in (sender, receiver)])
    ray.get([side.set_timeline.remote(True) for side in (sender, receiver)])
    time_transport(sender, receiver, "nccl", "timeline", 0, 1, posted_first=posted_first)
    spans = {"sender": ray.get(sender.timeline.remote())}
    spans["receiver"] = ray.get(receiver.timeline.remote())
    ray.get([side.set_timeline.remote(False) for side in (sender, receiver)])
    start = next(b for w, b, _ in spans["sender"] if w == "host: start")
    rows = sorted(
        ((side, w, b - start, e - start) for side, marks in spans.items() for w, b, e in marks),
        key=lambda row: row[2],
    )
    plan = transfer_plan(LAYERS, layer_bytes, layers_per_message, first, max_bytes)
    plan = [n for _, n in plan]
    posted = ", receives posted first" if posted_first else ""
    print(f"\nTimeline (plan {plan}{posted}), us from the sender's start")
    for side, what, begin, end in rows:
        print(f"  {side:<8} {what:<18} {begin:9.1f} {end:9.1f} {end - begin:8.1f}")
    return [list(row) for row in rows]


def time_raw(sender, receiver, sizes: list[int], warmup: int, repeat: int) -> float:
    times = []
    for i in range(warmup + repeat):
        ray.get(receiver.raw_post.remote(sizes))
        start = ray.get(sender.raw_send.remote(sizes))
        end = ray.get(receiver.raw_finished.remote())
        if i >= warmup:
            times.append(end - start)
    return median(times)


def _command() -> str:
    """This run's command line, without the JSON path and the debugging options."""
    words, argv, i = [], sys.argv[1:], 0
    while i < len(argv):
        word, has_value = argv[i], i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if word in ("--json", "--watchdog", "--label"):
            if word == "--json":
                words.append(word)
            i += 2 if has_value else 1
        else:
            words.append(word)
            i += 1
    return " ".join(["python benchmarks/kv_transfer.py", *words])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--cpu-tokens", type=int, default=1024, help="0 skips the CPU transport")
    ap.add_argument("--send-block-size", type=int, default=16)
    ap.add_argument("--recv-block-size", type=int, default=32)
    ap.add_argument("--layers-per-message", type=int, nargs="+", default=[1, 4, 8, 16, 36])
    ap.add_argument(
        "--first-message-layers",
        type=int,
        nargs="+",
        default=[1],
        help="the plan's first (and last) message size; rows for each, by --layers-per-message",
    )
    ap.add_argument(
        "--layer-gap-us",
        type=float,
        nargs="+",
        default=[0],
        help="compute-stream sleep before each layer; 0 = all layers ready at once",
    )
    ap.add_argument(
        "--all-gpus-visible",
        action="store_true",
        help="actors ask Ray for no GPU, see both and use cuda:0 and cuda:1; by default "
        "each asks for one GPU and sees only it, as a Serve replica does",
    )
    ap.add_argument(
        "--env",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="environment of both actors (NCCL settings such as NCCL_P2P_NVL_CHUNKSIZE)",
    )
    ap.add_argument(
        "--nccl-stream-priority",
        type=int,
        help="CUDA priority of the transport's NCCL streams (default: the transport's, -1, "
        "above the copies and the compute; 0: the same)",
    )
    ap.add_argument(
        "--busy-before-us",
        type=float,
        default=0,
        help="the sender's GPU works this long just before each timed hand-off (not timed), "
        "as a prefill GPU computes before its layers are sent; 0 = idle before",
    )
    ap.add_argument(
        "--busy-with",
        choices=["sleep", "copy"],
        default="copy",
        help="what keeps it busy: a spinning kernel, or device copies that stream memory",
    )
    ap.add_argument("--watchdog", type=float, default=0, help="dump all stacks after S seconds")
    ap.add_argument("--label", default="", help="the machine, for the JSON (e.g. nvidia-h200-x2)")
    ap.add_argument(
        "--torch-copy-layers-per-message",
        type=int,
        nargs="*",
        default=[8],
        help="rows with the torch gather/scatter instead of the fused kernels",
    )
    ap.add_argument(
        "--posted-first-layers-per-message",
        type=int,
        nargs="*",
        default=[8],
        help="rows that start the clock once the receiver has queued its receives",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="also time every gather, send, receive and scatter of one hand-off on the GPUs",
    )
    ap.add_argument(
        "--pace",
        action="store_true",
        help="time each row again with host stamps and print the sender's and receiver's "
        "pace under it (the stamps slow the host, so the rows are timed without them)",
    )
    ap.add_argument(
        "--lanes",
        type=int,
        help="communicators the transport's pair has, the messages alternating between "
        "them (default: the transport's)",
    )
    ap.add_argument(
        "--max-message-mb",
        type=int,
        help="the transport's cap on a message's size in MiB (default: none here, so each "
        "row has the layers a message it names; the transport's own default is 128)",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument(
        "--json", nargs="?", const=DEFAULT_JSON, help=f"write JSON (default path {DEFAULT_JSON})"
    )
    args = ap.parse_args()

    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=False)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # actors inherit it
    if args.all_gpus_visible:
        os.environ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "0"  # num_gpus=0 keeps GPUs visible
    ray.init(include_dashboard=False, log_to_driver=True)
    ray.cloudpickle.register_pickle_by_value(kv_transfer_stamps)  # the actors need not import it
    if ray.cluster_resources().get("GPU", 0) < 2:
        raise SystemExit(f"needs 2 GPUs, Ray sees {ray.cluster_resources().get('GPU', 0)}")
    env = dict(item.split("=", 1) for item in args.env)
    remote = ray.remote(num_gpus=0 if args.all_gpus_visible else 1, max_concurrency=4)(Worker)
    devices = ("cuda:0", "cuda:1") if args.all_gpus_visible else ("cuda:0", "cuda:0")
    common = (args.tokens, args.cpu_tokens, env, secrets.token_hex(16))
    sender = remote.remote("prefill", args.send_block_size, *common, 1, devices[0])
    receiver = remote.remote("decode", args.recv_block_size, *common, 2, devices[1])
    ray.get([sender.set_peer.remote(receiver), receiver.set_peer.remote(sender)])
    ray.get(sender.set_busy_before_us.remote(args.busy_before_us, args.busy_with))
    if args.lanes is not None:
        ray.get(sender.set_lanes.remote(args.lanes))
    max_bytes = None if args.max_message_mb is None else args.max_message_mb << 20
    ray.get(sender.set_max_message_bytes.remote(max_bytes))
    if args.nccl_stream_priority is not None:
        priority = args.nccl_stream_priority
        ray.get([side.set_nccl_stream_priority.remote(priority) for side in (sender, receiver)])
    if args.watchdog:
        ray.get([sender.watchdog.remote(args.watchdog), receiver.watchdog.remote(args.watchdog)])
    print("actors ready", flush=True)

    elem = torch.empty((), dtype=DTYPE).element_size()
    layer_bytes = 2 * args.tokens * HEADS * DIM * elem
    total = LAYERS * layer_bytes
    ray.get(sender.raw_connect.remote(total))
    print("raw NCCL communicator ready", flush=True)
    w, r = args.warmup, args.repeat
    raw_one = time_raw(sender, receiver, [total], w, r)
    print(f"raw NCCL, one message: {raw_one * 1e3:.3f} ms", flush=True)
    alone = {
        (op, copy): ray.get(side.copy_alone_ms.remote(op, copy == "fused"))
        for op, side in (("gather", sender), ("scatter", receiver))
        for copy in ("fused", "torch")
    }

    rows = []
    modes = [
        (m, f, "fused", gap, False)
        for gap in args.layer_gap_us
        for m in args.layers_per_message
        for f in args.first_message_layers
    ]
    f0 = args.first_message_layers[0]
    modes += [(m, f0, "fused", 0, True) for m in args.posted_first_layers_per_message]
    modes += [(m, f0, "torch", 0, False) for m in args.torch_copy_layers_per_message]
    for m, first, copy, gap, posted_first in modes:
        ray.get(sender.set_layers_per_message.remote(m, first))
        ray.get([side.set_fused_copy.remote(copy == "fused") for side in (sender, receiver)])
        plan = transfer_plan(LAYERS, layer_bytes, m, first, max_bytes)
        sizes = [n * layer_bytes for _, n in plan]
        tag = f"nccl-m{m}-f{first}-{copy}-g{gap:g}-p{posted_first:d}"
        seconds, tail, intact, host = time_transport(
            sender, receiver, "nccl", tag, w, r, gap, posted_first
        )
        paced = None
        if args.pace:  # again, with the host stamps (which slow the host a little)
            ray.get([side.set_pace.remote(True) for side in (sender, receiver)])
            paced, _, _, host = time_transport(
                sender, receiver, "nccl", tag + "-pace", 1, r, gap, posted_first
            )
            ray.get([side.set_pace.remote(False) for side in (sender, receiver)])
        ray.get(sender.raw_issue_ms.remote())
        raw_same = time_raw(sender, receiver, sizes, w, r)
        raw_issue_ms = ray.get(sender.raw_issue_ms.remote())
        scalars = {k: v for k, v in host.items() if not isinstance(v, list)}
        pace = {k: [round(x * 1e6, 1) for x in v] for k, v in host.items() if isinstance(v, list)}
        stamped = ""
        if paced:
            stamped = f"; with host stamps {paced * 1e3:.3f} ms, host (ms): " + ", ".join(
                f"{k} {v * 1e3:.3f}" for k, v in scalars.items()
            )
        print(
            f"m={m} first={first} {copy} gap={gap:g}us posted_first={posted_first}: "
            f"{seconds * 1e3:.3f} ms, tail {tail * 1e3:.3f} ms, raw {raw_same * 1e3:.3f} ms "
            f"(issued in {raw_issue_ms:.3f}){stamped}",
            flush=True,
        )
        for key, each in pace.items():
            print(f"  {key} (us): " + " ".join(f"{x:.0f}" for x in each), flush=True)
        rows.append(
            {
                "transport": "nccl",
                "copy": copy,
                "layers_per_message": m,
                "first_message_layers": first,
                "layer_gap_us": gap,
                "posted_first": posted_first,
                "paced_ms": round(paced * 1e3, 3) if paced else None,
                "host_ms": {k: round(v * 1e3, 3) for k, v in scalars.items()} if paced else {},
                "host_pace_us": pace,
                "tail_ms": round(tail * 1e3, 3) if gap else None,
                "messages": len(sizes),
                "max_message_mb": round(max(sizes) / 1e6, 1),
                "tokens": args.tokens,
                "bytes": total,
                "median_ms": round(seconds * 1e3, 3),
                "effective_gbps": round(total / seconds / 1e9, 1),
                "raw_same_messages_gbps": round(total / raw_same / 1e9, 1),
                "raw_one_message_gbps": round(total / raw_one / 1e9, 1),
                "ratio_to_raw": round(raw_one / seconds, 3),
                "intact": intact,
            }
        )
    timeline = None
    if args.timeline:
        first = args.first_message_layers
        timeline = [
            record_timeline(sender, receiver, layer_bytes, 8, f, posted, max_bytes)
            for posted in (False, True)
            for f in first
        ]
    if args.cpu_tokens:
        cpu_bytes = LAYERS * 2 * args.cpu_tokens * HEADS * DIM * elem
        seconds, _, intact, _ = time_transport(sender, receiver, "cpu", "cpu", 1, max(3, r // 2))
        rows.append(
            {
                "transport": "cpu",
                "copy": "torch",
                "layers_per_message": 1,
                "layer_gap_us": 0,
                "tail_ms": None,
                "messages": LAYERS,
                "max_message_mb": round(cpu_bytes / LAYERS / 1e6, 1),
                "tokens": args.cpu_tokens,
                "bytes": cpu_bytes,
                "median_ms": round(seconds * 1e3, 3),
                "effective_gbps": round(cpu_bytes / seconds / 1e9, 2),
                "raw_same_messages_gbps": None,
                "raw_one_message_gbps": round(total / raw_one / 1e9, 1),
                "ratio_to_raw": round(cpu_bytes / seconds / (total / raw_one), 4),
                "intact": intact,
            }
        )

    print(
        f"\nKV hand-off, {LAYERS} layers x {HEADS} KV heads x {DIM} dim, bf16, block size "
        f"{args.send_block_size} -> {args.recv_block_size}, median of {r}"
    )
    print(
        f"raw NCCL, one message of {total / 1e6:.1f} MB: {total / raw_one / 1e9:.1f} GB/s "
        f"({raw_one * 1e3:.3f} ms)"
    )
    for (op, copy), ms in alone.items():
        print(f"{op} alone, all layers, {copy}: {ms:.3f} ms ({total / ms / 1e6:.0f} GB/s each way)")
    print()
    head = (
        f"{'transport':<9} {'copy':<5} {'layers/msg':>10} {'first':>5} {'gap us':>6} {'msgs':>4} "
        f"{'max MB':>7} {'tokens':>6} {'MB':>7} {'ms':>8} {'tail ms':>7} {'GB/s':>7} "
        f"{'raw same':>8} {'raw one':>8} {'ratio':>6} {'intact':>6}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        same, tail = row["raw_same_messages_gbps"], row["tail_ms"]
        print(
            f"{row['transport']:<9} {row['copy']:<5} {row['layers_per_message']:>10} "
            f"{row.get('first_message_layers', 1):>5} "
            f"{row['layer_gap_us']:>6g} {row['messages']:>4} {row['max_message_mb']:>7.1f} "
            f"{row['tokens']:>6} {row['bytes'] / 1e6:>7.1f} {row['median_ms']:>8.3f} "
            f"{'-' if tail is None else f'{tail:.3f}':>7} {row['effective_gbps']:>7.1f} "
            f"{'-' if same is None else f'{same:.1f}':>8} {row['raw_one_message_gbps']:>8.1f} "
            f"{row['ratio_to_raw']:>6.3f} {str(row['intact']):>6}"
        )

    if args.json:
        import cupy
        from cupy.cuda import nccl

        result = {
            "benchmark": "kv_transfer",
            "command": _command(),
            "device_kind": args.label,
            "date": datetime.date.today().isoformat(),
            "device": f"2 x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "",
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "cupy": cupy.__version__,
                "nccl": nccl.get_version(),
                "ray": ray.__version__,
            },
            "config": {
                "layers": LAYERS,
                "kv_heads": HEADS,
                "head_dim": DIM,
                "dtype": "bfloat16",
                "send_block_size": args.send_block_size,
                "layer_gap_us": args.layer_gap_us,
                "recv_block_size": args.recv_block_size,
                "env": args.env,
                "nccl_stream_priority": args.nccl_stream_priority,
                "lanes": ray.get(sender.lanes.remote()),
                "max_message_mb": args.max_message_mb,
                "busy_before_us": args.busy_before_us,
                "busy_with": args.busy_with,
                "warmup": w,
                "repeat": r,
            },
            "raw_one_message_ms": round(raw_one * 1e3, 3),
            "copy_alone_ms": {f"{op}_{copy}": round(ms, 3) for (op, copy), ms in alone.items()},
            "rows": rows,
            "timeline_us": timeline,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    ray.shutdown()


if __name__ == "__main__":
    main()
