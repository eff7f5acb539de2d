"""The Triton linear (``kernels/triton/linear.py``) against ``F.linear`` in float32.

On CPU the kernel runs through Triton's interpreter, in bf16 and fp16 too: the
interpreter rounds float32 to bf16 by truncation (the GPU rounds to nearest), so
bf16 results may sit one ulp (2^-7 relative) from the rounded reference; that
is inside ``RTOL``. Its ``tl.dot`` mistakes bf16 for integers, so the
``_interpreter_bf16_dot`` fixture hands it float32 copies (exact: products of
bf16 values, summed in float32).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import linear as reference
from splitserve.kernels import ops
from splitserve.kernels.triton import linear as tri
from splitserve.kernels.triton.activation import silu_and_mul
from splitserve.kernels.triton.linear import LinearConfig, default_config
from splitserve.kernels.triton.rmsnorm import rms_norm
from splitserve.kernels.tuning import INTERPRETER_SMS, medium_batch_kernels
from splitserve.workers.model.layers.linear import Linear, MergedLinear
from tests.kernels.utils import (
    DEVICE,
    ON_GPU,
    assert_close,
    prefill_then_decode,
    prompts,
    randn,
    tiny_model,
)

HALF = [torch.bfloat16, torch.float16]
ROWS = [1, 2, 3, 8, 16]
WAVE_ROWS = [17, 40, 64]  # one wave of whole-K programs
# (N, K): N not a multiple of block_n = 16, K not a multiple of block_k = 64
SHAPES = [(40, 200), (33, 96)]
GPU_SHAPES = [(6144, 4096), (4096, 12288), (1000, 4000), (151936, 4096)]


@pytest.fixture(autouse=True)
def _interpreter_bf16_dot(monkeypatch):
    if ON_GPU:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def as_float32(h):
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle(
            (h.data.astype(np.uint32) << 16).view(np.float32), tl.float32
        )

    def patched(self, a, b, d, *args):
        return create_dot(self, as_float32(a), as_float32(b), d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", patched)


def operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    x = randn(m, k, dtype=dtype)
    w = (randn(n, k) / k**0.5).to(dtype)
    b = randn(n, dtype=dtype) if bias else None
    return x, w, b


def want(x, w, b) -> torch.Tensor:
    """The reference on float32 copies of the operands."""
    return reference.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])  # 3: 4 K tiles as 2 + 2 + an empty split
@pytest.mark.parametrize("m,use_dot", [(1, False)] + [(m, True) for m in ROWS])
def test_matches_reference(m, use_dot, split_k, bias, dtype):
    """The GEMV (one row) and the ``tl.dot`` path, with and without split-K."""
    n, k = SHAPES[0]
    x, w, b = operands(m, n, k, dtype, bias)
    config = LinearConfig(block_n=16, block_k=64, split_k=split_k, use_dot=use_dot)
    out = tri.small_m_linear(x, w, b, config)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, want(x, w, b), dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", ROWS + WAVE_ROWS)
@pytest.mark.parametrize(
    "shape", SHAPES + [(40, 4096)] + [pytest.param(s, marks=pytest.mark.gpu) for s in GPU_SHAPES]
)
def test_default_config_matches_reference(shape, m, dtype):
    """The heuristic's tiles at every row count; ``linear`` takes the kernel up to 16 rows,
    and up to 64 where one wave covers the weight (not the LM head's)."""
    n, k = shape
    x, w, b = operands(m, n, k, dtype, bias=True)
    wave = n < 151936 and medium_batch_kernels(x.device)
    assert tri.supported(x, w, b) == (m <= tri.SPLIT_K_MAX_M or wave)
    assert_close(tri.small_m_linear(x, w, b), want(x, w, b), dtype)
    assert_close(tri.linear(x, w, b), want(x, w, b), dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m,use_dot", [(1, False)] + [(m, True) for m in ROWS])
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul_linear_is_the_two_kernels_in_one(shape, m, use_dot, split_k, dtype):
    """The activation computed on load rounds as the SiLU kernel does: bitwise the
    output of that kernel followed by the linear, and close to the float32 reference."""
    n, k = shape
    gate_up = randn(m, 2 * k, dtype=dtype)
    _, w, b = operands(m, n, k, dtype, bias=True)
    config = LinearConfig(block_n=16, block_k=64, split_k=split_k, use_dot=use_dot)
    got = tri.silu_and_mul_linear(gate_up, w, b, config)
    assert torch.equal(got, tri.small_m_linear(silu_and_mul(gate_up), w, b, config))
    want_silu = reference.silu_and_mul_linear(gate_up.float(), w.float(), b.float())
    assert_close(got, want_silu, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES + [pytest.param((6144, 4096), marks=pytest.mark.gpu)])
def test_rms_norm_linear_fuses_the_add_norm_into_one_row(shape, bias, with_residual, dtype):
    """One row: one kernel, every program norming the row itself. The sum it hands on is
    bitwise the add-norm kernel's; the output is the two kernels' within rounding (the
    norm's sum of squares may add in another order). The inputs are left alone."""
    n, k = shape
    x, w, b = operands(1, n, k, dtype, bias)
    residual = randn(1, k, dtype=dtype) if with_residual else None
    norm_w = (1 + randn(k) / 4).to(dtype)
    x_before = x.clone()
    got, got_residual = tri.rms_norm_linear(x, residual, norm_w, 1e-6, w, b)
    if residual is None:
        normed, want_residual = rms_norm(x, norm_w, 1e-6), x
    else:
        normed, want_residual = rms_norm(x, norm_w, 1e-6, residual)
    assert torch.equal(got_residual, want_residual) and torch.equal(x, x_before)
    assert_close(got, tri.small_m_linear(normed, w, b), dtype)
    want_ref = reference.rms_norm_linear(
        x.float(), None if residual is None else residual.float(), norm_w.float(), 1e-6,
        w.float(), None if b is None else b.float(),
    )  # fmt: skip
    assert_close(got, want_ref[0], dtype)


def test_rms_norm_linear_runs_the_two_kernels_for_more_rows(monkeypatch):
    x, w, b = operands(3, 40, 96, torch.bfloat16, bias=True)
    residual, norm_w = randn(3, 96, dtype=torch.bfloat16), randn(96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one-row GEMV"):
        tri.small_m_linear(x[:1], w, b, LinearConfig(16, 64), norm=(None, norm_w, 1e-6, None))
    monkeypatch.setattr(tri, "_linear_kernel", None)  # the fused launch would raise
    monkeypatch.setattr(tri, "small_m_linear", lambda x, w, b, config: F.linear(x, w, b))
    got, got_residual = tri.rms_norm_linear(x, residual, norm_w, 1e-6, w, b)
    normed, want_residual = rms_norm(x, norm_w, 1e-6, residual)
    assert torch.equal(got, F.linear(normed, w, b)) and torch.equal(got_residual, want_residual)


def test_leading_dims_and_strided_rows():
    n, k = SHAPES[1]
    x, w, b = operands(6, n, k, torch.bfloat16, bias=True)
    rows = torch.cat([x, x], dim=1)[:, :k]  # row stride 2k
    got = tri.linear(rows.view(2, 3, k), w, b)
    assert got.shape == (2, 3, n)
    assert_close(got.view(6, n), want(x, w, b), torch.bfloat16)
    cols = torch.stack([x, x], dim=-1)[..., 0]  # stride 2 along K: copied first
    assert_close(tri.linear(cols, w, b), want(x, w, b), torch.bfloat16)


@pytest.mark.parametrize(
    "case",
    [
        "many rows",
        "wide at 17 rows",
        "float32",
        "transposed weight",
        "fp16 bias",
        "strided bias",
        "no rows",
    ],
)
def test_falls_back_to_f_linear(case, monkeypatch):
    m, n, k = 65, 24, 32
    if case == "wide at 17 rows":  # more weight rows than one wave of 64-row tiles takes
        m, n = 17, 64 * INTERPRETER_SMS + 1
    x, w, b = operands(m, n, k, torch.bfloat16, bias=True)
    if case == "float32":
        x, w, b = x.float(), w.float(), b.float()
    elif case not in ("many rows", "wide at 17 rows"):
        x = x[:2]
    if case == "transposed weight":
        w = w.t().contiguous().t()
    elif case == "fp16 bias":
        b = b.half()
    elif case == "strided bias":
        b = torch.stack([b, b], dim=-1)[:, 0]
    elif case == "no rows":
        x = x[:0]
    assert not tri.supported(x, w, b)
    monkeypatch.setattr(tri, "small_m_linear", None)  # calling the kernel would raise
    if case == "fp16 bias":  # F.linear refuses it: so must linear
        with pytest.raises(RuntimeError):
            F.linear(x, w, b)
        with pytest.raises(RuntimeError):
            tri.linear(x, w, b)
        return
    assert torch.equal(tri.linear(x, w, b), F.linear(x, w, b))


def test_config_checks():
    with pytest.raises(ValueError, match="power of two"):
        LinearConfig(block_n=24, block_k=64)
    with pytest.raises(ValueError, match=">= 16"):
        LinearConfig(block_n=8, block_k=64, use_dot=True)
    with pytest.raises(ValueError, match="split_k"):
        LinearConfig(block_n=16, block_k=64, split_k=0)
    x, w, _ = operands(2, 8, 32, torch.bfloat16, bias=False)
    with pytest.raises(ValueError, match="one-row GEMV; got 2 rows"):
        tri.small_m_linear(x, w, None, LinearConfig(block_n=8, block_k=32, use_dot=False))
    with pytest.raises(ValueError, match=r"weight must be \[N, 32\]"):
        tri.small_m_linear(x, w[:, :16])


QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,k", QWEN3_8B)
def test_default_config_on_decode_shapes(n, k, m):
    """Whole K tiles (no masks), the GEMV for one row without a K split; every grid
    covers an H200's 132 SMs, the ``tl.dot`` grids with 1.5 programs an SM or more
    but not twice that from splitting K."""
    cfg = default_config(m, n, k, num_sms=132)
    programs = -(-n // cfg.block_n) * cfg.split_k
    assert k % cfg.block_k == 0 and (k // cfg.split_k) % cfg.block_k == 0
    assert cfg.use_dot == (m > 1)
    assert m > 1 or (cfg.split_k == 1 and programs >= 132)
    assert m == 1 or programs >= 198
    assert cfg.split_k == 1 or programs / 2 < 198


@pytest.mark.parametrize("m", WAVE_ROWS)
@pytest.mark.parametrize("n,k", QWEN3_8B[:2] + QWEN3_8B[3:4])
def test_default_config_takes_one_wave_above_16_rows(n, k, m):
    """17 to 64 rows: no K split, at most one program an SM of an H200, whole K tiles,
    and the pipeline within the 227 KB of shared memory an sm90 program may have."""
    cfg = default_config(m, n, k, num_sms=132)
    assert cfg.split_k == 1 and cfg.use_dot and k % cfg.block_k == 0
    assert 96 <= -(-n // cfg.block_n) <= 132
    assert cfg.num_stages * (cfg.block_n + cfg.block_m(m)) * cfg.block_k * 2 <= 227 * 1024


def test_ops_dispatch_both_branches(monkeypatch):
    x, w, b = operands(3, 40, 96, torch.bfloat16, bias=True)
    got = {}
    for triton in (True, False):
        monkeypatch.setattr(ops, "use_triton", lambda t, triton=triton: triton)
        got[triton] = ops.linear(x, w, b)
    assert torch.equal(got[False], F.linear(x, w, b))
    assert_close(got[True], want(x, w, b), torch.bfloat16)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny", "glm4-moe-tiny"])
def test_model_projections_and_lm_head_call_ops_linear(preset, monkeypatch):
    """Each dense projection of the decoder layers and the LM head call ``ops.linear``
    once a forward; nothing else does (MoE experts, routers, embedding); the logits
    are unchanged."""
    model = tiny_model(preset, torch.float32, DEVICE)
    want_logits = prefill_then_decode(model, prompts())
    calls = []

    def spy(x, weight, bias=None, config=None):
        calls.append(weight.shape[0])
        return F.linear(x, weight, bias)

    monkeypatch.setattr(reference, "linear", spy)
    monkeypatch.setattr(tri, "linear", spy)
    assert torch.equal(prefill_then_decode(model, prompts()), want_logits)
    projections = [
        module.weight.shape[0]
        for module in model.model.layers.modules()
        if isinstance(module, Linear | MergedLinear)
    ]
    assert projections and sorted(calls) == sorted(2 * (projections + [model.config.vocab_size]))


def test_benchmark_sweep_grid_and_totals():
    """``benchmarks/linear_roofline.py``'s pure parts: a modest grid that starts with
    the default and keeps whole K tiles; a decode step's totals weight shapes by layer."""
    from benchmarks import linear_roofline as bench

    for n, k in bench.SHAPES.values():
        for m in bench.SWEEP_ROWS:
            configs = bench.sweep_configs(m, n, k, num_sms=132)
            assert configs[0] == default_config(m, n, k)
            assert 5 <= len(configs) <= 35 and len(set(configs)) == len(configs)
            assert all(k % c.block_k == 0 and (c.use_dot or m == 1) for c in configs)
    assert bench.linear_bytes(2, 3, 5) == 2 * (15 + 10 + 6)
    rows = [
        {"shape": s, "m": 1, "floor_us": 1.0, "cublas_us": 2.0, "triton_us": 1.5}
        for s in bench.SHAPES
    ]
    (total,) = bench.decode_totals(rows)
    calls = 4 * bench.LAYERS + 1
    assert total["floor_us"] == calls and total["speedup"] == pytest.approx(4 / 3)


def test_dense_layers_take_their_add_norms_and_activation_into_the_linears(monkeypatch):
    """Each qwen3 layer's two add-norms go into its qkv and gate_up matmuls
    (``rms_norm_linear``), its SiLU-and-mul into down (``silu_and_mul_linear``): the
    calls that one-row decode fuses. The logits are unchanged."""
    model = tiny_model("qwen3-tiny", torch.float32, DEVICE)
    want_logits = prefill_then_decode(model, prompts())
    calls = []

    def spy(name, weight_at, original):
        def call(*args, **kwargs):  # on CUDA ops passes next_starts_at_once
            calls.append((name, args[weight_at].shape[0]))
            return original(*args, **kwargs)

        return call

    for name, weight_at in (("rms_norm_linear", 4), ("silu_and_mul_linear", 1)):
        for module in (reference, tri):
            monkeypatch.setattr(module, name, spy(name, weight_at, getattr(module, name)))
    assert torch.equal(prefill_then_decode(model, prompts()), want_logits)
    per_layer = []
    for layer in model.model.layers:
        per_layer += [
            ("rms_norm_linear", layer.self_attn.qkv_proj.weight.shape[0]),
            ("rms_norm_linear", layer.mlp.gate_up_proj.weight.shape[0]),
            ("silu_and_mul_linear", layer.mlp.down_proj.weight.shape[0]),
        ]
    assert sorted(calls) == sorted(2 * per_layer)  # the prefill and the decode step
