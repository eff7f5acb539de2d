"""The gate_up projection with SiLU-and-mul in its epilogue (``triton/gate_up_silu.py``)
against the reference composition, ``silu_and_mul(linear(x, weight))``.

Rounding on the interpreter as in ``test_linear.py`` (whose fixture hands its ``tl.dot``
float32 copies of bf16 operands)."""

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import linear as reference
from splitserve.kernels import ops
from splitserve.kernels.triton import gate_up_silu as tri
from splitserve.kernels.triton.activation import silu_and_mul
from splitserve.kernels.tuning import medium_batch_kernels
from splitserve.workers.model.layers.layernorm import AddNorm, RMSNorm
from splitserve.workers.model.layers.mlp import GatedMLP
from splitserve.workers.runner.step_plan import plan_rows
from tests.kernels.test_linear import _interpreter_bf16_dot  # noqa: F401 - autouse fixture
from tests.kernels.utils import DEVICE, assert_close, count_launches, randn

HALF = [torch.bfloat16, torch.float16]
# (D, K): D not a multiple of BLOCK_N = 64, K a multiple of BLOCK_K = 128 or not
SHAPES = [(40, 200), (70, 256)]


def operands(m: int, d: int, k: int, dtype: torch.dtype):
    x = randn(m, k, dtype=dtype)
    w = (randn(2 * d, k) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [tri.MIN_M, 33, tri.MAX_M])
@pytest.mark.parametrize("shape", SHAPES + [pytest.param((12288, 4096), marks=pytest.mark.gpu)])
def test_matches_reference(shape, m, dtype):
    """One launch; close to the float32 reference and to the two kernels it replaces."""
    d, k = shape
    x, w = operands(m, d, k, dtype)
    assert tri.supported(x, w, None) == medium_batch_kernels(x.device)
    got = tri.fused_linear_silu_and_mul(x, w)
    assert got.shape == (m, d) and got.dtype == dtype
    assert_close(got, reference.linear_silu_and_mul(x.float(), w.float()), dtype)
    assert_close(got, silu_and_mul(F.linear(x, w)).float(), dtype)


def test_leading_dims_and_strided_rows():
    d, k = SHAPES[0]
    x, w = operands(24, d, k, torch.bfloat16)
    rows = torch.cat([x, x], dim=1)[:, :k]  # row stride 2k
    got = tri.fused_linear_silu_and_mul(rows.view(4, 6, k), w)
    assert got.shape == (4, 6, d)
    want = reference.linear_silu_and_mul(x.float(), w.float())
    assert_close(got.view(24, d), want, torch.bfloat16)


@pytest.mark.parametrize(
    "case", ["16 rows", "65 rows", "bias", "float32", "odd weight rows", "strided weight"]
)
def test_other_inputs_run_the_two_kernels(case, monkeypatch):
    """Outside its rows, dtypes and layouts the op is the projection then the SiLU kernel."""
    m = {"16 rows": 16, "65 rows": 65}.get(case, 32)
    x, w = operands(m, 40, 96, torch.bfloat16)
    b = randn(80, dtype=torch.bfloat16) if case == "bias" else None
    if case == "float32":
        x, w = x.float(), w.float()
    elif case == "odd weight rows":
        w = w[:79]
    elif case == "strided weight":
        w = torch.stack([w, w], dim=-1)[..., 0]
    assert not tri.supported(x, w, b)
    if case not in ("16 rows", "bias"):  # neither would the fused kernel take
        with pytest.raises(ValueError, match="fused gate_up projection takes"):
            tri.fused_linear_silu_and_mul(x, w)
    monkeypatch.setattr(tri, "_gate_up_silu_kernel", None)  # a launch would raise
    if case == "odd weight rows":
        with pytest.raises(ValueError, match="even last dim"):
            tri.linear_silu_and_mul(x, w, b)
        return
    want = silu_and_mul(tri.linear(x, w, b))
    assert torch.equal(tri.linear_silu_and_mul(x, w, b), want)


def test_ops_pick_the_fused_kernel_on_cuda_only(monkeypatch):
    x, w = operands(24, 40, 96, torch.bfloat16)
    rows = x.shape[0]
    assert ops.activation_in_gate_up(rows, x.device) == (
        x.is_cuda and medium_batch_kernels(x.device)
    )
    got = {}
    for triton in (True, False):
        monkeypatch.setattr(ops, "use_triton", lambda t, triton=triton: triton)
        assert ops.activation_in_gate_up(rows, x.device) == (
            triton and medium_batch_kernels(x.device)
        )
        got[triton] = ops.linear_silu_and_mul(x, w)
    assert torch.equal(got[False], reference.linear_silu_and_mul(x, w))
    assert_close(got[True], reference.linear_silu_and_mul(x.float(), w.float()), torch.bfloat16)


@pytest.mark.parametrize("rows", [24, 8])
def test_gated_mlp_takes_the_activation_into_gate_up_for_its_rows(rows, monkeypatch):
    """A gated MLP of 24 rows launches the fused kernel and no SiLU kernel; of 8 rows
    it does not. Either way its output is the reference MLP's."""
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    mlp = GatedMLP(96, 40).to(DEVICE, torch.bfloat16)
    norm = RMSNorm(96).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(randn(80, 96) / 96**0.5)
        mlp.down_proj.weight.copy_(randn(96, 40) / 40**0.5)
        norm.weight.copy_(1 + randn(96) / 4)
    hidden, residual = randn(rows, 96, dtype=torch.bfloat16), randn(rows, 96, dtype=torch.bfloat16)
    launches = count_launches(monkeypatch, tri, "_gate_up_silu_kernel")
    plan = plan_rows(rows, hidden.device)  # the step's plan picks where the SiLU runs
    with torch.no_grad():
        out, new_residual = mlp(AddNorm(norm, hidden, residual), plan)
        plain = mlp.on_normed(hidden, plan)
        want_normed, summed = norm(hidden, residual)  # the add-norm kernel's own sum
    assert len(launches) == (2 if rows == 24 and medium_batch_kernels(hidden.device) else 0)
    assert torch.equal(new_residual, summed)
    f32 = {k: p.float() for k, p in mlp.state_dict().items()}

    def want(x):
        act = reference.linear_silu_and_mul(x.float(), f32["gate_up_proj.weight"])
        return F.linear(act, f32["down_proj.weight"])

    assert_close(out, want(want_normed), torch.bfloat16)
    assert_close(plain, want(hidden), torch.bfloat16)


@pytest.mark.parametrize(
    "gpu,takes", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA H200", False), ("NVIDIA A100", False)]
)
def test_medium_batch_kernels_only_on_the_gpus_they_beat_cublas_on(gpu, takes, monkeypatch):
    """The H100's decode step gained from the 17-64-row kernels, the H200's lost; the CPU
    interpreter takes them (these tests)."""
    from splitserve.kernels import tuning
    from splitserve.kernels.triton import device, linear

    monkeypatch.setattr(device, "name", lambda d: gpu)
    monkeypatch.setattr(linear, "sm_count", lambda d, off_gpu: 132)
    cuda = torch.device("cuda")
    assert tuning.medium_batch_kernels(cuda) == takes
    assert linear.one_wave(cuda, 4096) == takes
    assert tuning.medium_batch_kernels(torch.device("cpu"))
