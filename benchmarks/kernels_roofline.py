"""Triton kernels against their memory floor, with the torch references as the baseline.

    python benchmarks/kernels_roofline.py [--quick] [--json PATH] [--label KIND]
    python benchmarks/kernels_roofline.py --sweep-kv-store  # KV store tilings only

On one GPU, random data, after measuring the ceilings (device-to-device copy
bandwidth, bf16 GEMM rate):

- KV store (reshape-and-cache, ``kernels/triton/kv_store.py``): Qwen3-8B KV
  (8 KV heads, head dim 128, block size 16, NHD), bf16 and FP8 e4m3 (per-tensor
  scale, already calibrated), new rows written at random distinct slots of a
  cache four times their size. FP8 is timed with ``calibrated=True`` (the store
  kernel alone, as a caller that has seen its scales set calls it); the
  ``uncal. ms`` column times the plain call (amax kernel, which returns at once,
  then the store). Bytes: read K and V in bf16, write them in the cache dtype.
  Target: >= 0.8 of the copy bandwidth at large token counts. Also timed back
  to back (``b2b``: four stores with their own inputs and caches replayed from
  one CUDA graph, each paying for the dirty lines the one before it left in
  L2) and after the old L2 flush by writing (``write-flush ms``).
  ``--sweep-kv-store`` times only a grid of the store's tilings instead
  (``benchmarks/kv_store_sweep.py``).
- MoE layer shaped like Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert
  intermediate 768, bf16): softmax top-k routing (renormalized) + fused MoE
  (``kernels/triton/moe_routing.py``, ``moe_align.py``, ``triton/fused_moe.py``)
  from router logits to output; the router's own GEMM is not included. Floor:
  the weights of the experts actually chosen (distinct ids in ``topk_ids``)
  read once at the copy bandwidth, or the FLOPs at the GEMM rate if larger.
- Elementwise at 4096 tokens x 4096 hidden: fused residual add + RMSNorm,
  rotary (32 q heads, 8 KV heads, head dim 128, out of place), per-head q/k
  RMSNorm + rotary in one pass (same heads; baseline: the torch norms then
  rotary; the row also times the unfused Triton norms and rotary), SiLU-and-mul.

Ratios are floor time / measured time (1.0 = at the floor; for the
bandwidth-bound kernels, the fraction of the copy bandwidth). Every timing is
the median of CUDA-event spans with L2 emptied (by reading) before each call. Each kernel is
checked once against its torch reference (in float32 where it computes) before
it is timed; a wrong kernel is not timed, its row carries the error, and the
command exits with status 1. Writes ``docs/perf/kernels_<device>.json`` (not
with ``--quick`` unless ``--json`` is given) and a PNG per section beside it.
"""

from __future__ import annotations

import argparse
import math
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

try:  # run as a script: benchmarks/ is on the path
    import roofline
except ImportError:  # imported as benchmarks.kernels_roofline (the tests)
    from benchmarks import roofline

DEVICE = "cuda"
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16  # Qwen3-8B
MOE_HIDDEN, MOE_EXPERTS, MOE_TOP_K, MOE_INTERMEDIATE = 2048, 128, 8, 768  # Qwen3-30B-A3B
ELEM_TOKENS, ELEM_HIDDEN, Q_HEADS = 4096, 4096, 32
KV_TOKENS, KV_TOKENS_QUICK = [1, 64, 512, 4096, 16384], [1, 4096]
MOE_TOKENS, MOE_TOKENS_QUICK = [1, 16, 64, 256], [1, 256]
KV_TARGET = 0.8
B2B_SETS = 4  # KV stores replayed back to back, each with its own inputs and caches
TOLERANCE = 2e-2  # bf16 against a float32 reference; the kernel tests use the same


class KernelMismatch(RuntimeError):
    """A kernel's output is too far from its reference to be worth timing."""


# ---- shape math (pure) -------------------------------------------------------------


def kv_store_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, in_dtype, cache_dtype) -> int:
    """Bytes a KV store must move: read the new K and V rows, write them in the cache dtype."""
    return 2 * num_tokens * num_kv_heads * head_dim * (in_dtype.itemsize + cache_dtype.itemsize)


def expert_bytes(hidden: int, intermediate: int, dtype) -> int:
    """One expert's weights: w13 ``[2I, H]`` plus w2 ``[H, I]``."""
    return 3 * hidden * intermediate * dtype.itemsize


def moe_weight_bytes(topk_ids: torch.Tensor, hidden: int, intermediate: int, dtype) -> int:
    """Weights a MoE layer must read: each distinct expert in ``topk_ids`` once."""
    return topk_ids.unique().numel() * expert_bytes(hidden, intermediate, dtype)


def moe_flops(num_tokens: int, top_k: int, hidden: int, intermediate: int) -> int:
    """Multiply-adds x 2 of the expert GEMMs: ``[2I, H]`` then ``[H, I]`` per (token, expert)."""
    return 2 * num_tokens * top_k * 3 * hidden * intermediate


def rmsnorm_residual_bytes(num_tokens: int, hidden: int, dtype) -> int:
    """Read x, residual and the weight; write the normed output and the new residual."""
    return (4 * num_tokens + 1) * hidden * dtype.itemsize


def rotary_bytes(
    num_tokens: int, q_heads: int, kv_heads: int, head_dim: int, rotary_dim: int, dtype
) -> int:
    """Read and write q and k; read each token's float32 cos and sin rows once."""
    qk = 2 * num_tokens * (q_heads + kv_heads) * head_dim * dtype.itemsize
    return qk + 2 * num_tokens * rotary_dim * 4


def qk_norm_rope_bytes(num_tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype) -> int:
    """Rotary's bytes (full rotary) plus the two norm weights; the norm adds no pass over q, k."""
    qk = rotary_bytes(num_tokens, q_heads, kv_heads, head_dim, head_dim, dtype)
    return qk + 2 * head_dim * dtype.itemsize


def silu_and_mul_bytes(num_tokens: int, d: int, dtype) -> int:
    """Read ``[T, 2d]``, write ``[T, d]``."""
    return 3 * num_tokens * d * dtype.itemsize


def floor_ms(nbytes: float, gbps: float, flops: float = 0.0, tflops: float = math.inf) -> float:
    """The larger of the memory time (bytes at ``gbps`` GB/s) and the compute time, in ms."""
    return max(nbytes / gbps / 1e6, flops / tflops / 1e9)


def kv_cache_blocks(num_tokens: int, block_size: int, spread: int = 4) -> int:
    """A cache ``spread`` times the blocks the tokens need, so their slots can scatter."""
    return spread * math.ceil(num_tokens / block_size) + 1


def scattered_slots(
    num_tokens: int, num_slots: int, generator: torch.Generator, device="cpu"
) -> torch.Tensor:
    """``num_tokens`` distinct random slots in ``[0, num_slots)``, int64."""
    if num_tokens > num_slots:
        raise ValueError(f"{num_tokens} tokens do not fit {num_slots} slots")
    perm = torch.randperm(num_slots, generator=generator, device=generator.device)
    return perm[:num_tokens].to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float64; NaN when either holds a NaN or ref is all 0."""
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape or out.isnan().any() or ref.isnan().any():
        return math.nan
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return (out - ref).abs().max().item() / scale if scale > 0 else math.nan


def fp8_far_apart(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    """Fraction of dequantized FP8 entries more than one e4m3 step apart.

    The quotient ``x / scale`` may round to a neighbouring FP8 value, rarely; further is a bug.
    """
    return ((a - b).abs() > b.abs() * 2**-3 + scale * 2**-9).float().mean().item()


def check(name: str, err: float, tol: float = TOLERANCE) -> float:
    """Print the relative error; raise ``KernelMismatch`` unless it is <= ``tol``."""
    ok = err <= tol  # False for NaN
    print(f"  check {name}: relative error {err:.3g} ({'ok' if ok else f'> {tol:g}'})")
    if not ok:
        raise KernelMismatch(f"{name}: relative error {err:.3g} > {tol:g}")
    return err


# ---- measuring (GPU) ---------------------------------------------------------------


def timed(
    nbytes: int, floor: float, run: Callable, baseline: Callable, timing: dict
) -> dict[str, float]:
    """Time the kernel and its torch baseline; the row's figures."""
    ms = roofline.time_cuda_ms(run, **timing)
    torch_ms = roofline.time_cuda_ms(baseline, **timing)
    return {
        "bytes": nbytes,
        "ms": ms,
        "gbps": nbytes / ms / 1e6,
        "floor_ms": floor,
        "ratio_to_floor": floor / ms,
        "torch_ms": torch_ms,
        "speedup": torch_ms / ms,
    }


def guarded(fields: dict, measure: Callable[[], dict]) -> dict:
    """One row: ``fields`` plus the measurement, or plus the error that stopped it."""
    try:
        return {**fields, **measure()}
    except Exception as e:  # a wrong or broken kernel must not hide the other rows
        if not isinstance(e, KernelMismatch):
            traceback.print_exc()
        return {**fields, "error": f"{type(e).__name__}: {e}"}


def kv_store_inputs(n: int, cache_dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 K and V rows, NHD caches of random values, distinct random slots."""
    gen = torch.Generator(device=DEVICE).manual_seed(n + 7919 * seed)
    k, v = (
        torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE) for _ in "kv"
    )
    blocks = kv_cache_blocks(n, BLOCK_SIZE)
    shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (
        torch.randn(shape, generator=gen, device=DEVICE).to(cache_dtype) for _ in "kv"
    )
    return k, v, k_cache, v_cache, scattered_slots(n, blocks * BLOCK_SIZE, gen, DEVICE)


def kv_store_row(n: int, cache_dtype, copy_gbps: float, timing: dict) -> dict:
    from splitserve.kernels import kv_store as ref
    from splitserve.kernels.triton import kv_store as tri

    k, v, k_cache, v_cache, slots = kv_store_inputs(n, cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    name = f"kv_store {_dtype_name(cache_dtype)} {n} tokens"
    extra, b2b_scales = {}, ()
    if cache_dtype == FP8:
        scales = [torch.zeros(1, device=DEVICE) for _ in range(4)]
        ref.store_kv_fp8(k, v, k_ref, v_ref, slots, *scales[:2])
        tri.store_kv_fp8(k, v, k_cache, v_cache, slots, *scales[2:])
        scale_err = max(rel_err(scales[2], scales[0]), rel_err(scales[3], scales[1]))
        check(f"{name}, scales", scale_err, tol=1e-6)
        errs = []
        for out, want, scale in ((k_cache, k_ref, scales[0]), (v_cache, v_ref, scales[1])):
            a, b = ref.dequantize_fp8(out, scale), ref.dequantize_fp8(want, scale)
            far = fp8_far_apart(a, b, scale)  # the whole cache: a stray write shows
            a, b = a.flatten(0, 1)[slots], b.flatten(0, 1)[slots]
            differ = (a != b).float().mean().item()
            errs.append(rel_err(a, b))
            print(f"  check {name}: {differ:.2%} of rows' entries differ, {far:.2%} by > one step")
            if far > 0 or differ > 0.01:
                raise KernelMismatch(f"{name}: {differ:.2%} differ, {far:.2%} by > one fp8 step")
        err = max(errs)
        plain = lambda: tri.store_kv_fp8(k, v, k_cache, v_cache, slots, *scales[2:])
        run = lambda: tri.store_kv_fp8(k, v, k_cache, v_cache, slots, *scales[2:], calibrated=True)
        baseline = lambda: ref.store_kv_fp8(k, v, k_ref, v_ref, slots, *scales[:2], calibrated=True)
        cache_bytes = lambda: torch.stack([c.view(torch.uint8) for c in (k_cache, v_cache)])
        before = cache_bytes()
        run()  # the same rows again: the calibrated store must write the same bytes
        if not torch.equal(cache_bytes(), before):
            raise KernelMismatch(f"{name}: calibrated=True wrote other bytes than the plain call")
        extra["uncalibrated_ms"] = roofline.time_cuda_ms(plain, **timing)
        b2b_scales = scales[2:]
    else:
        ref.store_kv(k, v, k_ref, v_ref, slots)
        tri.store_kv(k, v, k_cache, v_cache, slots)
        err = check(name, max(rel_err(k_cache, k_ref), rel_err(v_cache, v_ref)), tol=0.0)
        run = lambda: tri.store_kv(k, v, k_cache, v_cache, slots)
        baseline = lambda: ref.store_kv(k, v, k_ref, v_ref, slots)
    nbytes = kv_store_bytes(n, KV_HEADS, HEAD_DIM, DTYPE, cache_dtype)
    floor = floor_ms(nbytes, copy_gbps)
    row = timed(nbytes, floor, run, baseline, timing)
    row["write_flush_ms"] = roofline.time_cuda_ms(run, **timing, l2_flush_by="write")
    row["b2b_ms"] = kv_store_back_to_back_ms(n, cache_dtype, *b2b_scales)
    row["b2b_ratio"] = floor / row["b2b_ms"]
    return {**row, **extra, "rel_err": err}


def kv_store_back_to_back_ms(n: int, cache_dtype, *scales: torch.Tensor) -> float:
    """Per store, ``B2B_SETS`` stores of their own rows into their own caches replayed
    back to back (``roofline.time_cuda_ms_back_to_back``): FP8 with set scales."""
    from splitserve.kernels.triton import kv_store as tri

    def store(k, v, k_cache, v_cache, slots):
        if scales:
            return lambda: tri.store_kv_fp8(k, v, k_cache, v_cache, slots, *scales, calibrated=True)
        return lambda: tri.store_kv(k, v, k_cache, v_cache, slots)

    sets = [kv_store_inputs(n, cache_dtype, seed) for seed in range(1, B2B_SETS + 1)]
    return roofline.time_cuda_ms_back_to_back([store(*inputs) for inputs in sets])


def moe_weights() -> tuple[torch.Tensor, ...]:
    """w13 and w2 in bf16 and their float32 copies (for the reference check)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    h, i, e = MOE_HIDDEN, MOE_INTERMEDIATE, MOE_EXPERTS
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=DEVICE) / h**0.5).to(DTYPE)
    w2 = (torch.randn(e, h, i, generator=gen, device=DEVICE) / i**0.5).to(DTYPE)
    return w13, w2, w13.float(), w2.float()


def moe_row(n: int, weights, copy_gbps: float, tflops: float, timing: dict) -> dict:
    from splitserve.kernels.fused_moe import fused_moe as moe_ref
    from splitserve.kernels.moe_routing import softmax_topk as route_ref
    from splitserve.kernels.triton.fused_moe import fused_moe
    from splitserve.kernels.triton.moe_routing import softmax_topk

    w13, w2, w13f, w2f = weights
    gen = torch.Generator(device=DEVICE).manual_seed(n)
    x = torch.randn(n, MOE_HIDDEN, generator=gen, device=DEVICE).to(DTYPE)
    logits = torch.randn(n, MOE_EXPERTS, generator=gen, device=DEVICE).to(DTYPE)
    topk_weights, topk_ids = softmax_topk(logits, MOE_TOP_K, True)
    ref_weights, _ = route_ref(logits, MOE_TOP_K, True)
    # bf16 logits tie often; ties may pick different ids with the same probability,
    # so check the probabilities of the chosen ids rather than the ids themselves
    probs = torch.softmax(logits.float(), dim=-1)
    distinct = bool((topk_ids.sort(dim=1).values.diff(dim=1) > 0).all())
    chosen = rel_err(probs.gather(1, topk_ids), probs.topk(MOE_TOP_K, dim=-1).values)
    check(f"moe routing {n} tokens", max(rel_err(topk_weights, ref_weights), chosen), tol=1e-4)
    if not distinct:
        raise KernelMismatch(f"moe routing {n} tokens: an expert chosen twice for one token")
    out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    want = moe_ref(x.float(), w13f, w2f, topk_weights, topk_ids)
    err = check(f"fused_moe {n} tokens", rel_err(out, want))

    run = lambda: fused_moe(x, w13, w2, *softmax_topk(logits, MOE_TOP_K, True))
    baseline = lambda: moe_ref(x, w13, w2, *route_ref(logits, MOE_TOP_K, True))
    nbytes = moe_weight_bytes(topk_ids, MOE_HIDDEN, MOE_INTERMEDIATE, DTYPE)
    flops = moe_flops(n, MOE_TOP_K, MOE_HIDDEN, MOE_INTERMEDIATE)
    floor = floor_ms(nbytes, copy_gbps, flops, tflops)
    routing_ms = roofline.time_cuda_ms(lambda: softmax_topk(logits, MOE_TOP_K, True), **timing)
    return {
        "experts": topk_ids.unique().numel(),
        "gflop": flops / 1e9,
        **timed(nbytes, floor, run, baseline, timing),
        "routing_ms": routing_ms,
        "rel_err": err,
    }


def elementwise_rows(copy_gbps: float, timing: dict) -> list[dict]:
    from splitserve.kernels import activation, rmsnorm, rotary
    from splitserve.kernels import qk_norm_rope as norm_rope
    from splitserve.kernels.triton import activation as tri_activation
    from splitserve.kernels.triton import qk_norm_rope as tri_norm_rope
    from splitserve.kernels.triton import rmsnorm as tri_rmsnorm
    from splitserve.kernels.triton import rotary as tri_rotary

    t, h, eps = ELEM_TOKENS, ELEM_HIDDEN, 1e-6
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE).to(DTYPE)

    def rmsnorm_row() -> dict:
        x, res, w = randn(t, h), randn(t, h), 1 + randn(h) / 10
        out, new_res = tri_rmsnorm.fused_add_rms_norm(x, res, w, eps)
        want, want_res = rmsnorm.rms_norm(x.float(), w.float(), eps, res.float())
        err = check("rmsnorm+residual", max(rel_err(out, want), rel_err(new_res, want_res)))
        run = lambda: tri_rmsnorm.fused_add_rms_norm(x, res, w, eps)
        baseline = lambda: rmsnorm.rms_norm(x, w, eps, res)
        nbytes = rmsnorm_residual_bytes(t, h, DTYPE)
        return {**timed(nbytes, floor_ms(nbytes, copy_gbps), run, baseline, timing), "rel_err": err}

    def rope_inputs() -> tuple[torch.Tensor, ...]:
        qkv = randn(t, Q_HEADS + 2 * KV_HEADS, HEAD_DIM)  # q and k are views, as in attention
        q, k = qkv[:, :Q_HEADS], qkv[:, Q_HEADS : Q_HEADS + KV_HEADS]
        inv_freq = 1e6 ** -(torch.arange(0, HEAD_DIM, 2, device=DEVICE) / HEAD_DIM)
        freqs = torch.arange(4 * t, device=DEVICE)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        positions = torch.randint(0, 4 * t, (t,), generator=gen, device=DEVICE)
        return positions, q, k, emb.cos(), emb.sin()

    def rotary_row() -> dict:
        q_heads, kv_heads = Q_HEADS, KV_HEADS
        positions, q, k, cos_cache, sin_cache = rope_inputs()
        q_out, k_out = tri_rotary.rotary_embedding(positions, q, k, cos_cache, sin_cache)
        cos, sin = cos_cache[positions], sin_cache[positions]
        errs = [rel_err(q_out, rotary.apply_rotary(q.float(), cos, sin))]
        errs.append(rel_err(k_out, rotary.apply_rotary(k.float(), cos, sin)))
        err = check("rotary q and k", max(errs))
        run = lambda: tri_rotary.rotary_embedding(positions, q, k, cos_cache, sin_cache)
        baseline = lambda: rotary.rotary_embedding(positions, q, k, cos_cache, sin_cache)
        nbytes = rotary_bytes(t, q_heads, kv_heads, HEAD_DIM, HEAD_DIM, DTYPE)
        return {**timed(nbytes, floor_ms(nbytes, copy_gbps), run, baseline, timing), "rel_err": err}

    def qk_norm_rope_row() -> dict:
        positions, q, k, cos_cache, sin_cache = rope_inputs()
        qw, kw = 1 + randn(HEAD_DIM) / 10, 1 + randn(HEAD_DIM) / 10
        args = (positions, q, k, qw, kw, eps, cos_cache, sin_cache)
        got = tri_norm_rope.qk_norm_rope(*args)
        f32 = (positions, q.float(), k.float(), qw.float(), kw.float(), eps, cos_cache, sin_cache)
        want = norm_rope.qk_norm_rope(*f32)
        err = max(check(f"qk_norm_rope {x}", rel_err(g, w)) for x, g, w in zip("qk", got, want))

        def unfused():  # what the attention layer ran before: two norms (copies first), rotary
            q_n, k_n = tri_rmsnorm.rms_norm(q, qw, eps), tri_rmsnorm.rms_norm(k, kw, eps)
            return tri_rotary.rotary_embedding(positions, q_n, k_n, cos_cache, sin_cache)

        run = lambda: tri_norm_rope.qk_norm_rope(*args)
        baseline = lambda: norm_rope.qk_norm_rope(*args)  # the torch norms, then torch rotary
        nbytes = qk_norm_rope_bytes(t, Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE)
        unfused_ms = roofline.time_cuda_ms(unfused, **timing)
        print(f"  qk_norm_rope: the unfused Triton norms + rotary take {unfused_ms:.3f} ms")
        row = timed(nbytes, floor_ms(nbytes, copy_gbps), run, baseline, timing)
        return {**row, "unfused_triton_ms": unfused_ms, "rel_err": err}

    def silu_row() -> dict:
        x = randn(t, 2 * h)
        err = check(
            "silu_and_mul",
            rel_err(tri_activation.silu_and_mul(x), activation.silu_and_mul(x.float())),
        )
        run = lambda: tri_activation.silu_and_mul(x)
        baseline = lambda: activation.silu_and_mul(x)
        nbytes = silu_and_mul_bytes(t, h, DTYPE)
        return {**timed(nbytes, floor_ms(nbytes, copy_gbps), run, baseline, timing), "rel_err": err}

    shape = f"{t} x {h}"
    return [
        guarded({"kernel": "rmsnorm+residual", "shape": shape}, rmsnorm_row),
        guarded(
            {"kernel": "rotary", "shape": f"{t} x ({Q_HEADS}+{KV_HEADS}) x {HEAD_DIM}"}, rotary_row
        ),
        guarded(
            {"kernel": "qk_norm_rope", "shape": f"{t} x ({Q_HEADS}+{KV_HEADS}) x {HEAD_DIM}"},
            qk_norm_rope_row,
        ),
        guarded({"kernel": "silu_and_mul", "shape": f"{t} x 2*{h}"}, silu_row),
    ]


# ---- report ------------------------------------------------------------------------

FIGURES = [("ms", "ms"), ("GB/s", "gbps")]
BASELINE = [("torch ms", "torch_ms"), ("speed-up", "speedup")]
# per section: title, table columns (header, row key), bar label, plot title, target
SECTIONS = {
    "kv_store": (
        f"KV store, {KV_HEADS} KV heads x {HEAD_DIM}, block size {BLOCK_SIZE}, NHD, scattered "
        "slots, FP8 timed with calibrated=True (uncal. ms: the plain call, amax kernel + "
        f"store); floor: bytes at the copy bandwidth (target >= {KV_TARGET})",
        [("dtype", "dtype"), ("tokens", "tokens"), ("MB", "mb"), *FIGURES,
         ("of copy", "ratio_to_floor"), ("b2b ms", "b2b_ms"), ("b2b of copy", "b2b_ratio"),
         ("write-flush ms", "write_flush_ms"), ("uncal. ms", "uncalibrated_ms"), *BASELINE],
        lambda row: f"{row['dtype']} {row['tokens']}",
        "KV store: fraction of copy bandwidth",
        KV_TARGET,
    ),
    "moe": (
        f"MoE, hidden {MOE_HIDDEN}, {MOE_EXPERTS} experts, top-{MOE_TOP_K}, intermediate "
        f"{MOE_INTERMEDIATE}, bf16, routing + fused MoE; floor: the chosen experts' weights "
        "at the copy bandwidth, or the FLOPs at the GEMM rate",
        [("tokens", "tokens"), ("experts", "experts"), ("MB", "mb"), ("GFLOP", "gflop"),
         ("floor ms", "floor_ms"), *FIGURES, ("of floor", "ratio_to_floor"),
         ("routing ms", "routing_ms"), *BASELINE],
        lambda row: f"{row['tokens']} tokens",
        "MoE layer: floor time / time",
        None,
    ),
    "elementwise": (
        "Elementwise, bf16; floor: bytes at the copy bandwidth",
        [("kernel", "kernel"), ("shape", "shape"), ("MB", "mb"), *FIGURES,
         ("of copy", "ratio_to_floor"), *BASELINE],
        lambda row: row["kernel"],
        "Elementwise: fraction of copy bandwidth",
        None,
    ),
}  # fmt: skip


def show(section: str, rows: list[dict]) -> None:
    title, columns, *_ = SECTIONS[section]
    print(f"\n{title}\n")
    cells = [[row.get(key) for _, key in columns] for row in rows]
    roofline.print_table([header for header, _ in columns], cells)
    for row in rows:
        if "error" in row:
            print(f"  not timed: {row['error']}")


def plot(json_path: Path, section: str, rows: list[dict]) -> None:
    _, _, label, title, target = SECTIONS[section]
    path = json_path.with_name(f"{json_path.stem}_{section}.png")
    ratios = [row.get("ratio_to_floor", math.nan) for row in rows]
    try:
        roofline.plot_ratios(path, [label(row) for row in rows], ratios, title, target)
    except ImportError:
        print(f"matplotlib is not installed: no {path}")
        return
    print(f"wrote {path}")


def _dtype_name(dtype) -> str:
    return {torch.bfloat16: "bf16", FP8: "fp8_e4m3"}.get(dtype, str(dtype))


def run_sections(sections: list[str], quick: bool, copy_gbps: float, tflops: float, timing):
    """``{section: rows}`` for the sections asked for."""
    results = {}
    if "kv_store" in sections:
        dtypes = [DTYPE]
        if torch.cuda.get_device_capability() >= (8, 9):
            dtypes.append(FP8)
        else:
            print("FP8 KV store skipped: needs compute capability >= 8.9")
        results["kv_store"] = [
            guarded(
                {"dtype": _dtype_name(d), "tokens": n},
                lambda d=d, n=n: kv_store_row(n, d, copy_gbps, timing),
            )
            for d in dtypes
            for n in (KV_TOKENS_QUICK if quick else KV_TOKENS)
        ]
    if "moe" in sections:
        weights = moe_weights()
        results["moe"] = [
            guarded({"tokens": n}, lambda n=n: moe_row(n, weights, copy_gbps, tflops, timing))
            for n in (MOE_TOKENS_QUICK if quick else MOE_TOKENS)
        ]
        del weights
    if "elementwise" in sections:
        results["elementwise"] = elementwise_rows(copy_gbps, timing)
    for rows in results.values():
        for row in rows:
            if "bytes" in row:
                row["mb"] = row["bytes"] / 1e6
    return results


def sweep_kv_store() -> None:
    """``--sweep-kv-store``: the KV store's tilings (``kv_store_sweep.py``), nothing else."""
    import triton

    try:
        import kv_store_sweep
    except ImportError:
        from benchmarks import kv_store_sweep

    copy_gbps = roofline.copy_bandwidth_gbps(torch.device("cuda", torch.cuda.current_device()))
    name = torch.cuda.get_device_name()
    print(f"{name}, triton {triton.__version__}: copy {copy_gbps:.0f} GB/s (read + write)")
    dtypes = [DTYPE, FP8] if torch.cuda.get_device_capability() >= (8, 9) else [DTYPE]
    timing = {"warmup": 5, "repeat": 30, "flush_l2": True}
    nbytes = lambda n, d: kv_store_bytes(n, KV_HEADS, HEAD_DIM, DTYPE, d)
    kv_store_sweep.run(kv_store_inputs, nbytes, copy_gbps, timing, dtypes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--json", help="report path (default docs/perf/kernels_<label>.json)")
    ap.add_argument("--label", help="the device kind in the file name (default: the GPU name)")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument(
        "--sweep-kv-store", action="store_true", help="only time the KV store's tilings, print"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_roofline needs a CUDA GPU")
    if args.sweep_kv_store:
        sweep_kv_store()
        return

    command = roofline.command_line("kernels_roofline.py")
    name = torch.cuda.get_device_name()
    label = args.label or roofline.device_slug(name)
    timing = {"warmup": 3, "repeat": 10} if args.quick else {"warmup": 10, "repeat": 50}
    timing["flush_l2"] = True
    device = torch.device("cuda", torch.cuda.current_device())
    copy_gbps, tflops = roofline.copy_bandwidth_gbps(device), roofline.gemm_tflops(device)
    print(f"{name}: copy {copy_gbps:.0f} GB/s (read + write), bf16 GEMM {tflops:.0f} TFLOP/s")

    results = run_sections(args.sections, args.quick, copy_gbps, tflops, timing)
    for section, rows in results.items():
        show(section, rows)
    report = {
        "benchmark": "kernels_roofline",
        **roofline.environment(command),
        "device_kind": label,
        "copy_gbps": copy_gbps,
        "gemm_tflops": tflops,
        "timing": timing,
        **results,
    }
    path = args.json or (None if args.quick else f"docs/perf/kernels_{label}.json")
    if path:
        roofline.write_report(path, report)
        print(f"\nwrote {path}")
        for section, rows in results.items():
            plot(Path(path), section, rows)
    errors = sum("error" in row for rows in results.values() for row in rows)
    if errors:
        raise SystemExit(f"{errors} kernel(s) not timed: see 'not timed' above")


if __name__ == "__main__":
    main()
