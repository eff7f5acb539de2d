"""The layers' ops (``kernels/ops.py``) on their Triton branch against their reference branch.

The branch is forced both ways on the kernel tests' device: on CPU the Triton
branch runs through the interpreter, so this checks what the dispatch hands each
kernel (argument order, strided views, partial rotary, a missing correction
bias) and whole tiny-model forwards built on it, without a GPU.
"""

import pytest
import torch

from splitserve.kernels import ops
from tests.kernels.utils import (
    DEVICE,
    DTYPES,
    assert_close,
    prefill_then_decode,
    prompts,
    randn,
    tiny_model,
)

PRESETS = ["qwen3-tiny", "qwen3-moe-tiny", "glm4-moe-tiny"]


def both_branches(fn):
    """``(fn() on the Triton branch, fn() on the reference branch)``."""
    out = []
    for triton in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ops, "use_triton", lambda x, triton=triton: triton)
            out.append(fn())
    return out


def test_dispatch_follows_the_device():
    assert not ops.use_triton(torch.zeros(1))
    if torch.cuda.is_available():
        assert ops.use_triton(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 16)])  # hidden states; per-head q/k norm
def test_rms_norm(shape, dtype):
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    weight = (1 + 0.1 * randn(shape[-1])).to(dtype)
    got, want = both_branches(lambda: ops.rms_norm(x, weight, 1e-6))
    assert_close(got, want, dtype)
    (got, got_res), (want, want_res) = both_branches(
        lambda: ops.rms_norm(x, weight, 1e-6, residual)
    )
    assert_close(got, want, dtype)
    assert torch.equal(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [32, 16])  # full and partial (GLM) rotary
def test_rotary_embedding_on_qkv_views(rotary_dim, dtype):
    """q and k as the attention layer makes them: strided views of one fused qkv row."""
    num_tokens, heads, kv_heads, head_dim = 6, 4, 2, 32
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(-1, heads, head_dim), k.reshape(-1, kv_heads, head_dim)
    angles = torch.arange(64, device=DEVICE)[:, None] * 0.1 ** torch.arange(
        rotary_dim // 2, device=DEVICE
    )
    angles = torch.cat((angles, angles), dim=-1)
    positions = torch.tensor([0, 5, 63, 2, 2, 40], device=DEVICE)
    (got_q, got_k), (want_q, want_k) = both_branches(
        lambda: ops.rotary_embedding(positions, q, k, angles.cos(), angles.sin())
    )
    assert_close(got_q, want_q, dtype)
    assert_close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = randn(5, 96, dtype=dtype)
    got, want = both_branches(lambda: ops.silu_and_mul(x))
    assert_close(got, want, dtype)


@pytest.mark.parametrize("residual", [True, False])
def test_linears_with_their_input_op(residual):
    """The add-norm and SiLU-and-mul taken into a one-row linear, in bf16 (the kernel's
    dtypes; the interpreter rounds bf16 by truncation, hence no bitwise check). More rows
    run the two kernels: ``test_linear.py``, whose fixture mends the interpreter's bf16 dot."""
    dtype, rows = torch.bfloat16, 1
    x, res = randn(rows, 64, dtype=dtype), randn(rows, 64, dtype=dtype) if residual else None
    norm_w, w = (1 + 0.1 * randn(64)).to(dtype), (randn(40, 64) / 8).to(dtype)
    (got, got_res), (want, want_res) = both_branches(
        lambda: ops.rms_norm_linear(x, res, norm_w, 1e-6, w)
    )
    assert_close(got, want, dtype)
    assert_close(got_res, want_res, dtype)
    gate_up = randn(rows, 128, dtype=dtype)
    got, want = both_branches(lambda: ops.silu_and_mul_linear(gate_up, w))
    assert_close(got, want, dtype)


@pytest.mark.parametrize("bias", [True, False])
def test_routing(bias):
    logits = randn(9, 16)
    correction = torch.rand(16, device=DEVICE) * 0.3 if bias else None
    (got_w, got_ids), (want_w, want_ids) = both_branches(
        lambda: ops.noaux_tc_topk(logits, correction, 4, 4, 2, True, 2.5)
    )
    assert torch.equal(got_ids.sort(-1).values, want_ids.sort(-1).values)
    assert_close(got_w.sort(-1).values, want_w.sort(-1).values, torch.float32)
    (got_w, got_ids), (want_w, want_ids) = both_branches(lambda: ops.softmax_topk(logits, 3, False))
    assert torch.equal(got_ids, want_ids)
    assert_close(got_w, want_w, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe(dtype):
    num_tokens, hidden, intermediate, num_experts, top_k = 7, 64, 32, 8, 2
    x = randn(num_tokens, hidden, dtype=dtype)
    w13 = (randn(num_experts, 2 * intermediate, hidden) / hidden**0.5).to(dtype)
    w2 = (randn(num_experts, hidden, intermediate) / intermediate**0.5).to(dtype)
    topk_weights, topk_ids = ops.softmax_topk(randn(num_tokens, num_experts), top_k, True)
    got, want = both_branches(lambda: ops.fused_moe(x, w13, w2, topk_weights, topk_ids))
    assert_close(got, want, dtype)


@pytest.mark.parametrize("preset", PRESETS)
def test_tiny_model_forward(preset):
    """float32: the two branches differ by rounding only (routing decisions included)."""
    model = tiny_model(preset, torch.float32, DEVICE)
    got, want = both_branches(lambda: prefill_then_decode(model, prompts()))
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_skips_slot_minus_one(dtype):
    """The KV store both ways: the same cache bytes, padded rows (slot -1) never written."""
    num_blocks, block_size, heads, head_dim = 6, 4, 2, 16
    k, v = randn(5, heads, head_dim, dtype=dtype), randn(5, heads, head_dim, dtype=dtype)
    slots = torch.tensor([5, -1, 0 + 8, 23, -1], device=DEVICE)

    def store():
        caches = [randn(num_blocks, block_size, heads, head_dim, dtype=dtype) for _ in range(2)]
        before = [c.clone() for c in caches]
        ops.store_kv(k, v, *caches, slots)
        return caches, before

    (got, before), (want, _) = both_branches(lambda: (torch.manual_seed(1), store())[1])
    for g, w, b in zip(got, want, before):
        assert torch.equal(g, w)
        flat_g, flat_b = g.flatten(0, 1), b.flatten(0, 1)
        written = torch.zeros(flat_g.shape[0], dtype=torch.bool, device=DEVICE)
        written[[5, 8, 23]] = True
        assert torch.equal(flat_g[~written], flat_b[~written])
    assert torch.equal(got[0].flatten(0, 1)[[5, 8, 23]], k[[0, 2, 3]])
