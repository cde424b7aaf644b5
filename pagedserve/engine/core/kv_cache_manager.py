"""Per-request block tables on top of the block pool: prefix lookup, allocation, freeing."""

from __future__ import annotations

from pagedserve.engine.core.block_pool import BlockPool, KVCacheBlock, extend_block_hashes
from pagedserve.engine.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are registered in the prefix cache.
        self.num_registered_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens, since start (exported as metrics): counted once per
        # admission (a request resumed after preemption is admitted, and counted, again).
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of the request's leading full blocks found in the prefix cache, and
        the tokens they cover. At least one token is always left to compute: its logits are
        what the request samples from."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_registered_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        # No stats here: the scheduler looks a waiting request up again every step it cannot be
        # admitted, which would count it many times. allocate_slots counts it once, on admission.
        return blocks, len(blocks) * self.block_size

    def num_free_blocks_beside(self, computed_blocks: list[KVCacheBlock]) -> int:
        """Free blocks left once the request adopts its prefix-cache hits: hits with no other
        user sit in the free queue, and adopting them takes them out of it."""
        return self.pool.num_free_blocks - sum(1 for block in computed_blocks if block.ref_cnt == 0)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones, or None (and no change)
        if the pool cannot supply them. `computed_blocks` are prefix-cache hits to adopt first."""
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        is_admission = not req_blocks  # a scheduled request always holds at least one block
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = max(num_required - len(req_blocks) - len(computed_blocks), 0)
        if num_new_blocks > self.num_free_blocks_beside(computed_blocks):
            return None
        self.pool.touch(computed_blocks)
        self.req_to_blocks[request.request_id] = req_blocks
        req_blocks.extend(computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            if is_admission:
                self.num_prefix_queries += request.num_tokens
                self.num_prefix_hits += len(computed_blocks) * self.block_size
            self._register_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so the tail is evicted before the prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_registered_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.num_registered_blocks = {req_id: 0 for req_id in self.num_registered_blocks}

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that `num_tokens` fill. Their K/V is written this step, before any
        other request can read it (see Attention.forward)."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_registered_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.register_block(blocks[i], request.block_hashes[i])
        self.num_registered_blocks[request.request_id] = num_full

    def _update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained hashes over every full block of its known tokens."""
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt, request.lora_int_id)
