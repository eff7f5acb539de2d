import pytest
import torch

from splitserve.kernels import ops
from splitserve.kernels.qk_norm_rope import qk_norm_rope as qk_norm_rope_ref
from splitserve.kernels.rmsnorm import rms_norm
from splitserve.kernels.rotary import rotary_embedding
from splitserve.kernels.triton.qk_norm_rope import qk_norm_rope
from tests.kernels.utils import DEVICE, ON_GPU, assert_close, randn

# (num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim)
SHAPES = [
    (5, 4, 2, 16, 16),  # qwen3-tiny
    (4, 4, 2, 32, 16),  # glm4-moe-tiny: partial rotary
    (3, 3, 1, 64, 64),
    (2, 2, 2, 80, 40),  # head_dim not a power of two
    (3, 8, 2, 128, 64),
    (2, 2, 1, 256, 256),
]
GPU_SHAPES = [(4096, 32, 8, 128, 128), (1000, 12, 4, 64, 32), (333, 16, 2, 256, 128)]
ALL_SHAPES = SHAPES + [pytest.param(s, marks=pytest.mark.gpu) for s in GPU_SHAPES]
# The interpreter truncates float32 -> bf16 (the GPU and torch round to nearest): no CPU bf16.
DTYPES = (
    [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float16, torch.float32]
)
MAX_POSITION, EPS = 4096, 1e-6


def cos_sin_cache(rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``RotaryEmbedding`` builds it: float32, each frequency twice (neox layout)."""
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, rotary_dim, 2, device=DEVICE) / rotary_dim)
    freqs = torch.arange(MAX_POSITION, device=DEVICE)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def inputs(shape, dtype):
    """q and k as strided views of one fused qkv output, as the attention layer has them."""
    num_tokens, heads, kv_heads, head_dim, rotary_dim = shape
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)
    q_weight, k_weight = (1 + 0.5 * randn(head_dim, dtype=dtype) for _ in "qk")
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=DEVICE)
    return qkv, (positions, q, k, q_weight, k_weight, EPS, *cos_sin_cache(rotary_dim))


def by_hand(x, weight, positions, cos_cache, sin_cache):
    """Each rounding step written out: the normed row to x's dtype, times the weight rounded
    to the output dtype, the first rotary_dim dims rotated in float32 and rounded once."""
    h = x.float()
    normed = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    half = cos_cache.shape[-1] // 2
    cos, sin = cos_cache[positions][:, None], sin_cache[positions][:, None]
    x1, x2 = normed[..., :half].float(), normed[..., half : 2 * half].float()
    y1 = x1 * cos[..., :half] - x2 * sin[..., :half]
    y2 = x2 * cos[..., half:] + x1 * sin[..., half:]
    rotated = torch.cat((y1, y2), dim=-1).to(normed.dtype)
    return torch.cat((rotated, normed[..., 2 * half :]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_kernel_matches_reference(shape, dtype):
    qkv, args = inputs(shape, dtype)
    qkv_before = qkv.clone()
    q_out, k_out = qk_norm_rope(*args)
    q_ref, k_ref = qk_norm_rope_ref(*args)
    assert torch.equal(qkv, qkv_before)  # q, k (and v beside them) read, never written
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        assert out.dtype == ref.dtype == dtype and out.is_contiguous()
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_norm_then_rotary(shape, dtype):
    """Bit for bit the existing references composed, and their rounding steps by hand."""
    _, (positions, q, k, q_weight, k_weight, eps, cos, sin) = inputs(shape, dtype)
    q_ref, k_ref = qk_norm_rope_ref(positions, q, k, q_weight, k_weight, eps, cos, sin)
    q_normed, k_normed = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    composed = rotary_embedding(positions, q_normed, k_normed, cos, sin)
    assert torch.equal(q_ref, composed[0]) and torch.equal(k_ref, composed[1])
    assert torch.equal(q_ref, by_hand(q, q_weight, positions, cos, sin))
    assert torch.equal(k_ref, by_hand(k, k_weight, positions, cos, sin))
    rotary_dim = cos.shape[-1]
    assert torch.equal(q_ref[..., rotary_dim:], q_normed[..., rotary_dim:])  # partial: passed


def test_float32_weights_promote_like_the_reference():
    _, (positions, q, k, q_weight, k_weight, *rest) = inputs((3, 4, 2, 32, 16), torch.float16)
    args = (positions, q, k, q_weight.float(), k_weight.float(), *rest)
    for out, ref in zip(qk_norm_rope(*args), qk_norm_rope_ref(*args)):
        assert out.dtype == ref.dtype == torch.float32
        assert_close(out, ref, torch.float16)


def test_ops_dispatch_strided_last_dim_and_no_tokens():
    _, args = inputs((4, 4, 2, 32, 16), torch.float32)
    want = qk_norm_rope_ref(*args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "use_triton", lambda x: True)
        got = ops.qk_norm_rope(*args)
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)
    positions, q, k, *rest = args
    q = randn(*q.shape[:2], 2 * q.shape[2])[..., ::2]  # a last dim with stride 2 is copied first
    for g, w in zip(qk_norm_rope(positions, q, k, *rest), qk_norm_rope_ref(positions, q, k, *rest)):
        assert_close(g, w, torch.float32)
    _, args = inputs((0, 4, 2, 32, 16), torch.float32)
    q_out, k_out = qk_norm_rope(*args)
    assert q_out.shape == (0, 4, 32) and k_out.shape == (0, 2, 32)


def test_bad_shapes_are_refused():
    _, (positions, q, k, q_weight, k_weight, eps, cos, sin) = inputs(
        (2, 2, 1, 32, 32), torch.float32
    )
    with pytest.raises(ValueError, match="even"):
        qk_norm_rope(positions, q, k, q_weight, k_weight, eps, cos[:, :31], sin[:, :31])
    with pytest.raises(ValueError, match="even, <= head_dim 32"):
        qk_norm_rope(positions, q, k, q_weight, k_weight, eps, *cos_sin_cache(64))
    with pytest.raises(ValueError, match=r"k_weight \(16,\) does not match head_dim 32"):
        qk_norm_rope(positions, q, k, q_weight, k_weight[:16], eps, cos, sin)
    with pytest.raises(ValueError, match="same num_tokens and head_dim"):
        qk_norm_rope(positions, q, k[:1], q_weight, k_weight, eps, cos, sin)


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_graph_replays_new_inputs():
    shape = (64, 8, 2, 128, 64)
    qkv, args = inputs(shape, torch.bfloat16)
    qk_norm_rope(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = qk_norm_rope(*args)
    previous = None
    for _ in range(2):
        new_qkv, (new_positions, *_) = inputs(shape, torch.bfloat16)
        qkv.copy_(new_qkv)  # q and k are views of it
        args[0].copy_(new_positions)
        graph.replay()
        for got, want in zip(static_out, qk_norm_rope_ref(*args)):
            assert_close(got, want, torch.bfloat16)
        if previous is not None:
            assert not torch.equal(static_out[0], previous)  # the replay saw the new input
        previous = static_out[0].clone()
