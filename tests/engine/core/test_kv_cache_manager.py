"""KVCacheManager: prefix-cache lookup, all-or-nothing allocation, freeing, block registration."""

from __future__ import annotations

from pagedserve.engine.core.block_pool import hash_block_tokens
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.request import Request
from pagedserve.sampling_params import SamplingParams

BS = 4  # block size: small, so a dozen tokens span several blocks


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=16), frozenset(), max_model_len=256)


def _compute(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> list:
    """Allocate for and 'run' the next `num_tokens` (default: all) as the scheduler does."""
    n = request.num_tokens - request.num_computed_tokens if num_tokens is None else num_tokens
    new_blocks = kv.allocate_slots(request, n)
    assert new_blocks is not None
    request.num_computed_tokens += n
    return new_blocks


def _admit(kv: KVCacheManager, request: Request):
    """Look up hits and allocate the rest of the prompt, as the scheduler admits a waiting request."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    new_blocks = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return hits, num_hit_tokens, new_blocks


# ---- get_computed_blocks -------------------------------------------------------------------


def test_empty_cache_misses():
    kv = KVCacheManager(8, BS, enable_caching=True)
    assert kv.get_computed_blocks(_request("a", range(10))) == ([], 0)


def test_hits_only_full_blocks():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = _request("a", range(10))  # two full blocks and a partial one
    _compute(kv, a)
    b = _request("b", list(range(10)) + [99, 98, 97])  # shares all 10 tokens of a
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert num_hit_tokens == 8  # a's partial third block is never a hit
    assert [blk.block_id for blk in hits] == kv.get_block_ids("a")[:2]


def test_always_leaves_one_token_to_compute():
    kv = KVCacheManager(8, BS, enable_caching=True)
    _compute(kv, _request("a", range(8)))  # exactly two full blocks, both registered
    # Same 8 tokens: a hit on both would leave nothing to sample from, so only one is used.
    assert kv.get_computed_blocks(_request("b", range(8)))[1] == 4
    # One more token and both blocks are hits.
    assert kv.get_computed_blocks(_request("c", list(range(8)) + [50]))[1] == 8


def test_lookup_stops_at_the_first_miss():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = _request("a", range(13))
    _compute(kv, a)  # blocks 0, 1, 2 registered, block 3 holds the 13th token
    x, y, z, _ = kv.req_to_blocks["a"]
    kv.free(a)
    # Evict only y: keep z in use while allocation walks the free queue (tail, z, y, x).
    kv.pool.touch([z])
    kv.pool.allocate(2)  # the tail block and y
    kv.pool.free([z])
    assert y.block_hash is None and z.block_hash is not None
    hits, num_hit_tokens = kv.get_computed_blocks(_request("b", range(14)))
    assert hits == [x] and num_hit_tokens == 4  # z is cached but follows a miss


def test_prefix_stats_count_each_admitted_request_once():
    kv = KVCacheManager(4, BS, enable_caching=True)
    _admit(kv, _request("a", range(9)))
    b = _request("b", list(range(9)) + [60, 61])
    kv.get_computed_blocks(b)  # a lookup alone is no admission: a waiting request repeats it
    _admit(kv, b)
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (9 + 11, 0 + 8)
    assert _admit(kv, _request("c", list(range(8)) + list(range(70, 80))))[2] is None
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (9 + 11, 0 + 8)  # refused: not counted


def test_caching_disabled_never_hits_nor_registers():
    kv = KVCacheManager(8, BS, enable_caching=False)
    _compute(kv, _request("a", range(12)))
    assert kv.get_computed_blocks(_request("b", range(13))) == ([], 0)
    assert kv.pool.registered_blocks == {}
    assert kv.num_prefix_queries == 0


# ---- allocate_slots ------------------------------------------------------------------------


def test_allocate_rounds_up_to_whole_blocks():
    kv = KVCacheManager(8, BS, enable_caching=True)
    new_blocks = _compute(kv, _request("a", range(9)))
    assert [b.block_id for b in new_blocks] == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.pool.num_free_blocks == 5


def test_decode_adds_a_block_only_when_the_last_one_is_full():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = _request("a", range(6))
    _compute(kv, a)
    num_new_per_step = []
    for token in range(100, 106):  # tokens 7..12: one block boundary after token 8
        a.append_output_token_id(token)
        num_new_per_step.append(len(_compute(kv, a, 1)))
    # Token 7 and 8 fit block 1; token 9 opens block 2; 10..12 fit it.
    assert num_new_per_step == [0, 0, 1, 0, 0, 0]
    assert len(kv.get_block_ids("a")) == 3


def test_allocate_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = _request("a", range(12))
    _compute(kv, a)  # 3 of 4 blocks
    b = _request("b", range(50, 55))  # needs 2
    assert kv.allocate_slots(b, 5) is None
    assert kv.pool.num_free_blocks == 1
    assert kv.get_block_ids("b") == []
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert [kv.pool.block(i).ref_cnt for i in range(4)] == [1, 1, 1, 0]


def test_allocate_counts_revived_hit_blocks_against_free_blocks():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = _request("a", range(8))
    _compute(kv, a)
    kv.free(a)  # two cached blocks with ref 0: they still count as free
    assert kv.pool.num_free_blocks == 4
    # 17 tokens need 5 blocks: 2 hits + 3 new. Reviving the hits leaves only 2 free.
    hits, _, new_blocks = _admit(kv, _request("b", list(range(8)) + list(range(30, 39))))
    assert len(hits) == 2 and new_blocks is None
    assert kv.pool.num_free_blocks == 4  # nothing was touched
    assert [blk.ref_cnt for blk in hits] == [0, 0]
    assert all(kv.pool.get_registered_block(blk.block_hash) is blk for blk in hits)
    # 16 tokens need 2 new blocks: exactly what is left after reviving the hits.
    c = _request("c", list(range(8)) + list(range(30, 38)))
    hits, num_hit_tokens, new_blocks = _admit(kv, c)
    assert num_hit_tokens == 8 and len(new_blocks) == 2
    assert kv.get_block_ids("c") == [b.block_id for b in hits + new_blocks]
    assert kv.pool.num_free_blocks == 0


def test_hits_on_blocks_in_use_are_shared_not_copied():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = _request("a", range(9))
    _compute(kv, a)  # 3 blocks, 1 free
    b = _request("b", list(range(8)) + [70, 71, 72, 73])
    hits, num_hit_tokens, new_blocks = _admit(kv, b)
    assert num_hit_tokens == 8 and len(new_blocks) == 1  # only the unshared third block is new
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    kv.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    assert kv.pool.num_free_blocks == 1  # only a's private third block came back


# ---- registration in the prefix cache --------------------------------------------------------


def test_blocks_are_registered_as_they_fill():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = _request("a", [1, 2, 3, 4, 5, 6])
    _compute(kv, a)
    blocks = kv.req_to_blocks["a"]
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert blocks[0].block_hash == h0 and blocks[1].block_hash is None
    for token in (7, 8):
        a.append_output_token_id(token)
        _compute(kv, a, 1)
    # The second block filled with prompt and output tokens: its hash chains the first.
    assert blocks[1].block_hash == hash_block_tokens(h0, [5, 6, 7, 8])
    assert kv.pool.get_registered_block(blocks[1].block_hash) is blocks[1]
    assert kv.num_registered_blocks["a"] == 2


def test_chunked_prefill_registers_only_blocks_this_chunk_fills():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = _request("a", range(12))
    _compute(kv, a, 5)  # block 0 full, block 1 holds one token
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, False]
    _compute(kv, a, 7)
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, True, True]


def test_same_prefix_computed_twice_at_once_keeps_the_first_registration():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a, b = _request("a", range(6)), _request("b", range(6))
    assert kv.get_computed_blocks(a)[1] == kv.get_computed_blocks(b)[1] == 0  # both miss...
    _compute(kv, a)
    _compute(kv, b)  # ...and compute the same first block
    first_a, first_b = kv.req_to_blocks["a"][0], kv.req_to_blocks["b"][0]
    assert first_a.block_hash is not None and first_b.block_hash is None
    kv.free(a)
    kv.free(b)
    assert kv.get_computed_blocks(_request("c", range(6)))[0] == [first_a]
    assert kv.pool.num_free_blocks == 8


# ---- free and reset ---------------------------------------------------------------------------


def test_free_returns_every_block_tail_first():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = _request("a", range(12))
    _compute(kv, a)  # blocks 0, 1, 2; block 3 free
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]  # the prefix is evicted last
    assert kv.get_block_ids("a") == [] and "a" not in kv.num_registered_blocks


def test_freed_blocks_are_reused_by_a_request_with_the_same_prefix():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = _request("a", range(10))
    _compute(kv, a)
    old_ids = kv.get_block_ids("a")
    kv.free(a)
    hits, num_hit_tokens, _ = _admit(kv, _request("b", range(10)))
    assert num_hit_tokens == 8
    assert kv.get_block_ids("b")[:2] == old_ids[:2]


def test_free_of_an_unknown_request_is_a_no_op():
    kv = KVCacheManager(4, BS, enable_caching=True)
    kv.free(_request("ghost", [1]))
    assert kv.pool.num_free_blocks == 4


def test_reset_prefix_cache_then_running_blocks_register_again():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = _request("a", range(8))
    _compute(kv, a)
    kv.reset_prefix_cache()
    assert kv.pool.registered_blocks == {} and kv.num_registered_blocks == {"a": 0}
    assert kv.get_computed_blocks(_request("b", range(9)))[1] == 0
    a.append_output_token_id(8)
    _compute(kv, a, 1)  # the next allocation registers a's full blocks again
    assert kv.get_computed_blocks(_request("c", range(9)))[1] == 8


# ---- tenant salts ----------------------------------------------------------------------------


def _salted(req_id: str, tokens: list[int], salt: str | None) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=16), frozenset(), max_model_len=256, cache_salt=salt)


def test_different_salts_share_no_prefix_blocks():
    """Another tenant's identical prompt gets no hit (its time to first token reveals nothing);
    the same tenant's does; an unsalted prompt hits neither."""
    kv = KVCacheManager(16, BS, enable_caching=True)
    prompt = list(range(13))  # three full blocks
    _compute(kv, _salted("a", prompt, "tenant-a"))
    assert kv.get_computed_blocks(_salted("b", prompt, "tenant-b"))[1] == 0
    assert kv.get_computed_blocks(_salted("plain", prompt, None))[1] == 0
    hits, num_hit_tokens = kv.get_computed_blocks(_salted("a2", prompt, "tenant-a"))
    assert num_hit_tokens == 12 and [b.block_id for b in hits] == kv.get_block_ids("a")[:3]
    _compute(kv, _salted("b", prompt, "tenant-b"))  # tenant b's own blocks, not a's
    assert not set(kv.get_block_ids("a")) & set(kv.get_block_ids("b"))
    assert kv.get_computed_blocks(_salted("b2", prompt, "tenant-b"))[1] == 12
