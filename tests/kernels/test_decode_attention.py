import pytest
import torch

from splitserve.kernels import tuning
from splitserve.kernels.decode_attention import decode_attention as reference
from splitserve.kernels.kv_store import FP8_DTYPE
from splitserve.kernels.triton.decode_attention import decode_attention, num_splits
from splitserve.kernels.triton.qk_norm_rope import qk_norm_rope
from splitserve.kernels.tuning import DecodeTiles
from tests.kernels.utils import DEVICE, DTYPES, ON_GPU, assert_close, count_launches, randn

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, splits)
CASES = [
    ([5], 4, 2, 16, 4, 1),  # qwen3-tiny
    ([1, 17, 33], 4, 2, 16, 4, 4),  # runs shorter than a tile, splits with no tokens
    ([40, 9], 8, 2, 32, 8, 2),
    ([70], 6, 6, 64, 16, 8),  # no grouping
    ([12, 3], 4, 1, 80, 4, 2),  # head_dim not a power of two
    ([150, 20], 4, 2, 16, 4, 1),  # a run of several tiles: the online softmax rescales
]
GPU_CASES = [
    ([1024], 32, 8, 128, 16, None),  # Qwen3-8B, batch 1, 1k context
    ([1024] * 8, 32, 8, 128, 16, None),
    ([1, 4000, 333, 2048], 32, 8, 128, 16, None),
    ([513, 77], 16, 2, 256, 32, None),
]
ALL_CASES = CASES + [pytest.param(c, marks=pytest.mark.gpu) for c in GPU_CASES]


def paged_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Random q and caches; each request's blocks drawn at random from a cache twice the need."""
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 * sum(pages) + 1
    k_cache, v_cache = (
        randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in "kv"
    )
    order = torch.randperm(num_blocks - 1)[: sum(pages)] + 1  # block 0: the null page
    width = max(pages)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    start = 0
    for row, n in zip(tables, pages):
        row[:n] = order[start : start + n]
        start += n
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE), seq_lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ALL_CASES)
def test_matches_reference(case, dtype):
    *shape, splits = case
    q, k_cache, v_cache, tables, seq_lens = paged_inputs(*shape, dtype)
    scale = shape[3] ** -0.5
    out = decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, splits=splits)
    want = reference(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, scale)
    assert_close(out.float(), want, dtype)


def new_rows(tables, seq_lens, num_kv_heads, head_dim, block_size, dtype, skip=()):
    """Each request's new K/V row and the slot of its last token (-1 for rows in ``skip``)."""
    k, v = (randn(len(seq_lens), num_kv_heads, head_dim, dtype=dtype) for _ in "kv")
    last = seq_lens.long() - 1
    slots = tables.long()[torch.arange(len(last)), last // block_size] * block_size
    slots += last % block_size
    slots[list(skip)] = -1
    return k, v, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ALL_CASES)
def test_stores_the_new_rows_and_attends_them(case, dtype):
    """new_kv: the cache afterwards equals the reference's store; attention sees the new
    rows even where the cache held NaN before (its store may land after the read)."""
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, splits = case
    q, k_cache, v_cache, tables, lens = paged_inputs(*case[:-1], dtype)
    new = new_rows(tables, lens, num_kv_heads, head_dim, block_size, dtype)
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[new[2]] = float("nan")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    scale = head_dim**-0.5
    out = decode_attention(q, k_cache, v_cache, tables, lens, scale, splits=splits, new_kv=new)
    want = reference(q.float(), ref_k, ref_v, tables, lens, scale, new_kv=new)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert_close(out.float(), want.float(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", ["full", "partial"])
@pytest.mark.parametrize("case", ALL_CASES)
def test_norm_rope_on_load_matches_the_separate_kernel(case, rotary, dtype):
    """q and the new K row as strided views of a fused qkv row, normed and rotated inside
    the split kernel: the output and the stored rows match ``qk_norm_rope`` followed by
    the kernel (the same rounding steps; a norm's sum may add up in another order), and
    the reference."""
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, splits = case
    _, k_cache, v_cache, tables, lens = paged_inputs(*case[:-1], dtype)
    _, v, slots = new_rows(tables, lens, num_kv_heads, head_dim, block_size, dtype)
    qkv = randn(len(seq_lens), (num_heads + num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim :].view(-1, num_kv_heads, head_dim)
    rotary_dim = head_dim if rotary == "full" else head_dim // 4 * 2
    inv_freq = 1e4 ** -(torch.arange(0, rotary_dim, 2, device=DEVICE) / rotary_dim)
    angles = torch.arange(4096, device=DEVICE)[:, None] * inv_freq
    cos, sin = (f(torch.cat((angles, angles), -1)) for f in (torch.cos, torch.sin))
    weights = [1 + 0.5 * randn(head_dim, dtype=dtype) for _ in "qk"]
    norm_rope = (lens.long() - 1, *weights, 1e-6, cos, sin)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]
    scale = head_dim**-0.5
    fused = decode_attention(
        q, *caches[0], tables, lens, scale, splits, new_kv=(k, v, slots), norm_rope=norm_rope
    )
    q2, k2 = qk_norm_rope(norm_rope[0], q, k, *norm_rope[1:])
    apart = decode_attention(q2, *caches[1], tables, lens, scale, splits, new_kv=(k2, v, slots))
    assert_close(fused, apart, dtype)
    assert_close(caches[0][0], caches[1][0], dtype)
    assert torch.equal(caches[0][1], caches[1][1])  # V is stored as given
    f32 = [x.float() for x in (q, *caches[2])]
    want = reference(*f32, tables, lens, scale, new_kv=(k, v, slots), norm_rope=norm_rope)
    assert_close(fused.float(), want, dtype)


def test_norm_rope_needs_the_new_rows_and_matching_weights():
    q, k_cache, v_cache, tables, lens = paged_inputs([9], 4, 2, 16, 4, torch.float32)
    k, v, slots = new_rows(tables, lens, 2, 16, 4, torch.float32)
    cos = sin = torch.ones(64, 16, device=DEVICE)
    ok = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="needs new_kv"):
        decode_attention(
            q, k_cache, v_cache, tables, lens, 0.25, norm_rope=(lens, ok, ok, 1e-6, cos, sin)
        )
    with pytest.raises(ValueError, match="head_dim 16"):
        decode_attention(
            q, k_cache, v_cache, tables, lens, 0.25, new_kv=(k, v, slots),
            norm_rope=(lens, ok[:8], ok, 1e-6, cos, sin),
        )  # fmt: skip
    with pytest.raises(ValueError, match="in q's dtype"):
        decode_attention(
            q, k_cache, v_cache, tables, lens, 0.25, new_kv=(k, v, slots),
            norm_rope=(lens, ok.half(), ok, 1e-6, cos, sin),
        )  # fmt: skip


def test_new_rows_may_be_strided_views():
    """K as a slice of a fused qkv row (rows strided), V with a non-contiguous head_dim."""
    q, k_cache, v_cache, tables, lens = paged_inputs([9, 14], 4, 2, 16, 4, torch.float32)
    k, v, slots = new_rows(tables, lens, 2, 16, 4, torch.float32)
    fused = randn(2, 3, 2, 16)
    fused[:, 1] = k
    strided_k = fused[:, 1]
    transposed_v = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert strided_k.stride(0) != 2 * 16 and transposed_v.stride(-1) != 1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = decode_attention(
        q, k_cache, v_cache, tables, lens, 0.25, splits=2, new_kv=(strided_k, transposed_v, slots)
    )
    want = reference(q, ref_k, ref_v, tables, lens, 0.25, new_kv=(k, v, slots))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert_close(out, want, torch.float32)


def test_a_new_row_with_slot_minus_one_is_not_stored():
    q, k_cache, v_cache, tables, lens = paged_inputs([9, 14], 4, 2, 16, 4, torch.float32)
    new = new_rows(tables, lens, 2, 16, 4, torch.float32, skip=[0])
    before = k_cache.clone()
    decode_attention(q, k_cache, v_cache, tables, lens, 0.25, splits=2, new_kv=new)
    changed = (k_cache != before).flatten(2).any(-1).nonzero().tolist()
    row = tables[1, 13 // 4].item()
    assert changed == [[row, 13 % 4]]  # request 1's last token only


def test_one_split_writes_the_output_without_a_merge(monkeypatch):
    """With one split a request the split kernel writes the output: no merge launch."""
    import splitserve.kernels.triton.decode_attention as module

    q, k_cache, v_cache, tables, seq_lens = paged_inputs([37, 64], 4, 2, 16, 4, torch.float32)
    merges = count_launches(monkeypatch, module, "_merge_kernel")
    one = decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, splits=1)
    assert merges == []
    four = decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, splits=4)
    assert len(merges) == 1
    assert_close(one, four, torch.float32)
    assert_close(one, reference(q, k_cache, v_cache, tables, seq_lens, 0.25), torch.float32)


def test_split_count_does_not_change_the_result():
    q, k_cache, v_cache, tables, seq_lens = paged_inputs([37, 64], 4, 2, 16, 4, torch.float32)
    outs = [decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, splits=s) for s in (1, 4)]
    assert_close(outs[1], outs[0], torch.float32)


def test_int64_tables_give_the_int32_result():
    """An int64 table is read through its entries' low words: the same output, bitwise."""
    q, k_cache, v_cache, tables, seq_lens = paged_inputs([37, 64], 4, 2, 16, 4, torch.float32)
    narrow = decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, splits=2)
    wide = decode_attention(q, k_cache, v_cache, tables.long(), seq_lens.long(), 0.25, splits=2)
    assert torch.equal(wide, narrow)


@pytest.mark.parametrize(
    "tiles", [DecodeTiles(16, 1, 2), DecodeTiles(32, 2, 4), DecodeTiles(128, 3, 8)]
)
def test_each_tiling_matches_the_reference(tiles):
    q, k_cache, v_cache, tables, seq_lens = paged_inputs([150, 20], 4, 2, 16, 4, torch.float32)
    out = decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, splits=2, tiles=tiles)
    assert_close(out, reference(q, k_cache, v_cache, tables, seq_lens, 0.25), torch.float32)


@pytest.mark.parametrize("broken", ["split_kv_tiles", "split_kv_fp8_tiles"])
def test_tiles_come_from_the_tuning_table_by_cache_dtype(monkeypatch, broken):
    """Without ``tiles`` the kernel launches the table's entry for its cache's dtype: a
    tiling it cannot take (not a power of 2) fails that cache's call and only that one."""
    table = tuning.GpuTuning(**{broken: DecodeTiles(48, 3, 4)})
    monkeypatch.setattr(tuning, "for_device", lambda device: table)
    q, k_cache, v_cache, tables, seq_lens = paged_inputs([5], 4, 2, 16, 4, torch.float32)
    fp8 = tuple(c.clamp(-448, 448).to(FP8_DTYPE) for c in (k_cache, v_cache))
    scales = tuple(torch.ones(1, device=DEVICE) for _ in "kv")
    calls = {
        "split_kv_tiles": lambda: decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25),
        "split_kv_fp8_tiles": lambda: decode_attention(
            q, *fp8, tables, seq_lens, 0.25, kv_scales=scales
        ),
    }
    for entry, call in calls.items():
        if entry == broken:
            with pytest.raises(Exception, match="power of 2"):
                call()
        else:
            call()


def test_reads_only_the_tokens_within_each_length():
    """Poison every cache entry past each request's length: the output must not move."""
    q, k_cache, v_cache, tables, seq_lens = paged_inputs([6, 11], 4, 2, 16, 4, torch.float32)
    before = decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, splits=2)
    for row, n in zip(tables.tolist(), seq_lens.tolist()):
        last = row[(n - 1) // 4]
        for cache in (k_cache, v_cache):
            cache[last, (n - 1) % 4 + 1 :] = 1e4
    k_cache[0], v_cache[0] = 1e4, 1e4  # the null page and unused table entries point here
    after = decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, splits=2)
    assert torch.equal(after, before)


@pytest.mark.parametrize("splits", [1, 2])  # one split: no merge, the split kernel writes
def test_a_request_with_no_tokens_gets_zeros(splits):
    q, k_cache, v_cache, tables, _ = paged_inputs([8, 8], 4, 2, 16, 4, torch.float32)
    seq_lens = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, splits=splits, out=out)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    want = reference(q, k_cache, v_cache, tables, seq_lens, 0.25)
    assert_close(out[1], want[1], torch.float32)


def test_bad_shapes_are_refused():
    q, k_cache, v_cache, tables, seq_lens = paged_inputs([8], 6, 4, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="do not group"):
        decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25)
    q, k_cache, v_cache, tables, seq_lens = paged_inputs([8], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="block_tables"):
        decode_attention(q, k_cache, v_cache, tables[:0], seq_lens, 0.25)


def test_num_splits_fills_the_gpu_and_depends_on_the_batch_only():
    assert num_splits(1, 8, 132) == 32  # 8 programs a split: 264 programs for 132 SMs
    assert num_splits(8, 8, 132) == 8
    assert num_splits(64, 8, 132) == 1
    assert num_splits(1, 1, 132) == 32  # capped


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_graph_replays_for_other_lengths():
    """Captured once for a batch size, replayed after the lengths and tables change."""
    q, k_cache, v_cache, tables, seq_lens = paged_inputs([100, 900], 32, 8, 128, 16, torch.bfloat16)
    out = torch.empty_like(q)
    run = lambda: decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.088, out=out)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    seq_lens.copy_(torch.tensor([700, 5], dtype=torch.int32))
    tables.copy_(tables.flip(0))
    graph.replay()
    want = reference(q, k_cache, v_cache, tables, seq_lens, 0.088)
    assert_close(out.float(), want.float(), torch.bfloat16)
