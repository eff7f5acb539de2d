"""KV gather / scatter: the torch reference against a per-token loop, and the fused CUDA
kernel against the reference, on random caches, slots and block sizes."""

import pytest
import torch

from splitserve.kernels.kv_gather import gather_kv, scatter_kv, token_rows
from tests.kernels.utils import ON_GPU

# (layers, heads, head_dim, block_size, num_blocks, tokens)
SHAPES = [(3, 2, 8, 4, 9, 13), (4, 1, 4, 16, 4, 40)]
GPU_SHAPES = [(36, 8, 128, 16, 300, 4096), (5, 4, 64, 32, 40, 777)]


def make_cache(shape, dtype, device="cpu"):
    layers, heads, dim, block_size, num_blocks, _ = shape
    size = (num_blocks, block_size, heads, dim)
    k = [torch.randn(size, device=device).to(dtype) for _ in range(layers)]
    v = [torch.randn(size, device=device).to(dtype) for _ in range(layers)]
    return k, v


def random_slots(shape, device="cpu"):
    """Distinct slots in random order, as a prompt's scattered blocks give."""
    _, _, _, block_size, num_blocks, tokens = shape
    return torch.randperm(num_blocks * block_size, device=device)[:tokens]


def loop_gather(k, v, first, layers, slots):
    """``[layers, 2, tokens, heads, dim]``, one token at a time."""
    return torch.stack(
        [
            torch.stack([torch.stack([c.flatten(0, 1)[s] for s in slots.tolist()]) for c in kv])
            for kv in zip(k[first : first + layers], v[first : first + layers])
        ]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_gather_reads_each_token_of_each_layer(shape, dtype):
    k, v = make_cache(shape, dtype)
    slots, layers = random_slots(shape), shape[0] - 1
    out = torch.empty(layers, 2, slots.numel(), shape[1], shape[2], dtype=dtype)
    gather_kv(k, v, 1, slots, out)
    assert torch.equal(out, loop_gather(k, v, 1, layers, slots))


@pytest.mark.parametrize("shape", SHAPES)
def test_scatter_writes_only_the_slots_and_inverts_gather(shape):
    k, v = make_cache(shape, torch.bfloat16)
    slots = random_slots(shape)
    kv = torch.randn(2, 2, slots.numel(), shape[1], shape[2]).to(torch.bfloat16)
    before = [t.clone() for t in k + v]
    scatter_kv(k, v, 1, slots, kv)
    back = torch.empty_like(kv)
    gather_kv(k, v, 1, slots, back)
    assert torch.equal(back, kv)
    keep = torch.ones(k[0].shape[0] * k[0].shape[1], dtype=torch.bool)
    keep[slots] = False
    for layer, (old, new) in enumerate(zip(before, k + v)):
        touched = layer % len(k) in (1, 2)
        assert torch.equal(old.flatten(0, 1)[keep], new.flatten(0, 1)[keep])
        assert touched != torch.equal(old, new)


def test_token_rows_are_words_when_a_row_divides_into_them():
    assert token_rows(torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)).dtype == torch.int64
    odd = token_rows(torch.zeros(3, 4, 1, 3, dtype=torch.bfloat16))
    assert odd.dtype == torch.bfloat16 and odd.shape == (12, 3)


# ---- fused CUDA kernel (cupy + NVRTC) against the reference ------------------------


def _kernel(k, v):
    pytest.importorskip("cupy")
    from splitserve.kernels.kv_gather_cuda import KVGatherKernel

    return KVGatherKernel(k, v)


def _bf16_on_gpu(shape):
    """A bf16 cache of ``shape`` on the GPU, its fused kernel, and random slots."""
    k, v = make_cache(shape, torch.bfloat16, "cuda")
    return k, v, _kernel(k, v), random_slots(shape, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES + GPU_SHAPES)
def test_cuda_gather_and_scatter_match_the_reference(shape, dtype):
    k, v = make_cache(shape, dtype, "cuda")
    if shape[1] * shape[2] * k[0].element_size() % 16:
        pytest.skip("rows are not 16-byte words")
    kernel, slots = _kernel(k, v), random_slots(shape, "cuda")
    layers = shape[0] - 1
    out = torch.empty(layers, 2, slots.numel(), shape[1], shape[2], dtype=dtype, device="cuda")
    ref = torch.empty_like(out)
    kernel.gather(1, slots, out)
    gather_kv(k, v, 1, slots, ref)
    assert torch.equal(out, ref)
    kv = torch.randn_like(out, dtype=torch.float32).to(dtype)
    k_ref, v_ref = [t.clone() for t in k], [t.clone() for t in v]
    kernel.scatter(1, slots, kv)
    scatter_kv(k_ref, v_ref, 1, slots, kv)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(k + v, k_ref + v_ref))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_scatter_writes_nothing_once_live_is_zero():
    shape = GPU_SHAPES[1]
    k, v, kernel, slots = _bf16_on_gpu(shape)
    kv = torch.randn(2, 2, slots.numel(), shape[1], shape[2], device="cuda").to(torch.bfloat16)
    before = [t.clone() for t in k + v]
    live = torch.zeros(1, dtype=torch.int32, device="cuda")
    kernel.scatter(0, slots, kv, live)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, k + v))
    live.fill_(1)
    kernel.scatter(0, slots, kv, live)
    back = torch.empty_like(kv)
    gather_kv(k, v, 0, slots, back)
    assert torch.equal(back, kv)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_kernel_refuses_a_buffer_of_the_wrong_size():
    shape = SHAPES[0]
    k, v = make_cache(shape, torch.float32, "cuda")
    kernel, slots = _kernel(k, v), random_slots(shape, "cuda")
    short = torch.empty(1, 2, slots.numel() - 1, shape[1], shape[2], device="cuda")
    with pytest.raises(ValueError, match="bytes"):
        kernel.gather(0, slots, short)
    with pytest.raises(ValueError, match="int64"):
        kernel.gather(0, slots.int(), torch.empty(1, 2, slots.numel(), shape[1], shape[2]))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_bound_launches_move_layer_ranges_at_byte_offsets_of_one_staging_buffer():
    """A KV hand-off binds slots and staging once and launches per layer: each launch
    lands at its offset, layer by layer equal to one launch over the range."""
    shape = GPU_SHAPES[1]
    k, v, kernel, slots = _bf16_on_gpu(shape)
    layer = 2 * slots.numel() * shape[1] * shape[2]  # elements of one layer's K and V
    staging = torch.zeros(8 * layer, dtype=torch.bfloat16, device="cuda")
    launch = kernel.bind(slots, staging)
    assert launch.layer_bytes == layer * 2
    launch.gather(1, 1, offset=3 * launch.layer_bytes)  # layers 1, 2 one at a time
    launch.gather(2, 1, offset=4 * launch.layer_bytes)
    launch.gather(1, 2, offset=0)  # and together
    ref = torch.empty(2, 2, slots.numel(), shape[1], shape[2], dtype=torch.bfloat16, device="cuda")
    gather_kv(k, v, 1, slots, ref)
    torch.cuda.synchronize()
    assert torch.equal(staging[: 2 * layer].view_as(ref), ref)
    assert torch.equal(staging[3 * layer : 5 * layer].view_as(ref), ref)
    assert not staging[2 * layer : 3 * layer].any() and not staging[5 * layer :].any()
    launch.scatter(3, 2, offset=3 * launch.layer_bytes)  # layers 3, 4 get 1, 2's rows
    back = torch.empty_like(ref)
    gather_kv(k, v, 3, slots, back)
    assert torch.equal(back, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_bound_launch_refuses_layers_or_bytes_outside_its_buffer():
    shape = GPU_SHAPES[1]
    k, v, kernel, slots = _bf16_on_gpu(shape)
    staging = torch.zeros(2 * 2 * slots.numel() * shape[1] * shape[2] * 2, dtype=torch.uint8)
    launch = kernel.bind(slots, staging.cuda())
    with pytest.raises(ValueError, match="overrun the staging buffer"):
        launch.gather(0, 1, offset=launch.layer_bytes + 16)
    with pytest.raises(ValueError, match="overrun the staging buffer"):
        launch.gather(0, 3)
    with pytest.raises(ValueError, match="layers 4..5 of 5"):
        launch.scatter(4, 2)
    with pytest.raises(ValueError, match="int64"):
        kernel.bind(slots.int(), staging.cuda())
