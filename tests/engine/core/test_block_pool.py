"""BlockPool: chained prefix hashes, reference counts, and LRU reuse of freed blocks."""

from __future__ import annotations

import pytest

from pagedserve.engine.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens


def _chain(token_blocks: list[list[int]]) -> list[bytes]:
    """The chained hashes of consecutive full blocks, as the KV cache manager computes them."""
    hashes: list[bytes] = []
    for tokens in token_blocks:
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens))
    return hashes


def _free_ids(pool: BlockPool) -> list[int]:
    return pool.free_block_ids()


# ---- hash chaining -----------------------------------------------------------------------


def test_equal_prefixes_give_equal_hashes():
    first = _chain([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    second = _chain([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    assert first == second
    assert all(isinstance(h, bytes) and len(h) == 32 for h in first)  # sha256
    assert len(set(first)) == 3


def test_different_parent_gives_different_hash():
    tokens = [5, 6, 7, 8]
    parent_a, parent_b = hash_block_tokens(None, [1, 2, 3, 4]), hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(parent_a, tokens) != hash_block_tokens(parent_b, tokens)
    # A first block (no parent) differs from the same tokens with a parent.
    assert hash_block_tokens(None, tokens) != hash_block_tokens(parent_a, tokens)


def test_same_tokens_after_a_different_prefix_differ():
    shared_tail = [40, 41, 42, 43]
    a = _chain([[1, 2, 3, 4], [9, 9, 9, 9], shared_tail])
    b = _chain([[1, 2, 3, 4], [9, 9, 9, 8], shared_tail])
    assert a[0] == b[0]  # the common first block is shared
    assert a[1] != b[1]
    # The divergence propagates down the chain even though the last block's tokens are equal.
    assert a[2] != b[2]


def test_hash_depends_on_order_and_full_value_of_tokens():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    # Ids above 2**32 must not be truncated: these differ only in their high bits.
    assert hash_block_tokens(None, [1, 2**40]) != hash_block_tokens(None, [1, 2**41])


# ---- reference counts ----------------------------------------------------------------------


def test_allocate_takes_fresh_blocks_from_the_front():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.num_free_blocks == 2
    assert _free_ids(pool) == [2, 3]
    assert pool.usage == pytest.approx(0.5)


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks with 1 free"):
        pool.allocate(2)
    assert _free_ids(pool) == [2]
    assert pool.block(2).ref_cnt == 0


def test_touch_and_free_count_references():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])  # a second request adopts it
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert not pool.is_free(block.block_id)  # still in use: not reusable
    pool.free([block])
    assert block.ref_cnt == 0
    assert _free_ids(pool) == [1, 0]  # joins the back of the queue
    assert pool.num_free_blocks == 2


def test_double_free_asserts():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 2


def test_free_of_a_never_allocated_block_asserts():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.free([pool.block(0)])


# ---- LRU eviction --------------------------------------------------------------------------


def test_blocks_freed_earlier_are_evicted_first():
    pool = BlockPool(4)
    b = pool.allocate(4)
    for i in (2, 0, 3, 1):
        pool.free([b[i]])
    assert [blk.block_id for blk in pool.allocate(4)] == [2, 0, 3, 1]


def test_tail_blocks_freed_first_are_evicted_before_the_prefix():
    pool = BlockPool(5)
    req_blocks = pool.allocate(3)  # ids 0, 1, 2; ids 3, 4 stay free
    hashes = _chain([[1] * 4, [2] * 4, [3] * 4])
    for block, h in zip(req_blocks, hashes):
        pool.register_block(block, h)
    pool.free(reversed(req_blocks))  # as KVCacheManager.free does
    assert _free_ids(pool) == [3, 4, 2, 1, 0]
    # Three allocations take the never-used blocks, then the request's tail.
    assert [b.block_id for b in pool.allocate(3)] == [3, 4, 2]
    assert pool.get_registered_block(hashes[2]) is None
    # The prefix survives: a later request with the same start still finds it.
    assert pool.get_registered_block(hashes[0]) is req_blocks[0]
    assert pool.get_registered_block(hashes[1]) is req_blocks[1]


def test_freed_cached_block_can_be_found_and_revived():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [7, 7, 7, 7])
    pool.register_block(block, h)
    pool.free([block])
    assert pool.get_registered_block(h) is block  # ref 0 but its K/V is still valid
    assert block.block_hash == h
    pool.touch([block])
    assert block.ref_cnt == 1
    assert not pool.is_free(block.block_id)
    assert pool.num_free_blocks == 2
    # Being revived, it is never handed out by allocate: only the other two are.
    assert {b.block_id for b in pool.allocate(2)} == {1, 2}
    assert pool.get_registered_block(h) is block


def test_eviction_removes_the_hash():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [3, 1, 4, 1])
    pool.register_block(block, h)
    pool.free([block])
    # Block 1 was free before block 0 was freed, so block 0 is evicted second.
    assert [b.block_id for b in pool.allocate(2)] == [1, 0]
    assert pool.get_registered_block(h) is None
    assert block.block_hash is None
    assert pool.registered_blocks == {}


def test_revived_then_refreed_block_goes_to_the_back_again():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.free(blocks)  # queue 0, 1, 2
    pool.touch([blocks[0]])
    pool.free([blocks[0]])  # freed most recently now
    assert _free_ids(pool) == [1, 2, 0]


# ---- register_block and reset ------------------------------------------------------------------


def test_cache_block_registers_the_hash():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.register_block(block, h)
    assert block.block_hash == h
    assert pool.get_registered_block(h) is block


def test_cache_block_with_an_already_registered_hash_keeps_the_first():
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    h = hash_block_tokens(None, [5, 5, 5, 5])
    pool.register_block(first, h)
    pool.register_block(second, h)  # a request computed the same block at the same time
    assert pool.get_registered_block(h) is first
    assert second.block_hash is None
    # Freeing and evicting the anonymous duplicate must not drop the first one's entry.
    pool.free([second])
    pool.allocate(2)  # block 2, then the duplicate
    assert pool.get_registered_block(h) is first
    assert first.block_hash == h


def test_cache_block_on_an_already_hashed_block_keeps_its_hash():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h1, h2 = hash_block_tokens(None, [1] * 4), hash_block_tokens(None, [2] * 4)
    pool.register_block(block, h1)
    pool.register_block(block, h2)
    assert block.block_hash == h1
    assert pool.get_registered_block(h2) is None


def test_reset_prefix_cache_forgets_every_hash_but_keeps_references():
    pool = BlockPool(3)
    in_use, freed = pool.allocate(2)
    h_in_use, h_freed = hash_block_tokens(None, [1] * 4), hash_block_tokens(None, [2] * 4)
    pool.register_block(in_use, h_in_use)
    pool.register_block(freed, h_freed)
    pool.free([freed])
    pool.reset_prefix_cache()
    assert pool.get_registered_block(h_in_use) is None
    assert pool.get_registered_block(h_freed) is None
    assert in_use.block_hash is None and freed.block_hash is None
    assert in_use.ref_cnt == 1
    assert _free_ids(pool) == [2, 1]
    # A block can be registered again afterwards.
    pool.register_block(in_use, h_in_use)
    assert pool.get_registered_block(h_in_use) is in_use


def test_repr_names_the_block():
    assert repr(KVCacheBlock(3, ref_cnt=2)) == "KVCacheBlock(3, ref_cnt=2, registered=False)"


def test_a_cache_salt_changes_every_block_hash_of_the_chain():
    """The salt is the first block's parent, so it reaches every hash of the chain; equal salts
    give equal chains, and no salt gives the unsalted chain."""
    from pagedserve.engine.core.block_pool import extend_block_hashes

    tokens = list(range(12))
    plain = extend_block_hashes([], tokens, 4)
    tenant_a = extend_block_hashes([], tokens, 4, "tenant-a")
    tenant_b = extend_block_hashes([], tokens, 4, "tenant-b")
    assert len(plain) == len(tenant_a) == len(tenant_b) == 3
    assert not set(plain) & set(tenant_a) and not set(tenant_a) & set(tenant_b) and not set(plain) & set(tenant_b)
    assert extend_block_hashes([], tokens, 4, "tenant-a") == tenant_a
    assert extend_block_hashes([], tokens, 4, None) == plain


# ---- blocks made on first use ----------------------------------------------------------------


def test_a_pool_of_millions_of_blocks_costs_nothing_until_used():
    """At 0.9 of an H200 a tiny model's cache is 16 million blocks; one object per block made
    every engine start take minutes there (seen on the first GPU run)."""
    pool = BlockPool(50_000_000)
    assert pool.num_free_blocks == 50_000_000 and len(pool.blocks) == 0
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2] and len(pool.blocks) == 3
    pool.free(blocks[::-1])
    assert pool.num_free_blocks == 50_000_000 and pool.usage == 0.0
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]  # never-used ids before freed ones


class _EagerPool:
    """The order every block would have in one free queue made up front: the reference."""

    def __init__(self, num_blocks: int):
        self.queue = list(range(num_blocks))

    def allocate(self, count: int) -> list[int]:
        taken, self.queue = self.queue[:count], self.queue[count:]
        return taken

    def touch(self, block_id: int) -> None:
        if block_id in self.queue:
            self.queue.remove(block_id)

    def free(self, block_id: int) -> None:
        self.queue.append(block_id)


@pytest.mark.parametrize("seed", range(5))
def test_lazy_blocks_allocate_in_the_order_of_one_queue_made_up_front(seed):
    """Random allocations, frees and prefix hits (revivals) of a lazily made pool against the
    order one free queue of all blocks gives: the same ids, the same free order, the same hits."""
    import random

    rng = random.Random(seed)
    pool, eager = BlockPool(40), _EagerPool(40)
    held: list[KVCacheBlock] = []
    refs: dict[int, int] = {}
    for step in range(400):
        action = rng.random()
        if action < 0.4 and pool.num_free_blocks:
            count = rng.randint(1, min(5, pool.num_free_blocks))
            blocks = pool.allocate(count)
            assert [b.block_id for b in blocks] == eager.allocate(count)
            for block in blocks:
                pool.register_block(block, hash_block_tokens(None, [seed, step, block.block_id]))
                refs[block.block_id] = 1
            held += blocks
        elif action < 0.75 and held:
            block = held.pop(rng.randrange(len(held)))
            pool.free([block])
            refs[block.block_id] -= 1
            if refs[block.block_id] == 0:
                eager.free(block.block_id)
        else:  # a prefix hit on a registered block, freed or in use
            registered = list(pool.registered_blocks.values())
            if registered:
                block = rng.choice(registered)
                pool.touch([block])
                eager.touch(block.block_id)
                refs[block.block_id] += 1
                held.append(block)
        assert pool.free_block_ids() == eager.queue
        assert pool.num_free_blocks == len(eager.queue)
        assert all(pool.is_free(i) == (refs.get(i, 0) == 0) for i in range(40))
