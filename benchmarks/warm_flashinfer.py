"""Build FlashInfer's JIT kernels for the attention backend in parallel, before a run.

    python benchmarks/warm_flashinfer.py [--head-dims 128] [--dtype bfloat16]

FlashInfer compiles each kernel family on its first use (decode on CUDA
cores, decode on tensor cores, paged prefill, ragged prefill: 20-60 s each)
and caches it under ``~/.cache/flashinfer``. A fresh GPU machine would build
them one after another inside the first benchmark; this builds them at once,
one process each, by running every variant of ``FlashInferAttentionBackend``
on a tiny batch.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

VARIANTS = ("decode", "decode-tensor-cores", "paged-prefill", "ragged-prefill")


def warm(variant: str, head_dim: int, dtype_name: str) -> str:
    import torch

    from splitserve.workers.attention.base import AttentionSpec
    from splitserve.workers.attention.flashinfer_backend import FlashInferAttentionBackend
    from splitserve.workers.kv.cache import KVCache
    from splitserve.workers.kv.layout import KVLayout
    from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch

    start = time.perf_counter()
    dtype, device = getattr(torch, dtype_name), torch.device("cuda")
    heads, kv_heads, block = 8, 2, 16
    backend = FlashInferAttentionBackend(
        heads, kv_heads, head_dim, dtype, device, decode_tensor_cores=variant.endswith("cores")
    )
    cache = KVCache(KVLayout(1, kv_heads, head_dim, block, dtype), 8, device)
    if variant.startswith("decode"):
        steps = [StepRequest([1], 20, [1, 2], sample=True)]
    else:
        cached = 20 if variant == "paged-prefill" else 0
        steps = [StepRequest([1] * 8, cached, [3, 4], sample=True)]
    tokens = sum(len(s.new_token_ids) for s in steps)
    fb = build_forward_batch(steps, cache, backend, device)
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
    backend.forward(q, k, k.clone(), AttentionSpec(0, heads, 1.0), fb)
    torch.cuda.synchronize()
    return f"{variant} head_dim {head_dim}: {time.perf_counter() - start:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    jobs = [(v, d, args.dtype) for d in args.head_dims for v in args.variants]
    with mp.get_context("spawn").Pool(len(jobs)) as pool:
        for line in pool.starmap(warm, jobs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
