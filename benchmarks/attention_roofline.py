"""FlashInfer attention through the engine's backend, against its floor, per variant.

    python benchmarks/attention_roofline.py [--quick] [--json [PATH]]

A Qwen3-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16,
block size 16, 36 layers of KV cache) on one GPU, random KV:

- decode at batch 1, 2, 4, 8, 16 and 64 with 1k tokens of context each, all
  36 layers replayed from one CUDA graph (as the decode graphs run them):
  FlashInfer's CUDA-core and tensor-core decode kernels, and the Triton
  split-KV kernel (``kernels/triton/decode_attention.py``). Floor: the KV
  bytes read (and q, out) at the measured copy bandwidth.
- a 4096-token prompt with no cached prefix, ragged (the step's own K/V)
  against paged (the same K/V read back from the cache), and a 2048-token
  chunk after a 2048-token cached prefix (paged). Floor: the causal attention
  FLOPs at the measured bf16 GEMM rate.

Each layer's call includes the KV store of its new rows, as the backend runs
it. Every variant is first checked against the torch backend on the same
inputs (relative error of the output); a wrong variant is reported and not
timed, and the command exits with status 1. JSON goes to
``docs/perf/attention_<device>.json`` with ``--json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import (  # noqa: E402
    copy_bandwidth_gbps,
    device_slug,
    environment,
    gemm_tflops,
    print_table,
    time_cuda_ms,
    write_report,
)

from splitserve.workers.attention.base import AttentionSpec  # noqa: E402
from splitserve.workers.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from splitserve.workers.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from splitserve.workers.kv.cache import KVCache  # noqa: E402
from splitserve.workers.kv.layout import KVLayout  # noqa: E402
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch  # noqa: E402

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 36, 32, 8, 128, 16
DTYPE = torch.bfloat16
CONTEXT = 1024
DECODE_BATCHES = (1, 2, 4, 8, 16, 64)
DECODE_KERNELS = ("CUDA cores", "tensor cores", "Triton split-KV")
PROMPT = 4096
TOLERANCE = 2e-2


class Setup:
    """A KV cache with random contents and hand-made steps over fresh blocks."""

    def __init__(self, num_blocks: int, device: torch.device):
        self.device = device
        self.cache = KVCache(KVLayout(LAYERS, KV_HEADS, DIM, BLOCK, DTYPE), num_blocks, device)
        for layer in range(LAYERS):
            for t in self.cache.layer(layer):
                t[1:].normal_()
        self.next_block = 1
        self.specs = [AttentionSpec(i, HEADS, DIM**-0.5) for i in range(LAYERS)]

    def step(self, new: int, cached: int) -> StepRequest:
        n = -(-(cached + new) // BLOCK)
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return StepRequest([1] * new, cached, blocks, sample=True)

    def qkv(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as the model hands them over: k and v strided views of one buffer."""
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, device=self.device, dtype=DTYPE)
        q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
        return (
            q.contiguous().view(tokens, HEADS, DIM),
            k.contiguous().view(tokens, KV_HEADS, DIM),
            v.view(tokens, KV_HEADS, DIM),
        )


def max_rel_error(backend, setup: Setup, steps: list[StepRequest], qkv) -> float:
    """The backend's layer-0 output against the torch backend's, on the same inputs."""
    outs = []
    for b in (backend, TorchAttentionBackend()):
        fb = build_forward_batch(steps, setup.cache, b, setup.device)
        outs.append(b.forward(*qkv, setup.specs[0], fb).float())
    return float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())


def decode_row(setup: Setup, batch: int, kernels: str, bandwidth: float, repeat: int):
    backend = FlashInferAttentionBackend(
        HEADS,
        KV_HEADS,
        DIM,
        DTYPE,
        setup.device,
        decode_tensor_cores=kernels == "tensor cores",
        split_kv_max_batch=batch if kernels == "Triton split-KV" else 0,
    )
    steps = [setup.step(1, CONTEXT) for _ in range(batch)]
    qkv = setup.qkv(batch)
    error = max_rel_error(backend, setup, steps, qkv)
    row = {"batch": batch, "kernels": kernels, "rel_error": error}
    if not error < TOLERANCE:
        return row
    fb = build_forward_batch(steps, setup.cache, backend, setup.device, plan=False)
    backend.init_graph_buffers(batch, max(len(s.block_ids) for s in steps))
    backend.prepare_capture(batch, fb)

    def layers() -> None:
        for spec in setup.specs:
            backend.forward(*qkv, spec, fb)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layers()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    ms = time_cuda_ms(graph.replay, warmup=3, repeat=repeat, flush_l2=True)
    kv = batch * (CONTEXT + 1) * 2 * KV_HEADS * DIM * 2 * LAYERS
    qo = 2 * batch * HEADS * DIM * 2 * LAYERS
    floor_ms = (kv + qo) / bandwidth / 1e6
    row.update(ms=ms, floor_ms=floor_ms, of_floor=floor_ms / ms, gbps=(kv + qo) / ms / 1e6)
    return row


def prefill_row(setup: Setup, new: int, cached: int, ragged: bool, gemm: float, repeat: int):
    backend = FlashInferAttentionBackend(
        HEADS, KV_HEADS, DIM, DTYPE, setup.device, ragged_prefill=ragged
    )
    steps = [setup.step(new, cached)]
    qkv = setup.qkv(new)
    error = max_rel_error(backend, setup, steps, qkv)
    row = {"new": new, "cached": cached, "ragged": ragged and not cached, "rel_error": error}
    if not error < TOLERANCE:
        return row
    fb = build_forward_batch(steps, setup.cache, backend, setup.device)
    ms = time_cuda_ms(lambda: backend.forward(*qkv, setup.specs[0], fb), 3, repeat)
    pairs = new * cached + new * (new + 1) / 2
    flops = 4 * pairs * HEADS * DIM
    floor_ms = flops / gemm / 1e9
    row.update(ms=ms, floor_ms=floor_ms, of_floor=floor_ms / ms, tflops=flops / ms / 1e9)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--json", nargs="?", const="", help="write the report (default path)")
    args = parser.parse_args()
    repeat = 10 if args.quick else 30
    device = torch.device("cuda")
    bandwidth, gemm = copy_bandwidth_gbps(device), gemm_tflops(device)
    print(f"copy bandwidth {bandwidth:.0f} GB/s, bf16 GEMM {gemm:.0f} TFLOP/s")
    decode_blocks = sum(DECODE_BATCHES) * (CONTEXT // BLOCK + 1) * len(DECODE_KERNELS)
    blocks = decode_blocks + 4 * PROMPT // BLOCK + 8
    setup = Setup(blocks, device)
    torch.manual_seed(0)

    decode = [
        decode_row(setup, b, kernels, bandwidth, repeat)
        for b in DECODE_BATCHES
        for kernels in DECODE_KERNELS
    ]
    print(f"\nDecode, {LAYERS} layers in one CUDA graph, {CONTEXT} tokens of context each")
    print_table(
        ["batch", "kernels", "rel error", "ms", "floor ms", "of floor", "GB/s"],
        [
            [
                r["batch"],
                r["kernels"],
                f"{r['rel_error']:.1e}",
                r.get("ms"),
                r.get("floor_ms"),
                r.get("of_floor"),
                r.get("gbps"),
            ]
            for r in decode
        ],
    )
    prefill = [prefill_row(setup, PROMPT, 0, ragged, gemm, repeat) for ragged in (False, True)] + [
        prefill_row(setup, PROMPT // 2, PROMPT // 2, True, gemm, repeat)
    ]
    print("\nPrefill, one layer (causal; FLOPs of the attended pairs)")
    print_table(
        ["new", "cached", "KV read", "rel error", "ms", "floor ms", "of floor", "TFLOP/s"],
        [
            [
                r["new"],
                r["cached"],
                "ragged" if r["ragged"] else "paged",
                f"{r['rel_error']:.1e}",
                r.get("ms"),
                r.get("floor_ms"),
                r.get("of_floor"),
                r.get("tflops"),
            ]
            for r in prefill
        ],
    )
    report = {
        **environment("python benchmarks/attention_roofline.py" + " --quick" * args.quick),
        "copy_bandwidth_gbps": round(bandwidth, 1),
        "gemm_tflops": round(gemm, 1),
        "decode": decode,
        "prefill": prefill,
    }
    if args.json is not None:
        path = Path(args.json or f"docs/perf/attention_{device_slug(report['device'])}.json")
        write_report(path, report)
        print(f"\nwrote {path}")
    if any("ms" not in r for r in decode + prefill):
        sys.exit(1)


if __name__ == "__main__":
    main()
