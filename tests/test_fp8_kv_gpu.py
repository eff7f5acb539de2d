"""An FP8 KV cache on a GPU (FP8-capable, compute capability >= 8.9): FlashInfer and
the Triton split-KV kernel read it with its scales, in eager steps and in CUDA graphs.

- Each FlashInfer path (split-KV decode, FlashInfer decode, XQA decode on Hopper,
  paged prefill, a mixed step) over an FP8 cache matches the torch backend over the
  same cache (XQA within 5e-2: it rounds q and the probabilities to e4m3).
- An engine (head_dim 128: FlashInfer; CUDA graphs on) with FP8 KV follows bf16 KV's
  next token where bf16's top-2 gap is safe, and FP8 replays equal FP8 eager, with
  either FP8 decode kernel (``kernels.fp8_decode``).
"""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.kernels.fp8_decode_cuda import FP8DecodeKernel
from splitserve.kernels.kv_store import FP8_DTYPE
from splitserve.workers.attention.base import AttentionSpec
from splitserve.workers.attention.torch_backend import TorchAttentionBackend
from splitserve.workers.attention.xqa_decode import XQADecode
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch
from tests import checkpoints
from tests.test_fp8_kv import SAFE_GAP, _generated_rows, _logits, prompt_set

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)",
    ),
]

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _cache(scales_set: bool) -> KVCache:
    cache = KVCache(KVLayout(2, KV_HEADS, DIM, BLOCK, FP8_DTYPE), 512, "cuda")
    for t in cache.k + cache.v:
        t[1:] = (torch.randn(t[1:].shape, device="cuda") * 32).to(FP8_DTYPE)
    if scales_set:
        cache.scales.set([1 / 32, 1 / 32], [1 / 16, 1 / 16])
    return cache


STEPS = {  # (new tokens, cached tokens) per request
    "decode": [(1, 700), (1, 33), (1, 1)],
    "prefill": [(300, 0), (17, 0)],
    "prefill after a cached prefix": [(40, 200)],
    "mixed": [(1, 500), (64, 100), (9, 0)],
}


DECODE = {  # decode kernel: (split_kv_max_batch, fp8_decode, tolerance)
    "split-kv": (64, "split_kv", 2e-2),
    "flashinfer-decode": (0, "split_kv", 2e-2),
    "xqa": (64, "xqa", 5e-2),
    "mma": (64, "mma", 2e-2),
}


@pytest.mark.parametrize("decode", sorted(DECODE))
@pytest.mark.parametrize("scales_set", [True, False], ids=["calibrated", "uncalibrated"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_flashinfer_backend_reads_fp8_like_torch(step, scales_set, decode):
    from splitserve.workers.attention.flashinfer_backend import FlashInferAttentionBackend

    split_kv, fp8_decode, tolerance = DECODE[decode]
    if fp8_decode == "xqa" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("XQA's FP8 kernel is Hopper's")

    outs, caches = [], []
    for make in (
        lambda: FlashInferAttentionBackend(
            HEADS,
            KV_HEADS,
            DIM,
            torch.bfloat16,
            torch.device("cuda"),
            split_kv_max_batch=split_kv,
            kv_dtype=FP8_DTYPE,
            fp8_decode=fp8_decode,
        ),  # fmt: skip
        TorchAttentionBackend,
    ):
        torch.manual_seed(0)
        cache, backend = _cache(scales_set), make()
        steps, first = [], 1
        for new, cached in STEPS[step]:
            n = -(-(new + cached) // BLOCK)
            steps.append(StepRequest([1] * new, cached, list(range(first, first + n)), True))
            first += n
        tokens = sum(new for new, _ in STEPS[step])
        q = torch.randn(tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (
            torch.randn(tokens, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in "kv"
        )
        fb = build_forward_batch(steps, cache, backend, torch.device("cuda"))
        outs.append(backend.forward(q, k, v, AttentionSpec(1, HEADS, DIM**-0.5), fb).float())
        caches.append(cache)
    err = ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item()
    assert err < tolerance, err
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # the same rows stored
    assert caches[0].scales.on_host() == caches[1].scales.on_host()


def _backend(fp8_decode: str, head_dim: int = DIM):
    from splitserve.workers.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(
        HEADS, KV_HEADS, head_dim, torch.bfloat16, torch.device("cuda"), kv_dtype=FP8_DTYPE,
        fp8_decode=fp8_decode,
    )  # fmt: skip


def test_auto_falls_back_where_the_tensor_core_kernel_cannot_run_and_mma_refuses():
    blocks_of_8 = KVCache(KVLayout(2, KV_HEADS, DIM, 8, FP8_DTYPE), 64, "cuda")
    assert isinstance(_backend("auto")._fp8_kernel(_cache(True)), FP8DecodeKernel)
    assert _backend("auto")._fp8_kernel(blocks_of_8) is None  # the Triton kernel
    with pytest.raises(ValueError, match="got head_dim 128, group 4, block_size 8.*use auto"):
        _backend("mma")._fp8_kernel(blocks_of_8)
    with pytest.raises(ValueError, match="got head_dim 64.*use auto or split_kv"):
        _backend("mma", head_dim=64)  # refused at start-up
    assert _backend("auto", head_dim=64)._fp8_kernel(_cache(True)) is None


@pytest.fixture(scope="module")
def qwen3_hd128(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3-hd128"), head_dim=128)


def _engine(path, kv: str, graphs: bool, fp8_decode: str) -> LLM:
    return LLM(
        str(path),
        device="cuda",
        dtype="bfloat16",
        block_size=16,
        num_kv_blocks=512,
        max_model_len=256,
        kv_cache_dtype=kv,
        cuda_graph={"enabled": graphs},
        kernels={"fp8_decode": fp8_decode},
    )


FP8_KERNEL = {"auto": FP8DecodeKernel, "split_kv": type(None), "xqa": XQADecode}


@pytest.mark.parametrize("fp8_decode", sorted(FP8_KERNEL))
def test_engine_fp8_follows_bf16_kv_and_graphs_equal_eager(qwen3_hd128, fp8_decode):
    if fp8_decode == "xqa" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("XQA's FP8 kernel is Hopper's")
    prompts = prompt_set()
    outs = {}
    for kv, graphs in (("auto", True), ("fp8_e4m3", False), ("fp8_e4m3", True)):
        llm = _engine(qwen3_hd128, kv, graphs, fp8_decode)
        backend = llm.engine.runner.attn_backend
        assert backend.name == "flashinfer"
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        if kv == "fp8_e4m3":  # the FP8 decode steps' kernel, by the caches' block sizes
            assert {type(k) for k in backend._fp8_kernels.values()} == {FP8_KERNEL[fp8_decode]}
        outs[kv, graphs] = [list(o.outputs[0].token_ids) for o in got]
        if kv == "auto":
            sequences = [p + r for p, r in zip(prompts, outs[kv, graphs])]
            rows = _generated_rows(prompts, sequences)
            bf16 = _logits(llm.engine, sequences)[rows]
        elif graphs:
            fp8 = _logits(llm.engine, sequences)[rows]
        assert llm.engine.block_manager.num_free_blocks == 511
    assert outs["fp8_e4m3", True] == outs["fp8_e4m3", False]
    top2 = bf16.topk(2).values
    safe = top2[:, 0] - top2[:, 1] >= SAFE_GAP
    agree = (fp8.argmax(-1) == bf16.argmax(-1))[safe].float().mean().item()
    assert agree >= 0.99, agree
