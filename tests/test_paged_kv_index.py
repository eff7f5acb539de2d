"""FlashInfer's paged-KV index (CSR on the host), built from a step's block tables."""

import torch

from splitserve.workers.attention.flashinfer_backend import (
    PagedKVIndex,
    attends_own_kv,
    tensor_core_decode,
)
from splitserve.workers.attention.torch_backend import TorchAttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch


def test_index_of_a_mixed_step_lists_only_the_pages_in_use():
    cache = KVCache(KVLayout(1, 1, 4, 16, torch.float32), 16, "cpu")
    steps = [
        StepRequest([7] * 10, 17, [3, 4, 9], sample=True),  # 27 tokens: 2 pages, 11 in the last
        StepRequest([5], 32, [5, 6, 8], sample=True),  # 33 tokens: 3 pages, 1 in the last
        StepRequest([1] * 16, 0, [2, 10], sample=False),  # 16 tokens: 1 page (block 10 unused)
    ]
    fb = build_forward_batch(steps, cache, TorchAttentionBackend(), "cpu", plan=False)
    index = PagedKVIndex.of(fb)
    assert index.kv_indptr.tolist() == [0, 2, 5, 6]
    assert index.kv_indices.tolist() == [3, 4, 5, 6, 8, 2]
    assert index.kv_last_page_len.tolist() == [11, 1, 16]
    assert index.qo_indptr.tolist() == [0, 10, 11, 27]
    for t in (index.kv_indptr, index.kv_indices, index.kv_last_page_len, index.qo_indptr):
        assert t.dtype == torch.int32 and t.device.type == "cpu"


def test_packed_inputs_match_the_block_tables():
    cache = KVCache(KVLayout(1, 1, 4, 4, torch.float32), 16, "cpu")
    steps = [StepRequest([7, 8, 9], 2, [6, 3], sample=True), StepRequest([4], 0, [5], True)]
    fb = build_forward_batch(steps, cache, TorchAttentionBackend(), "cpu", plan=False)
    assert fb.input_ids.tolist() == [7, 8, 9, 4]
    assert fb.positions.tolist() == [2, 3, 4, 0]
    assert fb.slot_mapping.tolist() == [6 * 4 + 2, 6 * 4 + 3, 3 * 4 + 0, 5 * 4 + 0]
    assert fb.block_tables.tolist() == [[6, 3], [5, 0]]
    assert fb.query_start_loc.tolist() == [0, 3, 4]
    assert fb.seq_lens_tensor.tolist() == [5, 1]
    assert fb.logits_indices.tolist() == [2, 3]


def test_sampled_rows_are_a_view_when_consecutive():
    cache = KVCache(KVLayout(1, 1, 4, 4, torch.float32), 16, "cpu")
    decode = [StepRequest([t], 5, [1, 2], sample=True) for t in (3, 4, 5)]
    prefills = [StepRequest([1, 2, 3], 0, [1], sample=True), StepRequest([4, 5, 6], 0, [2], True)]
    for steps, rows, view in ((decode, [0, 1, 2], True), (prefills, [2, 5], False)):
        fb = build_forward_batch(steps, cache, TorchAttentionBackend(), "cpu", plan=False)
        hidden = torch.randn(fb.num_tokens, 8)
        sampled = fb.sampled_hidden(hidden)
        assert fb.logits_indices.tolist() == rows
        assert torch.equal(sampled, hidden[rows])
        assert (sampled.data_ptr() == hidden[rows[0]].data_ptr()) == view  # no gather


def _batch(steps, dtype=torch.bfloat16):
    cache = KVCache(KVLayout(1, 1, 4, 16, dtype), 16, "cpu")
    return build_forward_batch(steps, cache, TorchAttentionBackend(), "cpu", plan=False)


def test_only_prefills_without_cached_kv_attend_their_own_kv():
    fresh = [StepRequest([1] * 20, 0, [1, 2], True), StepRequest([2] * 3, 0, [3], True)]
    assert attends_own_kv(_batch(fresh), torch.bfloat16)
    assert not attends_own_kv(_batch(fresh, torch.float16), torch.bfloat16)  # cache dtype
    chunk = [StepRequest([1] * 4, 16, [4, 5], True)]  # a chunk after a cached prefix
    assert not attends_own_kv(_batch(fresh + chunk), torch.bfloat16)
    decode = [StepRequest([1], 16, [6, 7], True)]
    assert not attends_own_kv(_batch(fresh + decode), torch.bfloat16)  # mixed
    assert not attends_own_kv(_batch(decode), torch.bfloat16)


def test_tensor_core_decode_from_four_query_heads_per_kv_head():
    assert tensor_core_decode(32, 8) and tensor_core_decode(64, 8)
    assert not tensor_core_decode(16, 8) and not tensor_core_decode(8, 8)


def test_torch_graph_index_comes_from_the_padded_host_lists():
    """A replay's gather index equals an eager plan's for the real rows, and a padded
    row attends one key of the null page, whatever the batch's device tables hold."""
    import dataclasses

    cache = KVCache(KVLayout(1, 1, 4, 4, torch.float32), 16, "cpu")
    backend = TorchAttentionBackend()
    steps = [StepRequest([1], 5, [3, 7], True), StepRequest([2], 2, [9], True)]
    fb = build_forward_batch(steps, cache, backend, "cpu")
    eager = fb.attn_metadata
    backend.init_graph_buffers(3, 4)
    padded = dataclasses.replace(
        fb,
        seq_lens=fb.seq_lens + [1],
        block_ids=fb.block_ids + [[0]],
        block_tables=torch.full((3, 4), 5),  # stale device tables: must not be read
        seq_lens_tensor=torch.full((3,), 9),
    )
    backend.prepare_capture(3, padded)
    replay = padded.attn_metadata
    for row, seq_len in enumerate(fb.seq_lens):
        assert replay.key_mask[row].sum() == seq_len
        keys = replay.gather_index[row][replay.key_mask[row]]
        assert torch.equal(keys, eager.gather_index[row][eager.key_mask[row]])
    assert replay.key_mask[2].tolist() == [True] + [False] * 15
    assert replay.gather_index[2, 0] == 0  # the null page's first slot
