import pytest
import torch

from splitserve.kernels import kv_store as ref
from splitserve.kernels.triton import kv_store as tri
from tests.kernels.utils import DEVICE, DTYPES, ON_GPU

FP8 = torch.float8_e4m3fn
# (num_tokens, num_kv_heads, head_dim, block_size, num_blocks)
SHAPES = [(7, 2, 64, 4, 5), (13, 3, 80, 16, 3)]
GPU_SHAPES = [(2048, 8, 128, 16, 300), (333, 4, 96, 32, 20)]
FP8_OK = not ON_GPU or torch.cuda.get_device_capability() >= (8, 9)
needs_fp8 = pytest.mark.skipif(not FP8_OK, reason="FP8 needs compute capability >= 8.9")


def cache_shape(layout, num_blocks, block_size, heads, dim):
    if layout == "NHD":
        return (num_blocks, block_size, heads, dim)
    return (num_blocks, heads, block_size, dim)


def make_inputs(shape, layout, dtype, cache_dtype, device=DEVICE):
    """K/V as slices of a fused qkv tensor (strided rows), random slots with some -1, and
    a cache full of random values, so misplaced or skipped writes show."""
    num_tokens, heads, dim, block_size, num_blocks = shape
    qkv = torch.randn(num_tokens, 3 * heads, dim, device=device, dtype=dtype)
    k, v = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[torch.rand(num_tokens, device=device) < 0.25] = -1
    slots[num_tokens // 2] = -1
    shape = cache_shape(layout, num_blocks, block_size, heads, dim)
    k_cache = torch.randn(shape, device=device).to(cache_dtype)
    v_cache = torch.randn(shape, device=device).to(cache_dtype)
    return k, v, k_cache, v_cache, slots


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", SHAPES + [pytest.param(s, marks=pytest.mark.gpu) for s in GPU_SHAPES]
)
def test_store_kv_matches_reference(shape, dtype, layout):
    k, v, k_cache, v_cache, slots = make_inputs(shape, layout, torch.float32, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.store_kv(k, v, k_ref, v_ref, slots, layout)
    assert not torch.equal(k_ref, k_cache)  # the store changes the cache
    tri.store_kv(k, v, k_cache, v_cache, slots, layout)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_reference_layouts_agree_and_skip_minus_one():
    shape = SHAPES[1]
    k, v, k_nhd, v_nhd, slots = make_inputs(shape, "NHD", torch.float32, torch.float32)
    before = k_nhd.clone()
    k_hnd, v_hnd = k_nhd.transpose(1, 2).contiguous(), v_nhd.transpose(1, 2).contiguous()
    ref.store_kv(k, v, k_nhd, v_nhd, slots, "NHD")
    ref.store_kv(k, v, k_hnd, v_hnd, slots, "HND")
    assert torch.equal(k_hnd.transpose(1, 2), k_nhd) and torch.equal(v_hnd.transpose(1, 2), v_nhd)
    flat, flat_before = k_nhd.view(-1, *k.shape[1:]), before.view(-1, *k.shape[1:])
    keep = slots >= 0
    assert torch.equal(flat[slots[keep]], k[keep])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[keep]] = False
    assert torch.equal(flat[untouched], flat_before[untouched])


def test_unknown_layout_and_mismatched_cache_are_refused():
    k, v, k_cache, v_cache, slots = make_inputs(SHAPES[0], "NHD", torch.float32, torch.float32)
    with pytest.raises(ValueError, match="layout"):
        tri.store_kv(k, v, k_cache, v_cache, slots, "NDH")
    with pytest.raises(ValueError, match="does not hold"):
        tri.store_kv(k, v, k_cache, v_cache, slots, "HND")  # an NHD cache read as HND
    with pytest.raises(ValueError, match="store_kv_fp8"):
        tri.store_kv(k, v, k_cache.to(FP8), v_cache.to(FP8), slots)


# --- tilings: BLOCK_T tokens per program -------------------------------------------------

TILINGS = [(2, 1), (4, 2), (8, 4)]  # (BLOCK_T, num_warps)
# 13 tokens (no multiple of 2, 4 or 8); 20 heads x 128 split over two programs of 16 heads
TILING_SHAPES = [SHAPES[1], (11, 20, 128, 4, 4)]


def tiled_inputs(shape, layout, dtype, cache_dtype):
    """As ``make_inputs``, with slot -1 exactly at tokens 1, 5 and 6: inside the first
    program of 2 or 8 tokens and the second of 4, never at a program's first token only."""
    k, v, k_cache, v_cache, slots = make_inputs(shape, layout, dtype, cache_dtype)
    num_tokens, _, _, block_size, num_blocks = shape
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[1, 5, 6]] = -1
    return k, v, k_cache, v_cache, slots


def launch(k, v, k_cache, v_cache, slots, layout, tiling, scales=(None, None)):
    """The store kernel alone with a given (BLOCK_T, num_warps)."""
    geometry = tri._geometry(k, v, k_cache, v_cache, layout)
    block_t, num_warps = tiling
    tri._launch(
        k, v, k_cache, v_cache, slots, geometry, *scales, block_t=block_t, num_warps=num_warps
    )


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("shape", TILING_SHAPES)
def test_tilings_match_reference(shape, layout, tiling):
    k, v, k_cache, v_cache, slots = tiled_inputs(shape, layout, torch.float32, torch.float32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.store_kv(k, v, k_ref, v_ref, slots, layout)
    launch(k, v, k_cache, v_cache, slots, layout, tiling)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@needs_fp8
@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_tilings_match_reference_and_write_the_scale_back(layout, tiling):
    """K's scale as the amax kernel leaves it (-amax), V's set: the tiled store writes
    ``amax / 448`` back and quantizes like the reference (exact: representable values)."""
    k, v, k_cache, v_cache, slots = tiled_inputs(TILING_SHAPES[1], layout, torch.float32, FP8)
    for x in (k, v):
        x.copy_(e4m3_values(x.numel()).view(x.shape) * 0.125)
    scales = [torch.tensor([s], device=DEVICE) for s in (0.125, 0.0625, -56.0, 0.0625)]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.store_kv_fp8(k, v, k_ref, v_ref, slots, *scales[:2], layout, calibrated=True)
    launch(k, v, k_cache, v_cache, slots, layout, tiling, scales[2:])
    assert scales[2].item() == 0.125 and scales[3].item() == 0.0625
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


def test_default_tiling():
    """One token per program while tokens are few; else whole powers of 2 per program, the
    tile bounded and at least MIN_PROGRAMS programs."""
    for n in (1, 7, 512, 2 * tri.MIN_PROGRAMS - 1):
        assert tri.default_tiling(n, 8, 128)[0] == 1
    for n, heads, dim in [(4096, 8, 128), (16384, 8, 128), (10**6, 3, 80), (10**6, 64, 256)]:
        block_t, _ = tri.default_tiling(n, heads, dim)
        block_h, block_d = tri._tile(heads, dim)
        assert block_t > 1 or block_h * block_d * 2 > tri.TOKEN_TILE
        assert block_t & (block_t - 1) == 0 and block_t * block_h * block_d <= tri.TOKEN_TILE
        assert -(-n // block_t) >= tri.MIN_PROGRAMS


# --- FP8 -------------------------------------------------------------------------------


def e4m3_values(n: int, device=DEVICE) -> torch.Tensor:
    """Random finite float8_e4m3fn values, as float32, with 448 present (amax = 448)."""
    codes = torch.randint(0, 256, (n,), device=device, dtype=torch.int32).to(torch.uint8)
    values = codes.view(FP8).float()
    values = torch.where(values.isnan(), torch.zeros_like(values), values)
    values[0] = 448.0
    return values


@needs_fp8
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_store_kv_fp8_exact_on_representable_values(layout):
    """Values that are exactly ``fp8 * 2^-3`` quantize without rounding, so the Triton store
    (slots, layout, amax over written rows, calibration) must equal the reference byte for
    byte; this also holds under the interpreter, whose fp8 rounding is not IEEE."""
    shape = SHAPES[1]
    k, v, k_cache, v_cache, slots = make_inputs(shape, layout, torch.float32, FP8)
    for x in (k, v):
        x.copy_(e4m3_values(x.numel()).view(x.shape) * 0.125)
        x[slots < 0] *= 4.0  # larger than any written value: must not move the scale
        x[(slots >= 0).nonzero()[0, 0], 0, 0] = 448.0 * 0.125
    scales = [torch.zeros(1, device=DEVICE) for _ in range(4)]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.store_kv_fp8(k, v, k_ref, v_ref, slots, scales[0], scales[1], layout)
    tri.store_kv_fp8(k, v, k_cache, v_cache, slots, scales[2], scales[3], layout)
    assert scales[0].item() == scales[2].item() == 0.125
    assert scales[1].item() == scales[3].item() == 0.125
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


@needs_fp8
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_store_keeps_a_set_scale_and_sets_an_unset_one(layout):
    """K starts calibrated (0.0625: x / scale = 2 * e4m3, exact or saturated at 448), V does
    not: K's scale must stay, V's becomes amax / 448, and a second store leaves both; bytes
    equal the reference's after each store, and no scale is ever left negative."""
    k, v, k_cache, v_cache, slots = make_inputs(SHAPES[1], layout, torch.float32, FP8)
    for x in (k, v):
        x.copy_(e4m3_values(x.numel()).view(x.shape) * 0.125)
        x[(slots >= 0).nonzero()[0, 0], 0, 0] = 448.0 * 0.125
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    scales = [torch.tensor([s], device=DEVICE) for s in (0.0625, 0.0, 0.0625, 0.0)]
    for step in range(2):
        ref.store_kv_fp8(k * 4**step, v, k_ref, v_ref, slots, scales[0], scales[1], layout)
        tri.store_kv_fp8(k * 4**step, v, k_cache, v_cache, slots, *scales[2:], layout)
        assert scales[2].item() == scales[0].item() == 0.0625
        assert scales[3].item() == scales[1].item() == 56 / 448  # amax 448 * 0.125
        assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
        assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


@needs_fp8
def test_fp8_scale_waits_for_non_zero_rows_and_survives_a_refused_store():
    k, v, k_cache, v_cache, slots = make_inputs(SHAPES[0], "NHD", torch.float32, FP8)
    k_scale, v_scale = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    with pytest.raises(ValueError, match="does not hold"):
        tri.store_kv_fp8(k, v, k_cache, v_cache, slots, k_scale, v_scale, "HND")
    assert k_scale.item() == 0.0 and v_scale.item() == 0.0
    tri.store_kv_fp8(k * 0, v * 0, k_cache, v_cache, slots, k_scale, v_scale)
    assert k_scale.item() == 0.0 and v_scale.item() == 0.0  # zeros do not calibrate
    written = k_cache.view(-1, *k.shape[1:])[slots[slots >= 0]].float()
    assert (written == 0).all()
    tri.store_kv_fp8(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    keep = slots >= 0  # float32 amax / 448, as the reference divides
    assert torch.equal(k_scale, (k[keep].abs().max() / 448).reshape(1))
    assert torch.equal(v_scale, (v[keep].abs().max() / 448).reshape(1))


def test_fp8_reference_scale_is_calibrated_once_and_saturates():
    k, v, k_cache, v_cache, slots = make_inputs(SHAPES[0], "NHD", torch.float32, FP8)
    keep = slots >= 0
    k[~keep] = 1e3  # skipped rows never count towards amax
    k_scale, v_scale = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    ref.store_kv_fp8(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert k_scale.item() == pytest.approx(k[keep].abs().max().item() / 448.0, rel=1e-6)
    assert v_scale.item() == pytest.approx(v[keep].abs().max().item() / 448.0, rel=1e-6)
    flat = k_cache.view(-1, *k.shape[1:])[slots[keep]]
    back, x = ref.dequantize_fp8(flat, k_scale), k[keep]
    # round to nearest: half an ulp of 3 mantissa bits, or of the subnormal step 2^-9
    assert ((back - x).abs() <= x.abs() * 2**-4 + k_scale * 2**-10).all()
    first = k_scale.clone()
    ref.store_kv_fp8(k * 10, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_scale, first)  # fixed after the first write
    flat = k_cache.view(-1, *k.shape[1:])[slots[keep]].float()
    assert flat.abs().max().item() == 448.0 and not flat.isnan().any()


@needs_fp8
def test_fp8_scale_stays_uncalibrated_without_rows():
    k, v, k_cache, v_cache, slots = make_inputs(SHAPES[0], "NHD", torch.float32, FP8)
    slots.fill_(-1)
    before = k_cache.clone()
    k_scale, v_scale = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    tri.store_kv_fp8(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert k_scale.item() == 0.0 and v_scale.item() == 0.0
    assert torch.equal(k_cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@needs_fp8
def test_store_kv_fp8_matches_reference_on_gpu(dtype, layout):
    k, v, k_cache, v_cache, slots = make_inputs(GPU_SHAPES[0], layout, dtype, FP8)
    scales = [torch.zeros(1, device=DEVICE) for _ in range(4)]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    for step in range(2):  # calibrate, then a second write with the fixed scale
        ref.store_kv_fp8(k * (1 + step), v, k_ref, v_ref, slots, scales[0], scales[1], layout)
        tri.store_kv_fp8(k * (1 + step), v, k_cache, v_cache, slots, *scales[2:], layout)
        torch.testing.assert_close(scales[2], scales[0], rtol=1e-6, atol=0)
    for out, want, scale in ((k_cache, k_ref, scales[0]), (v_cache, v_ref, scales[1])):
        a, b = ref.dequantize_fp8(out, scale), ref.dequantize_fp8(want, scale)
        # the quotient x / scale may round differently by one fp8 ulp, rarely
        assert ((a - b).abs() <= b.abs() * 2**-3 + scale * 2**-9).all()
        assert (a == b).float().mean() > 0.99


@needs_fp8
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_calibrated_store_equals_the_plain_store_when_scales_are_set(layout):
    k, v, k_cache, v_cache, slots = make_inputs(SHAPES[1], layout, torch.float32, FP8)
    for x in (k, v):
        x.copy_(e4m3_values(x.numel()).view(x.shape) * 0.125)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(4)]
    scales = [[torch.tensor([s], device=DEVICE) for s in (0.125, 0.0625)] for _ in range(4)]
    for store, (kc, vc), (ks, vs), calibrated in zip(
        (tri.store_kv_fp8, tri.store_kv_fp8, ref.store_kv_fp8, ref.store_kv_fp8),
        caches, scales, (False, True, False, True),
    ):  # fmt: skip
        store(k, v, kc, vc, slots, ks, vs, layout, calibrated=calibrated)
    assert all([ks.item(), vs.item()] == [0.125, 0.0625] for ks, vs in scales)
    for kc, vc in caches[1:]:
        assert torch.equal(kc.view(torch.uint8), caches[0][0].view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), caches[0][1].view(torch.uint8))
    assert not torch.equal(caches[0][0].view(torch.uint8), k_cache.view(torch.uint8))


@needs_fp8
def test_calibrated_flag_skips_the_amax_pass():
    """A caller that breaks the promise shows the skip: unset scales stay 0 (a plain call
    would set them) and the rows are written unscaled, clamped to +-448, in both stores."""
    k, v, k_cache, v_cache, slots = make_inputs(SHAPES[0], "NHD", torch.float32, FP8)
    for x in (k, v):
        x.copy_(e4m3_values(x.numel()).view(x.shape))
    k[0, 0, 0] = 1000.0  # saturates
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    scales = [torch.zeros(1, device=DEVICE) for _ in range(4)]
    tri.store_kv_fp8(k, v, k_cache, v_cache, slots, *scales[:2], calibrated=True)
    ref.store_kv_fp8(k, v, k_ref, v_ref, slots, *scales[2:], calibrated=True)
    assert all(scale.item() == 0.0 for scale in scales)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    keep = slots >= 0
    written = k_cache.view(-1, *k.shape[1:])[slots[keep]].float()
    assert torch.equal(written, k[keep].clamp(-448, 448))
    tri.store_kv_fp8(k, v, k_cache, v_cache, slots, *scales[:2])
    assert scales[0].item() > 0 and scales[1].item() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@needs_fp8
def test_fp8_tilings_and_calibrated_flag_write_the_same_bytes_on_gpu(layout):
    """Random bf16 rows: after a calibrating store, every tiling and ``calibrated=True`` write
    byte for byte what the plain call writes."""
    k, v, k_cache, v_cache, slots = make_inputs(GPU_SHAPES[0], layout, torch.bfloat16, FP8)
    k_scale, v_scale = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    tri.store_kv_fp8(k, v, k_cache.clone(), v_cache.clone(), slots, k_scale, v_scale, layout)
    assert k_scale.item() > 0 and v_scale.item() > 0
    want = k_cache.clone(), v_cache.clone()
    tri.store_kv_fp8(k * 2, v, *want, slots, k_scale, v_scale, layout)
    got = k_cache.clone(), v_cache.clone()
    tri.store_kv_fp8(k * 2, v, *got, slots, k_scale, v_scale, layout, calibrated=True)
    outs = [got]
    for tiling in [(1, 4), (4, 4), (8, 8), (16, 8)]:
        outs.append((k_cache.clone(), v_cache.clone()))
        launch(k * 2, v, *outs[-1], slots, layout, tiling, (k_scale, v_scale))
    for out in outs:
        assert torch.equal(out[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(out[1].view(torch.uint8), want[1].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_triton_fp8_store_refuses_old_gpu(monkeypatch):
    k, v, k_cache, v_cache, slots = make_inputs(SHAPES[0], "NHD", torch.bfloat16, FP8)
    before = k_cache.clone()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    scale = torch.zeros(1, device=DEVICE)
    with pytest.raises(RuntimeError, match="compute capability"):
        tri.store_kv_fp8(k, v, k_cache, v_cache, slots, scale, scale.clone())
    assert torch.equal(k_cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize(
    ("capability", "fails"), [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)]
)
def test_fp8_kv_check_by_compute_capability(monkeypatch, capability, fails):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    ref.check_kv_cache_dtype(torch.bfloat16, "cuda")  # never an issue
    if fails:
        with pytest.raises(RuntimeError, match=r"compute capability >= 8\.9.*Test GPU.*8\."):
            ref.check_kv_cache_dtype(FP8, "cuda:0")
    else:
        ref.check_kv_cache_dtype(FP8, "cuda:0")


def test_kv_check_refuses_other_fp8_and_int_dtypes():
    ref.check_kv_cache_dtype(FP8, "cpu")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ref.check_kv_cache_dtype(torch.float8_e5m2, "cpu")
    with pytest.raises(ValueError, match="float dtype"):
        ref.check_kv_cache_dtype(torch.int8, "cpu")
