"""``e4m3_words.widen_e4m3_words`` against torch's e4m3 -> float16 conversion on every
byte value, in every position of a word: by PTX on a GPU, by shifts anywhere."""

import pytest
import torch
import triton
import triton.language as tl

from splitserve.kernels.kv_store import FP8_DTYPE
from splitserve.kernels.triton.e4m3_words import widen_e4m3_words
from tests.kernels.utils import DEVICE, ON_GPU

FP8_OK = not ON_GPU or torch.cuda.get_device_capability() >= (8, 9)


@triton.jit
def _widen_kernel(words_ptr, out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    words = tl.load(words_ptr + rows * WORDS + tl.arange(0, WORDS)[None, :])
    columns = tl.arange(0, 4 * WORDS)[None, :]
    tl.store(out_ptr + rows * 4 * WORDS + columns, widen_e4m3_words(words, ASM))


@pytest.mark.parametrize(
    "asm",
    [
        False,
        pytest.param(
            True, marks=[pytest.mark.gpu, pytest.mark.skipif(not FP8_OK, reason="sm < 8.9")]
        ),
    ],
)
def test_every_byte_widens_as_torch_does_in_every_position_of_a_word(asm):
    """256 byte values, rotated so that each sits in each of a word's four bytes; NaNs
    (0x7f, 0xff) stay NaN on a GPU (Triton's interpreter widens them to +-480)."""
    values = torch.arange(256, dtype=torch.uint8)
    rows = torch.stack([values.roll(shift) for shift in range(4)])  # [4, 256] bytes
    rows = torch.cat([rows, rows.flip(1)]).to(DEVICE)  # [8, 256]: 8 rows, 64 words each
    out = torch.empty(8, 256, dtype=torch.float16, device=DEVICE)
    _widen_kernel[(1,)](rows.view(torch.int32), out, ROWS=8, WORDS=64, ASM=asm)
    want = rows.view(FP8_DTYPE).to(torch.float16)
    numbers = ~want.isnan()
    assert numbers.sum() == 8 * 254
    assert torch.equal(out[numbers], want[numbers])
    if ON_GPU:
        assert out[~numbers].isnan().all()
