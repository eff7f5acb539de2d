"""FP8 KV cache against bf16 KV: decode attention, the KV hand-off, and graphs by role.

    python benchmarks/fp8_kv.py [--quick] [--skip decode,handoff,graphs] [--json [PATH]]

Qwen3-8B's attention shape (32 query heads, 8 KV heads, head dim 128, block 16):

- decode: batch 64 at 8k tokens of context each, ``LAYERS`` layers replayed from
  one CUDA graph (as a decode graph runs them; a layer's call stores its new rows
  too), in a bf16 cache and in an FP8 cache with calibrated scales, through the
  engine's FlashInfer backend: the Triton split-KV kernel (the engine's choice at
  batch 64) and FlashInfer's tensor-core and CUDA-core decode, and for FP8 the CUDA
  tensor-core kernel (``kernels/fp8_decode_cuda.py``, the engine's FP8 choice where it
  runs: ``kernels.fp8_decode: auto``) and
  TensorRT-LLM's XQA kernel through FlashInfer (Hopper; q and the
  softmax's probabilities in e4m3, so its tolerance is wider). Each against its own floor: the
  KV bytes it reads (1 byte an element in FP8, 2 in bf16) plus q and out at the
  measured copy bandwidth. The target: FP8 within 1.15x of its floor and faster
  than bf16 in absolute time. One more FP8 row: the split-KV kernel as decode
  graphs captured before the host saw the scales set run it. Each variant is
  first checked against the torch backend on the same cache (relative error of
  layer 0's output). For each, a layer's share of the graph, its call alone on the
  same cache (L2 emptied, the host ahead) and each kernel's time inside the graph
  (``kernel_times_us``, the profiler), to tell a kernel's time from what a layer adds,
  and the SM clock while they were timed (``gpu_clocks.py``: a kernel that converts
  every element it reads slows with the clock, where a bf16 read does not).
- handoff (two GPUs): a 4096-token prompt's KV of all 36 layers between two Ray
  actors through the NCCL transport, bf16 and FP8 in the same run: bytes moved
  and the median time from the first ``send_layer`` to the receiver's event; the
  arrived KV is checked byte for byte.
- graphs: an engine of the qwen3-8b-shape preset (random bf16 weights) as a
  prefill, a decode and a mixed worker: the GPU memory each one's CUDA graphs
  took (``GraphOwner.captured_bytes``) and its start-up seconds; what a prefill
  worker saves by not capturing decode graphs.

JSON goes to ``docs/perf/fp8_kv_<device>.json`` with ``--json``. Exits 1 when a
variant's output is wrong or a hand-off arrives damaged.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import secrets
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_clocks import ClockProbe, limits_text  # noqa: E402
from roofline import (  # noqa: E402
    command_line,
    copy_bandwidth_gbps,
    device_slug,
    environment,
    kernel_times_us,
    print_table,
    time_cuda_ms,
    write_report,
)

from splitserve.kernels.kv_store import FP8_DTYPE  # noqa: E402
from splitserve.workers.attention.base import AttentionSpec  # noqa: E402
from splitserve.workers.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from splitserve.workers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from splitserve.workers.kv.cache import KVCache  # noqa: E402
from splitserve.workers.kv.layout import KVLayout  # noqa: E402
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
MODEL_LAYERS = 36
LAYERS = 4  # decode: 64 x 8k tokens of 36 layers would not fit (77 GB in bf16)
BATCH, CONTEXT = 64, 8192
PROMPT = 4096
KERNELS = ("Triton split-KV", "FlashInfer tensor cores", "FlashInfer CUDA cores")
XQA = "XQA (FlashInfer)"  # FP8 only: the backend's fp8_decode="xqa"
MMA = "CUDA tensor cores"  # FP8 only: fp8_decode="mma"
FP8_DECODE = {XQA: "xqa", MMA: "mma"}  # the others: "split_kv"
DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}
TOLERANCE = {"bf16": 2e-2, "fp8": 2e-2}  # against torch on the same (quantized) cache
# q and the probabilities rounded to e4m3 on the way: its max error at 64 x 8k ran 3.9e-2
# to 5.5e-2 over three unseeded runs (H200, 2026-11-28); the inputs are seeded now.
XQA_TOLERANCE = 8e-2
TARGET_OF_FLOOR = 1.15
# An engine's decode graphs captured before the host saw the scales set (none from the
# checkpoint, no hand-off yet): the split-KV kernel with its check of the scales (and,
# at the first call only, their calibration from the new rows).
STORE_FIRST = "Triton split-KV, scales unseen"


# ---- decode ----------------------------------------------------------------------


def decode_cache(kv: str, device: torch.device) -> KVCache:
    """A cache of LAYERS layers with BATCH requests of CONTEXT random tokens (and room for
    the new row): N(0, 1) values, in FP8 quantized with fixed scales of 1/16."""
    blocks = BATCH * (CONTEXT // BLOCK + 1) + 1
    cache = KVCache(KVLayout(LAYERS, KV_HEADS, DIM, BLOCK, DTYPES[kv]), blocks, device)
    for t in cache.k + cache.v:
        for chunk in t[1:].split(4096):  # normal_ in bf16 chunks: no float32 copy of it all
            x = torch.randn(chunk.shape, device=device, dtype=torch.bfloat16)
            chunk.copy_(x * 16 if cache.layout.dtype == FP8_DTYPE else x)
    if cache.is_fp8:
        cache.scales.set([1 / 16] * LAYERS, [1 / 16] * LAYERS)
    return cache


def decode_row(cache: KVCache, kv: str, kernels: str, bandwidth: float, repeat: int) -> dict:
    device = cache.k[0].device
    backend = FlashInferAttentionBackend(
        HEADS, KV_HEADS, DIM, torch.bfloat16, device,
        decode_tensor_cores=kernels != "FlashInfer CUDA cores",
        split_kv_max_batch=BATCH if kernels in ("Triton split-KV", XQA, MMA) else 0,
        kv_dtype=cache.layout.dtype, fp8_decode=FP8_DECODE.get(kernels, "split_kv"),
    )  # fmt: skip
    per_seq = CONTEXT // BLOCK + 1
    steps = [
        StepRequest([1], CONTEXT, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), sample=True)
        for i in range(BATCH)
    ]
    specs = [AttentionSpec(i, HEADS, DIM**-0.5) for i in range(LAYERS)]
    q, k, v = (
        torch.randn(BATCH, n, DIM, device=device, dtype=torch.bfloat16)
        for n in (HEADS, KV_HEADS, KV_HEADS)
    )
    outs = []
    for b in (backend, TorchAttentionBackend()):
        fb = build_forward_batch(steps, cache, b, device)
        outs.append(b.forward(q, k, v, specs[0], fb).float())
    error = float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())
    row = {"kv": kv, "kernels": kernels, "rel_error": error}
    if not error < (XQA_TOLERANCE if kernels == XQA else TOLERANCE[kv]):
        return row
    fb = build_forward_batch(steps, cache, backend, device, plan=False)
    backend.init_graph_buffers(BATCH, per_seq)
    backend.prepare_capture(BATCH, fb)

    def layers() -> None:
        for spec in specs:
            backend.forward(q, k, v, spec, fb)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layers()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    with ClockProbe(device.index or 0) as clocks:
        ms = time_cuda_ms(graph.replay, warmup=3, repeat=repeat, flush_l2=True)
        layer_alone_ms = time_cuda_ms(
            lambda: backend.forward(q, k, v, specs[0], fb), repeat=repeat, flush_l2=True,
            host_ahead=True,
        )  # fmt: skip
        in_graph = {name: us / LAYERS for name, us in kernel_times_us(graph.replay).items()}
    element = cache.layout.element_size
    kv_bytes = BATCH * (CONTEXT + 1) * 2 * KV_HEADS * DIM * element * LAYERS
    qo_bytes = 2 * BATCH * HEADS * DIM * 2 * LAYERS
    floor_ms = (kv_bytes + qo_bytes) / bandwidth / 1e6
    row.update(
        ms=ms, floor_ms=floor_ms, x_floor=ms / floor_ms, gbps=(kv_bytes + qo_bytes) / ms / 1e6,
        layer_us=ms * 1e3 / LAYERS, layer_alone_us=layer_alone_ms * 1e3, kernels_us=in_graph,
        clocks=clocks.summary(),
    )  # fmt: skip
    return row


def run_decode(repeat: int) -> tuple[list[dict], float]:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth_gbps(device)
    rows = []
    for kv in DTYPES:
        cache = decode_cache(kv, device)
        variants = [(k, k) for k in KERNELS]
        if cache.is_fp8:  # scales unseen by the host when the graph was captured
            variants += [(MMA, MMA), (XQA, XQA), ("Triton split-KV", STORE_FIRST)]
        for kernels, label in variants:
            if label == STORE_FIRST:
                cache.scales.set([0.0] * LAYERS, [0.0] * LAYERS)  # the first store sets them
            try:
                row = decode_row(cache, kv, kernels, bandwidth, repeat)
            except Exception as e:  # a kernel that refuses the dtype: reported, not timed
                row = {"kv": kv, "error": f"{type(e).__name__}: {e}"}
            rows.append({**row, "kernels": label})
        del cache
        gc.collect()
        torch.cuda.empty_cache()
    for r in rows:
        kernels = "Triton split-KV" if r["kernels"] in (STORE_FIRST, XQA, MMA) else r["kernels"]
        bf16 = next(b for b in rows if b["kv"] == "bf16" and b["kernels"] == kernels)
        if "ms" in r and "ms" in bf16:
            r["vs_bf16"] = r["ms"] / bf16["ms"]
    return rows, bandwidth


# ---- hand-off --------------------------------------------------------------------


class HandoffSide:
    """One GPU's end: a Qwen3-8B-shaped cache of each dtype and an NCCL transport on it."""

    def __init__(self, role: str, block_size: int, seed: int, auth_key: str):
        from splitserve.workers.kv.transfer.nccl_transport import NcclKVTransport

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
        self.device = torch.device("cuda")
        need = math.ceil(PROMPT / block_size)
        self.blocks = random.Random(seed).sample(range(1, 4 * need + 1), need)
        self.caches, self.transports, self.peer = {}, {}, None
        for kv, dtype in DTYPES.items():
            layout = KVLayout(MODEL_LAYERS, KV_HEADS, DIM, block_size, dtype)
            cache = KVCache(layout, 4 * need + 1, self.device)
            for t in cache.k + cache.v:
                t[1:] = torch.randn(t[1:].shape, device=self.device).to(dtype)
            self.caches[kv] = cache
            owner = f"{role}-{kv}"
            self.transports[kv] = NcclKVTransport(
                cache, owner=owner, rendezvous=self._rendezvous, auth_key=auth_key
            )

    def set_peer(self, peer) -> None:
        self.peer = peer

    def _rendezvous(self, ticket, pair_key: str, unique_id: bytes) -> None:
        import ray

        ray.get(self.peer.join.remote(ticket.layout.dtype != torch.bfloat16, pair_key, unique_id))

    def join(self, fp8: bool, pair_key: str, unique_id: bytes) -> None:
        self.transports["fp8" if fp8 else "bf16"].join(pair_key, unique_id)

    def expect(self, kv: str, rid: str) -> tuple[bytes, int]:
        t = self.transports[kv]
        ticket = t.make_ticket(rid, self.blocks, 0, PROMPT, MODEL_LAYERS)
        t.expect(ticket)
        return ticket.pack(), t.transfer_bytes(ticket)

    def send(self, kv: str, packed: bytes) -> float:
        from splitserve.workers.kv.transfer.ticket import TransferDone, TransferTicket

        t, ticket = self.transports[kv], TransferTicket.unpack(packed)
        while (state := t.connect(ticket)) is not None:
            if state != "connecting":
                raise RuntimeError(state)
            time.sleep(0.001)
        t.start_send(ticket, self.blocks)
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for layer in range(MODEL_LAYERS):
            t.send_layer(ticket.request_id, layer)
        scales = self.caches[kv].scales_to_wire()
        t.finish_send(ticket.request_id, TransferDone(ticket.request_id, 1, kv_scales=scales))
        return start

    def finished(self, kv: str, rid: str, timeout: float = 60.0) -> tuple[bool, str | None, float]:
        t, deadline = self.transports[kv], time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in t.poll():
                if e.request_id == rid:
                    return e.ok, e.error, time.perf_counter()
            time.sleep(0.0001)
        return False, "no event", float("nan")

    def checksums(self, kv: str) -> list[int]:
        cache = self.caches[kv]
        slots = _slots(self.blocks, cache.block_size).to(self.device)
        sums = []
        for k, v in zip(cache.k, cache.v):
            rows = torch.stack([t.view(-1, KV_HEADS, DIM)[slots] for t in (k, v)])
            x = rows.view(torch.uint8).flatten().to(torch.int64)
            sums.append(int((x * (torch.arange(x.numel(), device=self.device) % 65521 + 1)).sum()))
        return sums


def _slots(blocks: list[int], block_size: int) -> torch.Tensor:
    from splitserve.workers.kv.transfer.ticket import token_slots

    return token_slots(blocks, block_size, 0, PROMPT)


def run_handoff(warmup: int, repeat: int) -> list[dict]:
    import ray

    ray.init(num_gpus=2, log_to_driver=False)
    # A receiver joins an NCCL pair (a call from the sender) while it waits for an arrival.
    side = ray.remote(num_gpus=1, max_concurrency=4)(HandoffSide)
    key = secrets.token_hex(16)  # the control plane's key, the same on both sides
    sender, receiver = side.remote("prefill", 16, 0, key), side.remote("decode", 32, 1, key)
    ray.get([sender.set_peer.remote(receiver), receiver.set_peer.remote(sender)])
    rows = []
    for kv in DTYPES:
        times = []
        for i in range(warmup + repeat):
            rid = f"{kv}-{i}"
            ticket, nbytes = ray.get(receiver.expect.remote(kv, rid))
            arrival = receiver.finished.remote(kv, rid)
            start = ray.get(sender.send.remote(kv, ticket))
            ok, error, end = ray.get(arrival)
            sent_ok, sent_error, _ = ray.get(sender.finished.remote(kv, rid))
            if not (ok and sent_ok):
                raise RuntimeError(f"{rid}: receiver {error!r}, sender {sent_error!r}")
            if i >= warmup:
                times.append(end - start)
        intact = ray.get(sender.checksums.remote(kv)) == ray.get(receiver.checksums.remote(kv))
        ms = median(times) * 1e3
        rows.append(
            {"kv": kv, "bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6, "intact": intact}
        )
    ray.shutdown()
    bf16 = rows[0]
    for r in rows:
        r["bytes_vs_bf16"], r["ms_vs_bf16"] = r["bytes"] / bf16["bytes"], r["ms"] / bf16["ms"]
    return rows


# ---- graphs by role --------------------------------------------------------------


def run_graphs() -> list[dict]:
    from splitserve.config import (
        CacheConfig,
        EngineConfig,
        KVTransferConfig,
        SchedulerConfig,
    )
    from splitserve.workers.engine.llm_engine import LLMEngine

    rows = []
    for role in ("prefill", "decode", "mixed"):
        start = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                model="qwen3-8b-shape",
                dtype="bfloat16",
                device="cuda",
                load_format="dummy",
                role=role,
                cache=CacheConfig(kv_cache_memory_gb=8.0),
                scheduler=SchedulerConfig(max_num_seqs=64, max_model_len=8192),
                kv_transfer=KVTransferConfig(transport="cpu"),
            )
        )
        seconds = time.perf_counter() - start
        captured = dict(engine.runner.graphs.captured_bytes)
        rows.append(
            {
                "role": role,
                "graphs": ", ".join(sorted(captured)),
                "graph_mib": sum(captured.values()) / 2**20,
                **{f"{name}_mib": b / 2**20 for name, b in captured.items()},
                "startup_s": seconds,
            }
        )
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    mixed = next(r for r in rows if r["role"] == "mixed")
    for r in rows:
        r["saved_mib"] = mixed["graph_mib"] - r["graph_mib"]
    return rows


# ---- main ------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--skip", default="", help="comma-separated: decode, handoff, graphs")
    parser.add_argument("--json", nargs="?", const="", help="write the report (default path)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)  # the same random cache and rows in every run
    repeat = 10 if args.quick else 30
    report = environment(command_line("fp8_kv.py"))
    failed = False
    if "decode" not in skip:
        decode, bandwidth = run_decode(repeat)
        print(f"\nDecode, batch {BATCH} x {CONTEXT} tokens, {LAYERS} layers in one CUDA graph")
        print(f"copy bandwidth {bandwidth:.0f} GB/s; target: FP8 <= {TARGET_OF_FLOOR}x its floor")
        cols = ["kv", "kernels", "rel_error", "ms", "floor_ms", "x_floor", "gbps", "vs_bf16"]
        print_table(cols, [[r.get(c) for c in cols] for r in decode])
        print("\nA layer: in the graph, its call alone (L2 emptied), its kernels in the graph;")
        print("the SM clock (median) and its limits while they were timed (nvidia-smi)")
        timed = [r for r in decode if "kernels_us" in r]
        cols = ["kv", "kernels", "layer_us", "layer_alone_us"]
        print_table(
            [*cols, "sm_mhz", "limits"],
            [
                [*(r[c] for c in cols), r["clocks"].get("sm_mhz"), limits_text(r["clocks"])]
                for r in timed
            ],
        )
        for r in timed:
            kernels = ", ".join(f"{n[:40]} {us:.1f} us" for n, us in r["kernels_us"].items())
            print(f"{r['kv']} {r['kernels']}: {kernels}")
        for r in decode:
            if "error" in r:
                print(f"{r['kv']} {r['kernels']}: {r['error']}")
        report.update(decode=decode, copy_bandwidth_gbps=bandwidth)
        failed |= any("ms" not in r for r in decode)
    if "handoff" not in skip:
        if torch.cuda.device_count() < 2:
            print("\nhand-off: skipped, it needs two GPUs")
        else:
            handoff = run_handoff(warmup=3, repeat=5 if args.quick else 10)
            print(f"\nKV hand-off of a {PROMPT}-token prompt, {MODEL_LAYERS} layers, NCCL")
            cols = ["kv", "bytes", "ms", "gbps", "bytes_vs_bf16", "ms_vs_bf16", "intact"]
            print_table(cols, [[r[c] for c in cols] for r in handoff])
            report["handoff"] = handoff
            failed |= not all(r["intact"] for r in handoff)
    if "graphs" not in skip:
        graphs = run_graphs()
        print("\nCUDA graphs by role (qwen3-8b-shape, bf16, 64 sequences)")
        cols = ["role", "graphs", "graph_mib", "saved_mib", "startup_s"]
        print_table(cols, [[r[c] for c in cols] for r in graphs])
        report["graphs"] = graphs
    if args.json is not None:
        path = Path(args.json or f"docs/perf/fp8_kv_{device_slug(report['device'])}.json")
        write_report(path, report)
        print(f"\nwrote {path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
