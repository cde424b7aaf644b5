"""The KV cache's blocks: reference counts, chained prefix hashes, and LRU reuse.

A full block is named by `hash(parent block's hash, its token ids)`, so equal prefixes name equal
blocks (the first block's parent is the request's cache salt, if any). A block whose last user frees it keeps its hash and its K/V: it goes to the back of the
free queue, where it can still be found by hash and revived, until allocation reaches it at the
front and evicts it (least recently freed first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable, Sequence

BlockHash = bytes
# Evicted blocks' routing keys kept for the replica's next routing-stats report; older ones drop
# out (the report's eviction counter tells the router how many it missed).
EVICTION_LOG_SIZE = 8192


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """sha256 over the parent's hash and the tokens: a collision would silently reuse another
    prompt's K/V, so a cryptographic hash is worth its microsecond."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, lora_int_id: int = 0
) -> list[BlockHash]:
    """Extend `hashes` (the chain of the leading full blocks of `token_ids`, maybe empty) over
    every further full block, and return it. The engine names its cached blocks with this chain
    and the prefix-aware router computes it from a prompt's token ids, so equal chains mean
    blocks that can be in the cache. A `cache_salt` (a tenant's) is the first block's parent, so
    the whole chain differs per salt: one tenant's prompts never hit another's blocks, and the
    time to first token reveals nothing of what another tenant sent. An adapter (`lora_int_id`)
    joins the salt there: the same prompt under two adapters (or one and the base model) has
    other K/V, and never shares a block."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else salt_root(cache_salt, lora_int_id)
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
    return hashes


def salt_root(cache_salt: str | None, lora_int_id: int = 0) -> BlockHash | None:
    """The first block's parent for a salt and an adapter (None: neither, the parent is empty)."""
    if cache_salt is None and not lora_int_id:
        return None
    root = b"" if cache_salt is None else b"cache_salt\0" + cache_salt.encode()
    return hashlib.sha256(root + (b"\0lora\0%d" % lora_int_id if lora_int_id else b"")).digest()


def routing_key(block_hash: BlockHash) -> int:
    """A block hash shortened for routing state (the router's tables, eviction reports): 64
    bits make collisions rare enough for a routing hint, which never decides what is reused."""
    return int.from_bytes(block_hash[:8], "little")


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, registered={self.block_hash is not None})"


class BlockPool:
    """Blocks are made on first use: until then a block is only an id above `_next_fresh`, free
    and ahead of every freed block in allocation order (as if the free queue started with all of
    them in id order). A GPU's share of memory holds millions of a small model's blocks (16
    million for a tiny test model at 0.9 of an H200): one object each took minutes to make."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks: list[KVCacheBlock] = []  # made so far: ids 0 .. len - 1
        self._next_fresh = 0  # ids from here up were never allocated
        # Blocks freed after use (ref_cnt 0), least recently freed first. An OrderedDict gives
        # O(1) removal of a revived block from the middle.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict()
        # The prefix cache: full blocks registered under their hash (freed ones too, until evicted).
        self.registered_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Eviction reporting for prefix-aware routing: the routing keys of the latest evicted
        # hashes (appended by the engine loop, drained by the replica's stats report; a deque's
        # append and popleft are safe across threads), every eviction counted, and the resets.
        self.evicted_routing_keys: deque[int] = deque(maxlen=EVICTION_LOG_SIZE)
        self.num_evicted_blocks = 0
        self.num_prefix_cache_resets = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_fresh + len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block(self, block_id: int) -> KVCacheBlock:
        """The block with this id, made if it was never used."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} of {self.num_blocks}")
        while len(self.blocks) <= block_id:
            self.blocks.append(KVCacheBlock(len(self.blocks)))
        return self.blocks[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id >= self._next_fresh or block_id in self.free_queue

    def free_block_ids(self) -> list[int]:
        """Every free id in allocation order (for tests and checks: it lists them all)."""
        return list(range(self._next_fresh, self.num_blocks)) + list(self.free_queue)

    def get_registered_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.registered_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Fresh blocks (ref_cnt 1): never-used ids first, then the front of the free queue,
        evicting their old hashes."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks with {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            if self._next_fresh < self.num_blocks:
                block = self.block(self._next_fresh)
                self._next_fresh += 1
            else:
                _, block = self.free_queue.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to blocks found in the prefix cache (reviving freed ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the back of the free queue in the order
        given, so callers pass a request's tail blocks first (they are evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def register_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash. If an equal block is already registered (two
        requests computed the same prefix at once) the first stays and this one stays anonymous."""
        if block.block_hash is not None or block_hash in self.registered_blocks:
            return
        block.block_hash = block_hash
        self.registered_blocks[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every hash (the K/V contents are gone, e.g. after a worker restart)."""
        for block in self.blocks:
            block.block_hash = None
        self.registered_blocks.clear()
        self.num_prefix_cache_resets += 1

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.registered_blocks.get(block.block_hash) is block:
                del self.registered_blocks[block.block_hash]
                self.evicted_routing_keys.append(routing_key(block.block_hash))
                self.num_evicted_blocks += 1
            block.block_hash = None
