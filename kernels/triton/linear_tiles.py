"""The tiling of the Triton linear (``linear.py``): ``LinearConfig`` and ``default_config``.

Tiles come from the shapes and the GPU's SM count, not from autotuning (which syncs
and times kernels, also during capture); ``benchmarks/linear_roofline.py --sweep``
times alternatives, and ``docs/perf/TUNING.md`` holds what they measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from splitserve.kernels.tuning import INTERPRETER_SMS, MEDIUM_BATCH_ROWS, SMALL_BATCH_ROWS

SPLIT_K_MAX_M = SMALL_BATCH_ROWS  # ``tl.dot`` tiles with a K split up to this many rows
MAX_M = MEDIUM_BATCH_ROWS  # above SPLIT_K_MAX_M: one wave of whole-K programs (``one_wave``)


@dataclass(frozen=True)
class LinearConfig:
    """Tiling of one launch; ``num_warps`` and ``num_stages`` go to Triton."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True  # tensor cores (rows padded to 16); False: the one-row GEMV

    def __post_init__(self):
        sizes = {"block_n": self.block_n, "block_k": self.block_k}
        for name, v in sizes.items():
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.use_dot and min(sizes.values()) < 16:
            raise ValueError(f"use_dot needs block_n and block_k >= 16, got {sizes}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")

    def block_m(self, m: int) -> int:
        """Rows per program: all ``m`` of them, padded to a power of two >= 16 for ``tl.dot``."""
        if not self.use_dot and m != 1:
            raise ValueError(f"use_dot=False is the one-row GEMV; got {m} rows")
        return max(triton.next_power_of_2(m), 16) if self.use_dot else 1


def default_config(m: int, n: int, k: int, num_sms: int = INTERPRETER_SMS) -> LinearConfig:
    """Tiles for ``[m, k] @ [n, k]^T`` on a GPU of ``num_sms`` SMs (``linear.py``'s docstring).

    One row: the GEMV on ``[16, 512]`` tiles, no K split. Up to ``SPLIT_K_MAX_M`` rows:
    ``tl.dot`` on ``[32, 128]`` tiles (``[64, 128]`` when N alone gives two programs an
    SM), with K split in 2, 4, ... until the grid has over 1.5 programs an SM; four
    stages. More rows: one wave, no K split, ``[32, 256]`` tiles four deep or, when
    that takes more programs than SMs, ``[64, 128]`` five deep. Four warps.
    """
    block_k = max(triton.next_power_of_2(k), 16)
    if m == 1:
        return LinearConfig(16, min(512, block_k), num_warps=4, num_stages=4, use_dot=False)
    if m > SPLIT_K_MAX_M:
        if triton.cdiv(n, 32) <= num_sms:
            return LinearConfig(32, min(256, block_k), num_warps=4, num_stages=4)
        return LinearConfig(64, min(128, block_k), num_warps=4, num_stages=5)
    block_n = 64 if triton.cdiv(n, 64) >= 2 * num_sms else 32
    block_k = min(128, block_k)
    split = 1
    while 2 * triton.cdiv(n, block_n) * split <= 3 * num_sms and k >= 4 * split * block_k:
        split *= 2
    return LinearConfig(block_n, block_k, split, num_warps=4, num_stages=4, use_dot=True)
