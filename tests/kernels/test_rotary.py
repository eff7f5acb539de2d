import pytest
import torch

from splitserve.kernels.rotary import apply_rotary as apply_rotary_ref
from splitserve.kernels.triton.rotary import apply_rotary, rotary_embedding
from tests.kernels.utils import DEVICE, DTYPES, assert_close, randn

# (num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim)
SHAPES = [(5, 4, 2, 64, 64), (7, 3, 1, 80, 40), (4, 2, 2, 128, 64), (3, 2, 1, 96, 96)]
GPU_SHAPES = [(2048, 32, 8, 128, 128), (1000, 12, 4, 128, 64)]
ALL_SHAPES = SHAPES + [pytest.param(s, marks=pytest.mark.gpu) for s in GPU_SHAPES]
MAX_POSITION = 4096


def cos_sin_cache(rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``RotaryEmbedding`` builds it: float32, each frequency twice (neox layout)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, device=DEVICE) / rotary_dim)
    freqs = torch.arange(MAX_POSITION, device=DEVICE)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def qk(shape, dtype):
    """q and k as strided views of one fused qkv tensor, as the attention layer has them."""
    num_tokens, heads, kv_heads, head_dim, _ = shape
    qkv = randn(num_tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)
    return qkv[:, :heads], qkv[:, heads : heads + kv_heads]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_apply_rotary_matches_reference(shape, dtype):
    q, _ = qk(shape, dtype)
    cos_cache, sin_cache = cos_sin_cache(shape[-1])
    positions = torch.randint(0, MAX_POSITION, (shape[0],), device=DEVICE)
    cos, sin = cos_cache[positions], sin_cache[positions]
    q_before = q.clone()
    out = apply_rotary(q, cos, sin)
    ref = apply_rotary_ref(q, cos, sin)
    assert torch.equal(q, q_before)
    assert_close(out, ref, dtype)
    assert torch.equal(out[..., shape[-1] :], q[..., shape[-1] :])  # partial: the rest passes


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_rotary_embedding_on_q_and_k(shape, dtype, inplace):
    q, k = qk(shape, dtype)
    rotary_dim = shape[-1]
    cos_cache, sin_cache = cos_sin_cache(rotary_dim)
    positions = torch.randint(0, MAX_POSITION, (shape[0],), device=DEVICE)
    cos, sin = cos_cache[positions], sin_cache[positions]
    q_ref, k_ref = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = rotary_embedding(positions, q, k, cos_cache, sin_cache, inplace=inplace)
    assert (q_out is q) == inplace and (k_out is k) == inplace
    if not inplace:
        assert torch.equal(q, q_in) and torch.equal(k, k_in)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)
    assert torch.equal(q_out[..., rotary_dim:], q_in[..., rotary_dim:])
    assert not torch.equal(q_out[..., :rotary_dim], q_in[..., :rotary_dim])


def test_odd_rotary_dim_is_refused():
    q = randn(2, 2, 64)
    cos = randn(2, 31)
    with pytest.raises(ValueError, match="even"):
        apply_rotary(q, cos, cos)
