"""Tilings of the Triton KV store: which (BLOCK_T, num_warps) is fastest on this GPU.

    python benchmarks/kernels_roofline.py --sweep-kv-store

For the KV-store shape of ``kernels_roofline.py`` (bf16 rows, bf16 and FP8
caches, 4096 and 16384 tokens) this times the store kernel alone (FP8: its
scales calibrated first, as ``calibrated=True`` runs it) under every tiling
that gives a thread 8 to 64 elements of K (and as many of V): 16 configs for
8 heads x 128. Each config is first checked to write the bytes that the default
tiling (``default_tiling`` in ``kernels/triton/kv_store.py``) writes. Prints
the fraction of the copy bandwidth per config and case, then the best config
per case beside the default, to set the default from.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

try:  # run as a script: benchmarks/ is on the path
    import roofline
except ImportError:  # imported as benchmarks.kv_store_sweep
    from benchmarks import roofline

TOKENS = (4096, 16384)
BLOCK_TS = (1, 2, 4, 8, 16)
WARPS = (1, 2, 4, 8, 16)
PER_THREAD = (8, 64)  # elements of K per thread: a 16-byte bf16 load at least


def tilings(tile_row: int) -> list[tuple[int, int]]:
    """(BLOCK_T, num_warps) giving each thread ``PER_THREAD`` elements of K; ``tile_row``
    is one token's ``BLOCK_H * BLOCK_D``."""
    low, high = PER_THREAD
    return [(t, w) for t in BLOCK_TS for w in WARPS if low <= t * tile_row // (32 * w) <= high]


def sweep_case(n: int, cache_dtype, inputs: Callable, timing: dict) -> tuple[dict, tuple]:
    """``{"default" or (BLOCK_T, num_warps): ms, or the error's text}`` for one case, and
    the default tiling."""
    from splitserve.kernels.triton import kv_store as tri

    k, v, k_cache, v_cache, slots = inputs(n, cache_dtype)
    scales = (None, None)
    if cache_dtype == torch.float8_e4m3fn:
        scales = torch.zeros(1, device=k.device), torch.zeros(1, device=k.device)
        tri.store_kv_fp8(k, v, k_cache.clone(), v_cache.clone(), slots, *scales)
    geometry = tri._geometry(k, v, k_cache, v_cache, "NHD")
    caches = k_cache.clone(), v_cache.clone()
    store = lambda **tiling: tri._launch(k, v, *caches, slots, geometry, *scales, **tiling)
    store()
    want = [c.view(torch.uint8).clone() for c in caches]
    results = {"default": roofline.time_cuda_ms(store, **timing)}
    block_h, block_d = tri._tile(*k.shape[1:])
    for block_t, num_warps in tilings(block_h * block_d):
        for cache, original in zip(caches, (k_cache, v_cache)):
            cache.copy_(original)
        tiled = partial(store, block_t=block_t, num_warps=num_warps)
        try:
            tiled()
            if not all(torch.equal(c.view(torch.uint8), w) for c, w in zip(caches, want)):
                raise RuntimeError("wrote other bytes than the default tiling")
            results[(block_t, num_warps)] = roofline.time_cuda_ms(tiled, **timing)
        except Exception as e:  # a config that fails must not hide the others
            results[(block_t, num_warps)] = f"{type(e).__name__}: {e}"
    return results, tri.default_tiling(*k.shape)


def run(inputs: Callable, nbytes: Callable, copy_gbps: float, timing: dict, dtypes) -> dict:
    """Sweep every (dtype, tokens) case; print the table and the best config per case.

    ``inputs(n, dtype)`` gives ``(k, v, k_cache, v_cache, slots)``; ``nbytes(n, dtype)``
    the bytes of the floor. Returns ``{case: {config: ms or error}}``.
    """
    names = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}
    cases, floors, defaults = {}, {}, {}
    for dtype in dtypes:
        for n in TOKENS:
            name = f"{names.get(dtype, dtype)} {n}"
            cases[name], defaults[name] = sweep_case(n, dtype, inputs, timing)
            floors[name] = nbytes(n, dtype) / copy_gbps / 1e6
    ratio = lambda name, ms: floors[name] / ms if isinstance(ms, float) else None
    configs = list(next(iter(cases.values())))
    print("\nKV store tilings, store kernel alone: fraction of the copy bandwidth\n")
    roofline.print_table(
        ["BLOCK_T x warps", *cases],
        [[_label(c), *(ratio(name, res.get(c)) for name, res in cases.items())] for c in configs],
    )
    print()
    for name, res in cases.items():
        timed = {c: ms for c, ms in res.items() if isinstance(ms, float) and c != "default"}
        for config, ms in res.items():
            if not isinstance(ms, float):
                print(f"  {name}: {_label(config)} not timed: {ms}")
        if not timed:
            continue
        best = min(timed, key=timed.get)
        print(
            f"  {name}: best {_label(best)}, {ratio(name, timed[best]):.3f} of copy "
            f"({timed[best] * 1e3:.1f} us); default {_label(defaults[name])}, "
            f"{ratio(name, res['default']):.3f}"
        )
    return cases


def _label(config) -> str:
    return config if isinstance(config, str) else f"{config[0]} x {config[1]}"
