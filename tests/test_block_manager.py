"""Block manager: null page, allocation, prefix caching, LRU eviction, collisions."""

from __future__ import annotations

import pytest

from splitserve.sampling_params import SamplingParams
from splitserve.scheduler import block_manager as bm_module
from splitserve.scheduler.block_manager import NULL_BLOCK, BlockManager
from splitserve.scheduler.request import Request

BS = 4


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=8))


def prefill(bm: BlockManager, req: Request) -> None:
    """Admit with a prefix-cache lookup and compute the whole prompt in one step."""
    computed, num_hit = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - num_hit, computed)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req, req.num_computed_tokens)


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_constructor_errors_name_the_value():
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockManager(1, BS)
    with pytest.raises(ValueError, match="block_size=0"):
        BlockManager(8, 0)


def test_null_page_is_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=BS)
    assert bm.num_free_blocks == 4
    req = make_request("a", list(range(16)))
    assert bm.allocate_slots(req, 16)
    assert sorted(req.block_ids) == [1, 2, 3, 4]
    assert bm.num_free_blocks == 0
    assert bm.usage == 1.0
    assert not bm.allocate_slots(make_request("b", [1]), 1)
    bm.free(req)
    assert bm.num_free_blocks == 4
    assert NULL_BLOCK not in bm.free_block_ids
    assert bm.blocks[NULL_BLOCK].ref_count == 0


def test_allocate_grows_by_blocks_and_fails_without_change():
    bm = BlockManager(num_blocks=4, block_size=BS)
    req = make_request("a", list(range(5)))
    assert bm.allocate_slots(req, 5)
    assert len(req.block_ids) == 2
    req.num_computed_tokens = 5
    assert bm.allocate_slots(req, 3)  # 8 tokens still fit in 2 blocks
    assert len(req.block_ids) == 2
    before = (list(req.block_ids), bm.num_free_blocks, ref_counts(bm))
    assert not bm.allocate_slots(req, 8)  # 13 tokens need 4 blocks, only 3 usable
    assert (list(req.block_ids), bm.num_free_blocks, ref_counts(bm)) == before


def test_prefix_hit_is_capped_so_the_last_token_is_computed():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(12)))  # exactly 3 full blocks
    prefill(bm, a)
    assert a.num_computed_tokens == 12
    assert len(bm.hash_to_block_id) == 3

    same = make_request("same", list(range(12)))
    computed, num_hit = bm.get_computed_blocks(same)
    assert computed == a.block_ids[:2] and num_hit == 8  # cap: (12 - 1) // 4 = 2 blocks

    longer = make_request("longer", list(range(12)) + [99])
    computed, num_hit = bm.get_computed_blocks(longer)
    assert computed == a.block_ids and num_hit == 12

    free_before = bm.num_free_blocks
    assert bm.allocate_slots(longer, 1, computed)
    assert longer.block_ids[:3] == a.block_ids
    assert longer.block_ids[3] not in a.block_ids  # the new token goes into a fresh block
    assert [bm.blocks[b].ref_count for b in a.block_ids] == [2, 2, 2]
    assert bm.num_free_blocks == free_before - 1


def test_divergent_prompts_share_only_the_common_prefix():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    computed, num_hit = bm.get_computed_blocks(b)
    assert computed == a.block_ids[:1] and num_hit == 4


def test_freed_cached_blocks_are_free_and_revivable():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(13)))
    prefill(bm, a)
    b = make_request("b", list(range(13)))
    prefill(bm, b)
    assert b.block_ids[:3] == a.block_ids[:3]
    shared = a.block_ids[:3]
    assert [bm.blocks[x].ref_count for x in shared] == [2, 2, 2]
    assert bm.num_free_blocks == 7 - 5

    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 7
    assert set(ref_counts(bm)) == {0}
    assert len(bm.hash_to_block_id) == 3  # still cached while unreferenced

    # A hit on blocks in the free queue takes them back out, not counted twice.
    c = make_request("c", list(range(13)))
    computed, num_hit = bm.get_computed_blocks(c)
    assert computed == shared and num_hit == 12
    assert bm.allocate_slots(c, 1, computed)
    assert bm.num_free_blocks == 7 - 4
    assert all(x not in bm.free_block_ids for x in c.block_ids)


def test_allocation_counts_revived_blocks_once():
    bm = BlockManager(num_blocks=5, block_size=BS)  # 4 usable
    a = make_request("a", list(range(12)))
    prefill(bm, a)
    bm.free(a)
    b = make_request("b", list(range(12)) + [50, 51, 52, 53, 54])
    computed, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 12
    # 3 cached blocks + 2 new ones = 5 > 4 usable: must fail, and change nothing.
    before = (bm.num_free_blocks, dict(bm.hash_to_block_id), list(bm.free_block_ids))
    assert not bm.allocate_slots(b, 5, computed)
    assert b.block_ids == []
    assert (bm.num_free_blocks, dict(bm.hash_to_block_id), list(bm.free_block_ids)) == before
    assert bm.allocate_slots(b, 4, computed)  # 3 cached + 1 new fits exactly
    assert bm.num_free_blocks == 0


def test_lru_evicts_least_recently_freed_and_tail_first():
    bm = BlockManager(num_blocks=7, block_size=BS)  # 6 usable
    old = make_request("old", [1] * 8)
    new = make_request("new", [2] * 8)
    prefill(bm, old)
    prefill(bm, new)
    assert (old.block_ids, new.block_ids) == ([1, 2], [3, 4])
    bm.free(old)  # freed first: least recently used
    bm.free(new)
    assert len(bm.hash_to_block_id) == 4
    # Never-used blocks first, then old's tail, old's head, new's tail, new's head.
    assert list(bm.free_block_ids) == [5, 6, 2, 1, 4, 3]

    taker = make_request("taker", [3] * 12)
    assert bm.allocate_slots(taker, 12)
    assert taker.block_ids == [5, 6, 2]  # old's tail evicted, its head survives
    assert len(bm.hash_to_block_id) == 3
    assert bm.get_computed_blocks(make_request("o", [1] * 9)) == ([1], 4)
    assert bm.get_computed_blocks(make_request("n", [2] * 9)) == ([3, 4], 8)


def test_unhashed_blocks_are_evicted_before_cached_ones():
    bm = BlockManager(num_blocks=5, block_size=BS)  # 4 usable
    a = make_request("a", list(range(6)))  # one full (cached) block, one partial
    prefill(bm, a)
    cached, partial = a.block_ids
    bm.free(a)
    assert list(bm.free_block_ids)[0] == partial
    assert list(bm.free_block_ids)[-1] == cached


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, a)
    assert bm.hash_to_block_id == {42: a.block_ids[0]}  # second block collides: not cached

    other = make_request("other", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(other) == ([], 0)
    # A true prefix still hits its first block, then stops at the colliding second one.
    same = make_request("same", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(same) == ([a.block_ids[0]], 4)


def test_cache_full_blocks_is_idempotent_and_covers_outputs():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    prefill(bm, a)
    assert len(bm.hash_to_block_id) == 1
    bm.cache_full_blocks(a, a.num_computed_tokens)
    assert len(bm.hash_to_block_id) == 1
    for token in (7, 8, 9):  # decode: the generated tokens fill block 2
        a.output_token_ids.append(token)
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        bm.cache_full_blocks(a, a.num_computed_tokens)
    assert len(bm.hash_to_block_id) == 2
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 100])
    assert bm.get_computed_blocks(b) == (a.block_ids[:2], 8)


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    prefill(bm, a)
    assert bm.hash_to_block_id == {}
    assert bm.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_reset_prefix_cache_forgets_hits_and_keeps_held_blocks():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(13)))
    prefill(bm, a)
    b = make_request("b", list(range(9)))
    prefill(bm, b)
    bm.free(b)  # b's cached blocks sit in the free queue
    held = list(a.block_ids)
    free_before = bm.num_free_blocks
    assert bm.reset_prefix_cache() == 3  # a's 3 full blocks; b's 2 share them
    assert bm.hash_to_block_id == {}
    assert a.block_ids == held and [bm.blocks[x].ref_count for x in held] == [1] * 4
    assert bm.num_free_blocks == free_before
    c = make_request("c", list(range(13)))
    assert bm.get_computed_blocks(c) == ([], 0)
    prefill(bm, c)  # caching starts over
    assert len(bm.hash_to_block_id) == 3
