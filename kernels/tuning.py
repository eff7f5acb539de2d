"""Which kernel variants and tiles each GPU takes: the one table that names GPU models.

A choice differs by GPU only where a measurement showed that it should; the
figures, and the runs that gave them, are in ``docs/perf/TUNING.md``. A device
is looked up by a substring of its name (``GPUS``); a GPU the table does not
name takes ``DEFAULT``, and Triton's CPU interpreter, which runs the kernel
tests, ``INTERPRETER``. Nothing here imports triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from splitserve.kernels.triton import device as gpu

# Rows of a matmul (the requests of a decode step) that the Triton linear takes on
# every GPU, and up to which the medium-batch kernels take more.
SMALL_BATCH_ROWS = 16
MEDIUM_BATCH_ROWS = 64


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape: ``[block_n, block_k]`` weight tiles, pipeline depth, warps."""

    block_n: int
    block_k: int
    num_stages: int
    num_warps: int


@dataclass(frozen=True)
class MoETiles:
    """The fused MoE's two grouped GEMMs (``triton/fused_moe.py``): rows a program takes
    (one expert's), and each GEMM's tiles."""

    block_m: int
    gate_up: Tiles
    down: Tiles

    @classmethod
    def of(cls, block_m: int, block_n: int, block_k: int) -> MoETiles:
        """Both GEMMs on ``[block_m, block_n, block_k]`` blocks, 3 stages, 4 warps (8 past
        64 x 64 blocks)."""
        tiles = Tiles(block_n, block_k, 3, 4 if block_m * block_n <= 64 * 64 else 8)
        return cls(block_m, tiles, tiles)


@dataclass(frozen=True)
class DecodeTiles:
    """The split-KV decode kernel's launch (``triton/decode_attention.py``): tokens a tile,
    pipeline depth, warps; and for an FP8 cache, whether its tiles widen to float16 (exact
    for e4m3, as bfloat16 is) with q cast to float16 for the products."""

    block_n: int
    num_stages: int
    num_warps: int
    fp8_f16_dot: bool = False


@dataclass(frozen=True)
class FP8DecodeTiles:
    """The tensor-core FP8 decode kernel's launch (``fp8_decode_cuda.py``): KV heads a
    block (one warp each), tiles of 16 tokens in flight a warp, and blocks an SM the
    split count aims at."""

    warps: int = 8
    stages: int = 2
    blocks_per_sm: float = 2.0


@dataclass(frozen=True)
class GpuTuning:
    """What one kind of GPU takes."""

    # From SMALL_BATCH_ROWS + 1 to MEDIUM_BATCH_ROWS rows: a gated MLP's SiLU-and-mul in
    # its gate_up projection's epilogue (``gate_up_silu.py``), and the Triton linear in
    # one wave of whole-K programs where the weight fits one (``linear.one_wave``).
    # Each kernel alone beats cuBLAS wherever it was timed, but only on some GPUs did a
    # whole decode step gain; elsewhere cuBLAS and the SiLU kernel keep these rows.
    medium_batch_kernels: bool = False
    # ``gate_up_silu.py``'s tiles (wherever it runs; the tests call it on any GPU).
    gate_up_silu_tiles: Tiles = field(default_factory=lambda: Tiles(64, 128, 4, 4))
    # The fused MoE where its experts get at most 16 rows each (decode): the best of
    # ``benchmarks/moe_tiles.py`` on every shape it sweeps (H200, 2026-11-26: 3-6% faster
    # than 64 x 64 blocks on both GEMMs).
    # The split-KV decode kernel on a cache in the model's dtype and on an FP8 cache: the
    # best of ``benchmarks/decode_tiles.py`` at 64 requests x 8k (H200, 2026-11-26). FP8
    # tiles of 64 tokens in bfloat16 ran 2.7x their floor, as slow as bf16's tiles.
    split_kv_tiles: DecodeTiles = field(default_factory=lambda: DecodeTiles(64, 3, 4))
    split_kv_fp8_tiles: DecodeTiles = field(
        default_factory=lambda: DecodeTiles(128, 1, 2, fp8_f16_dot=True)
    )
    # The tensor-core FP8 decode kernel: the best at 64 requests x 8k in two sweeps, within
    # 1-3% of the best at 32 and 16 and 3-10% faster than the Triton kernel at 8
    # (``decode_tiles.py``, H100, 2026-12-07).
    fp8_decode_tiles: FP8DecodeTiles = field(default_factory=FP8DecodeTiles)
    moe_decode_tiles: MoETiles = field(
        default_factory=lambda: MoETiles(
            16, gate_up=Tiles(128, 128, 3, 4), down=Tiles(64, 128, 4, 8)
        )
    )


GPUS: dict[str, GpuTuning] = {
    "H100": GpuTuning(medium_batch_kernels=True),
}
DEFAULT = GpuTuning()
INTERPRETER = GpuTuning(medium_batch_kernels=True)  # the kernel tests run every kernel
# The SM count the interpreter stands in with, and the default of the linear's tiling:
# an H200's, the GPU its tiles were first timed on.
INTERPRETER_SMS = 132


def for_device(device: torch.device) -> GpuTuning:
    """The table's entry for ``device``: by its name on a GPU, ``INTERPRETER`` off it."""
    if device.type != "cuda":
        return INTERPRETER
    return _by_name(gpu.name(device))


def medium_batch_kernels(device: torch.device) -> bool:
    """Whether 17 to 64 rows take the Triton kernels on ``device`` (``GpuTuning``)."""
    return for_device(device).medium_batch_kernels


@functools.cache
def _by_name(name: str) -> GpuTuning:
    return next((tuning for key, tuning in GPUS.items() if key in name), DEFAULT)
