"""FP8 (e4m3) tiles read as int32 words and widened to float16 in registers.

A ``tl.dot`` over a float16 tile widened from an 8-bit load makes Triton stage the
8-bit tile in shared memory and widen each operand fragment after reading it back
(its dot-operand pass moves the conversion past the copy to halve the copy's bytes).
Where the operand's reduction runs across the tile's rows, as V's does in attention's
second product (tokens are its K dimension, its bytes run along the head dimension),
that read-back gathers single bytes (Hopper has no transposing 8-bit ``ldmatrix``).
Widened here, from words, the conversion stays ahead of the copy: the tile is staged
at 16 bits and read back with transposing ``ldmatrix``. In the split-KV decode loop
(128 tokens a tile, two warps, Triton 3.9, sm_90) that took a thread's instructions a
tile from 2,007 to 1,555 and its spills from 121 to none (``docs/perf/TUNING.md``).

``asm``: one PTX ``cvt.rn.f16x2.e4m3x2`` a byte pair (compute capability 8.9 and up);
without it (older GPUs, Triton's interpreter) the bytes are shifted out and widened
one by one, to the same values.
"""

from __future__ import annotations

import triton
import triton.language as tl

_CVT_WORD = tl.constexpr("""{
    .reg .b16 low, high;
    .reg .b32 low2, high2;
    mov.b32 {low, high}, $4;
    cvt.rn.f16x2.e4m3x2 low2, low;
    cvt.rn.f16x2.e4m3x2 high2, high;
    mov.b32 {$0, $1}, low2;
    mov.b32 {$2, $3}, high2;
}""")


@triton.jit
def widen_e4m3_words(words, ASM: tl.constexpr):
    """``[N, W]`` int32 words of packed e4m3 to ``[N, 4 W]`` float16: byte ``i`` of word
    ``w`` (little-endian) is column ``4 w + i``."""
    if ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            _CVT_WORD, "=h,=h,=h,=h,r", [words],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        b0, b1, b2 = _byte(words, 0), _byte(words, 1), _byte(words, 2)
        b3 = _byte(words, 3)
    columns = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [N, W, 2, 2]: [w, i, j] = 4w+2i+j
    return tl.reshape(columns, [words.shape[0], words.shape[1] * 4])


@triton.jit
def _byte(words, i: tl.constexpr):
    """Byte ``i`` of each word, read as e4m3 and widened to float16."""
    byte = ((words >> (8 * i)) & 0xFF).to(tl.uint8)
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
