"""KV store (reshape-and-cache) reference: write new K/V rows into a paged cache.

A token's slot is ``block_id * block_size + offset``; slot ``-1`` means "do not
write" (CUDA-graph padding rows). Two cache layouts:

- ``NHD``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the KVCache default)
- ``HND``: ``[num_blocks, num_kv_heads, block_size, head_dim]``

FP8 (``torch.float8_e4m3fn``) caches hold ``value / scale`` with one float32
scale per tensor (one for K, one for V, per layer); see ``store_kv_fp8``.
"""

from __future__ import annotations

import torch

LAYOUTS = ("NHD", "HND")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_FP8_CAPABILITY = (8, 9)  # Ada / Hopper: first GPUs with e4m3 conversions


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # NHD or HND, see the module docstring
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 skips the row
    layout: str = "NHD",
) -> None:
    """Write each token's K/V at its slot, cast to the cache dtype; slot -1 is skipped."""
    _check_layout(layout)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for new, cache in ((k, k_cache), (v, v_cache)):
        _cache_rows(cache, layout, slots, new[keep].to(cache.dtype))


def store_kv_fp8(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # float8_e4m3fn, NHD or HND
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 skips the row
    k_scale: torch.Tensor,  # [1] float32, 0 = not calibrated yet; updated in place
    v_scale: torch.Tensor,
    layout: str = "NHD",
    *,
    calibrated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize K/V to float8_e4m3fn with a per-tensor scale and write them at their slots.

    Scale semantics (K and V each have their own): the cache stores
    ``fp8(clamp(x / scale, -448, 448))`` and a reader recovers ``x ~ float(q) * scale``.
    The scale is dynamic once: while it holds 0 it is uncalibrated, and a store
    sets it to ``amax(|x|) / 448`` over the rows it writes (slot >= 0; a store
    whose written rows are all zero, or that writes no row, leaves it at 0).
    After that it stays fixed, so every entry of the cache is read back with the
    scale it was written with; later values beyond ``448 * scale`` saturate.
    Returns ``(k_scale, v_scale)``, the same tensors, updated in place.

    ``calibrated=True`` is the caller's promise that both scales are already > 0
    (as vLLM stops computing scales after the first forward): the amax pass is
    skipped and the result is that of a plain call. Pass it only after seeing the
    scales set, e.g. read once on the host outside any CUDA graph; a scale still 0
    would stay 0 and its rows would be written unscaled (clamped to +-448).
    """
    _check_layout(layout)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for new, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if cache.dtype != FP8_DTYPE:
            raise ValueError(f"store_kv_fp8 needs a {FP8_DTYPE} cache, got {cache.dtype}")
        rows = new[keep].float()
        if not calibrated:
            calibrate_fp8_scale(scale, rows.abs().amax() if rows.numel() else rows.new_zeros(()))
        _cache_rows(cache, layout, slots, quantize_fp8(rows, scale))
    return k_scale, v_scale


def calibrate_fp8_scale(scale: torch.Tensor, amax: torch.Tensor) -> None:
    """In place: an uncalibrated (0) scale becomes ``amax / 448``; a set scale stays."""
    scale.copy_(torch.where(scale > 0, scale, amax.float() / FP8_MAX))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(clamp(x / scale, -448, 448))``; an uncalibrated (0) scale only sees zeros."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x.float() / safe).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale``: what an attention kernel reads from an FP8 cache."""
    return q.float() * scale.float()


def check_kv_cache_dtype(dtype: torch.dtype, device: torch.device | str) -> None:
    """Start-up check: refuse a KV cache dtype that this device cannot store.

    FP8 KV needs ``float8_e4m3fn`` and, on CUDA, compute capability >= 8.9;
    older GPUs cannot convert to e4m3, and a cache that silently held zeros
    would make every answer garbage.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"KV cache dtype must be a float dtype, got {dtype}")
    if dtype.itemsize != 1:
        return
    if dtype != FP8_DTYPE:
        raise ValueError(f"FP8 KV cache supports {FP8_DTYPE} only, got {dtype}")
    device = torch.device(device)
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        need = ".".join(map(str, MIN_FP8_CAPABILITY))
        raise RuntimeError(
            f"FP8 KV cache ({dtype}) needs a GPU with compute capability >= {need} "
            f"(Ada, Hopper or newer); {device} is {name} with capability "
            f"{capability[0]}.{capability[1]}. Use a bfloat16 or float16 KV cache."
        )


def _cache_rows(cache: torch.Tensor, layout: str, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[slot] = row`` for each (slot, row); ``rows`` is ``[n, num_kv_heads, head_dim]``."""
    if layout == "NHD":
        cache.view(-1, *cache.shape[2:])[slots] = rows
    else:
        block_size = cache.shape[2]
        cache[slots // block_size, :, slots % block_size] = rows


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV cache layout {layout!r}; supported: {', '.join(LAYOUTS)}")
