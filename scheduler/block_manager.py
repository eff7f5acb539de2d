"""Paged KV block allocator with prefix caching (nano-vllm / vLLM v1 style).

Every block has a ref count. Blocks with ref count 0 sit in one free queue,
ordered for LRU eviction; some of them still hold a cached prefix and can be
revived by a cache hit until allocation takes them from the front of the queue.

Prefix caching: a FULL block is named by a chain hash,
``hash_i = hash_block(hash_{i-1}, tokens of block i)``, so equal hashes mean
equal prefixes. A lookup walks a request's full blocks while the hash hits and
the stored token ids compare equal (a hash collision is never a hit). A hit
never covers the last token, which must be computed to give logits; so a
request never writes into a shared block.

Block 0 is the null page (``NULL_BLOCK``): it is never handed out and never
enters the free queue.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from splitserve.scheduler.request import Request

NULL_BLOCK = 0  # the null page: never allocated, stays zero; padding points at it
ROOT_HASH = 0  # parent hash of a request's first block (hash(None) varies between processes)


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set only while the block is in the hash map
    token_ids: tuple[int, ...] = ()  # the tokens it holds while cached, for collision checks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(
                f"invalid num_blocks={num_blocks}: must be >= 2 (block 0 is the null page)"
            )
        if block_size < 1:
            raise ValueError(f"invalid block_size={block_size}: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count 0 blocks; the front is evicted first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(num_blocks) if i != NULL_BLOCK
        )
        self.hash_to_block_id: dict[int, int] = {}
        # request_id -> (number of its blocks already hashed, hash of the last one)
        self._hashed: dict[str, tuple[int, int]] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, including cached ones that may be evicted."""
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks of the request's prefix and how many tokens they hold."""
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size  # the last token is always computed
        block_ids: list[int] = []
        parent = ROOT_HASH
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            parent = hash_block(parent, chunk)
            block_id = self.hash_to_block_id.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the hashes of the request's blocks that are full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_ids))
        num_hashed, parent = self._hashed.get(request.request_id, (0, ROOT_HASH))
        if num_full <= num_hashed:
            return
        tokens = request.all_token_ids
        for i in range(num_hashed, num_full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            parent = hash_block(parent, chunk)
            block = self.blocks[request.block_ids[i]]
            # A block that came from a hit is registered already; if another block holds
            # this hash (computed twice, or a collision), keep that one and leave ours plain.
            if block.block_hash is None and parent not in self.hash_to_block_id:
                block.block_hash, block.token_ids = parent, chunk
                self.hash_to_block_id[parent] = block.block_id
        self._hashed[request.request_id] = (num_full, parent)

    # ---- allocation ---------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make ``request.block_ids`` cover its computed, cached and new tokens.

        ``computed_blocks`` (from ``get_computed_blocks``) are taken first, for a
        request that holds no blocks yet. Returns False, changing nothing, when
        too few blocks are free.
        """
        computed_blocks = computed_blocks or []
        if computed_blocks and (request.block_ids or request.num_computed_tokens):
            raise ValueError(
                f"request {request.request_id!r} already holds {len(request.block_ids)} blocks "
                f"and {request.num_computed_tokens} computed tokens; cached blocks are only "
                "taken by a request that starts from nothing"
            )
        num_tokens = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_new_blocks = (
            self.num_blocks_for(num_tokens) - len(request.block_ids) - len(computed_blocks)
        )
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - num_revived:
            return False
        for block_id in computed_blocks:
            self._take(self.blocks[block_id])
            request.block_ids.append(block_id)
        if computed_blocks:
            last = self.blocks[computed_blocks[-1]]
            self._hashed[request.request_id] = (len(computed_blocks), last.block_hash)
        for _ in range(num_new_blocks):
            request.block_ids.append(self._allocate_fresh())
        return True

    def free(self, request: Request) -> None:
        """Drop the request's refs; its tail blocks become the first to be evicted."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.block_hash is None:  # holds nothing reusable: evict it first
                    self.free_block_ids.move_to_end(block_id, last=False)
        request.block_ids.clear()
        self._hashed.pop(request.request_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (its KV is stale after a weight update).

        Blocks that running requests hold stay theirs, unhashed. Returns the
        number of cached blocks forgotten.
        """
        forgotten = len(self.hash_to_block_id)
        for block_id in self.hash_to_block_id.values():
            block = self.blocks[block_id]
            block.block_hash, block.token_ids = None, ()
        self.hash_to_block_id.clear()
        self._hashed.clear()
        return forgotten

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free_block_ids[block.block_id]
        block.ref_count += 1

    def _allocate_fresh(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached prefix
            del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
