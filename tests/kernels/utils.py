"""Shared helpers of the kernel tests."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

# fp32 on CPU (interpreter) agrees to rounding; bf16 / fp16 on the GPU to a few ulps.
RTOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float64; NaN anywhere fails every comparison."""
    out, ref = out.double(), ref.double()
    assert not out.isnan().any(), "NaN in kernel output"
    assert ref.abs().max() > 0, "reference is all zeros: the test could not fail"
    return ((out - ref).abs().max() / ref.abs().max()).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = rel_err(out, ref)
    assert err <= RTOL[dtype], f"relative error {err:.3g} > {RTOL[dtype]:.3g} ({dtype})"


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=dtype)
