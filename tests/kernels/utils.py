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


def tiny_model(preset: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A random-init tiny preset (weights drawn on the host: equal on every device)."""
    from splitserve.workers.model.loader import load_hf_config, load_model

    config, _ = load_hf_config(preset)
    return load_model(config, None, dtype, device)


@torch.no_grad()
def prefill_then_decode(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """float32 logits of a packed prefill of ``prompts`` (every position), then of one
    decode step per prompt (token 7), concatenated; on the model's device and dtype."""
    from splitserve.workers.attention.torch_backend import TorchAttentionBackend
    from splitserve.workers.kv.cache import KVCache
    from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch

    param = next(model.parameters())
    block_size = 4
    blocks_per_seq = max(len(p) for p in prompts) // block_size + 1
    cache = KVCache(
        model.kv_layout.with_storage(block_size, param.dtype),
        1 + blocks_per_seq * len(prompts),
        param.device,
    )
    tables = [
        list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
        for i in range(len(prompts))
    ]
    backend = TorchAttentionBackend()
    logits = []
    for step in ("prefill", "decode"):
        reqs = [
            StepRequest(p, 0, t, sample=True)
            if step == "prefill"
            else StepRequest([7], len(p), t, sample=True)
            for p, t in zip(prompts, tables)
        ]
        fb = build_forward_batch(reqs, cache, backend, param.device)
        logits.append(model.compute_logits(model(fb.input_ids, fb.positions, fb)))
    return torch.cat(logits)


def prompts(lengths: tuple[int, ...] = (7, 13, 4), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in lengths]


def count_launches(monkeypatch, module, kernel: str) -> list:
    """The grids of every launch of ``module.<kernel>`` from now on (the kernel still runs)."""
    grids = []
    real = getattr(module, kernel)

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(module, kernel, Spy())
    return grids
