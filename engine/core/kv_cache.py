"""KV cache manager: a pool of fixed-size blocks with ref counts and prefix caching.

It hands out block ids and never touches device memory. Every full block (block_size
tokens) of a request gets a chained hash `hash((parent_hash, tokens))`; with prefix caching
on, a block whose hash is already known is shared instead of recomputed. Blocks whose ref
count drops to zero keep their hash and sit in an LRU free queue: they are reused by a later
request with the same prefix, or evicted (hash forgotten) when a fresh block is needed,
least recently freed first.

A sequence keeps all its blocks whatever its layers' sliding windows: blocks outside every
window are not freed early (with global layers, as in Gemma 2 / 3, they are needed anyway),
which keeps prefix caching and preemption unchanged. A request of a LongRoPE model that
outgrew the model's short context (`Request.long_context`) hashes its blocks apart from a
short sequence's with the same tokens: they hold other keys. So does a request that runs a
LoRA adapter (by the adapter's id): two adapters never share a block. A block that holds
placeholder tokens of an image hashes the image's content hash and offset with its tokens:
the same prompt with another image never shares it, and with the same image it does.
For a model whose image tokens attend to each other both ways (`has_bidirectional_images`)
a cached prefix never ends inside an image: the hit stops at the block boundary before it,
so that the image is computed whole in one step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..multimodal.inputs import ImageInput
from .request import Request

_ROOT_HASH = 0x6261746368
_LONG_CONTEXT_SALT = 0x6C6F6E67
_LORA_SALT = 0x6C6F7261


def hash_block(
    parent_hash: int | None,
    token_ids: Sequence[int],
    salt: int | None = None,
    extra_keys: tuple = (),
) -> int:
    """Chained hash of one full block: equal only when the whole prefix (and salt) is equal.

    `extra_keys` holds what the tokens do not say about the block's KV: the (content hash,
    offset) of each image whose placeholder tokens overlap it, so that the same prompt
    with another image never shares a block.

    Python's hash of a tuple of ints is deterministic across runs (no hash randomisation for
    ints); a 64-bit collision between different prefixes is negligible at cache sizes.
    """
    if parent_hash is None:
        parent_hash = _ROOT_HASH if salt is None else hash((_ROOT_HASH, salt))
    if extra_keys:
        return hash((parent_hash, tuple(token_ids), extra_keys))
    return hash((parent_hash, tuple(token_ids)))


def image_keys(images: Sequence[ImageInput], start: int, end: int) -> tuple:
    """The (content hash, offset) of each image whose placeholder tokens overlap the
    positions `[start, end)`."""
    return tuple(
        (image.content_hash, image.offset)
        for image in images
        if image.offset < end and image.end > start
    )


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    """Set once the block is full and cached; None for a block still being filled."""


class BlockPool:
    """Owns every block, the free queue (LRU order) and the hash → cached block map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Blocks come into being on first use, in id order: a small model on a large GPU
        # gets millions of blocks, which as Python objects up front took seconds per engine.
        # The free queue is therefore the blocks never used (ids `len(blocks)` to
        # `num_blocks - 1`, taken first and in order) followed by `free_queue`, the freed
        # ones: the same order as a queue that started with every id, since a freed block
        # joins the tail behind every block never used.
        self.blocks: list[KVBlock] = []
        """The blocks used so far; `blocks[i].block_id == i`."""
        # Front = evicted first. Values unused; OrderedDict gives O(1) removal from the middle.
        self.free_queue: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.blocks) + len(self.free_queue)

    def free_block_ids(self) -> list[int]:
        """Every free block id, the next to be handed out (evicted) first."""
        return [*range(len(self.blocks), self.num_blocks), *self.free_queue]

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt if block_id < len(self.blocks) else 0

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` fresh blocks from the front of the free queue, evicting their hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            if len(self.blocks) < self.num_blocks:
                block = KVBlock(len(self.blocks))
                self.blocks.append(block)
            else:
                block_id, _ = self.free_queue.popitem(last=False)
                block = self.blocks[block_id]
                if block.block_hash is not None:
                    if self.cached.get(block.block_hash) is block:
                        del self.cached[block.block_hash]
                    block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cached blocks (hits), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block; blocks that reach zero join the queue's tail
        in the order given (pass tail blocks first so that they are evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        # The first block computed for a hash stays canonical; a duplicate computed in the same
        # step is just never shared.
        self.cached.setdefault(block_hash, block)

    def uncache_block(self, block: KVBlock) -> None:
        """Forget a block's hash: its KV is not what the hash says (it was never written)."""
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        return True


@dataclass
class ComputedBlocks:
    """Prefix-cache hit for a new request: the shared blocks and the tokens they hold."""

    blocks: list[KVBlock]
    num_computed_tokens: int


class KVCacheManager:
    """Maps requests to block tables.

    Args:
        num_blocks: Blocks in the pool (sized by the model runner from the memory budget).
        block_size: Tokens per block.
        enable_prefix_caching: Share full blocks of identical prefixes.
        has_bidirectional_images: The model's image tokens attend to each other both ways:
            a cached prefix stops before any image it would end inside.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        has_bidirectional_images: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.has_bidirectional_images = has_bidirectional_images
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}
        self.block_table = np.zeros((16, 16), np.int64)
        """Every request's block ids as a row of one array (`block_row`; zero past its
        blocks), so that a step's table is one gather of rows rather than a walk over
        Python ints. Grows (both ways) as needed: a new array, so a step scheduled before
        keeps reading the one it was given."""
        self.block_rows: dict[str, int] = {}
        self._free_rows: list[int] = list(range(15, -1, -1))
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: read, don't modify)."""
        return self.req_block_ids.get(request_id, [])

    def _append_block_ids(self, request_id: str, new_ids: list[int]) -> None:
        """Extend the request's block table, as a list and in its row of `block_table`."""
        ids = self.req_block_ids[request_id]
        start = len(ids)
        ids.extend(new_ids)
        row = self.block_rows.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow_table(rows=2 * self.block_table.shape[0])
            row = self.block_rows[request_id] = self._free_rows.pop()
        if len(ids) > self.block_table.shape[1]:
            self._grow_table(cols=max(2 * self.block_table.shape[1], len(ids)))
        self.block_table[row, start : len(ids)] = new_ids

    def _grow_table(self, rows: int | None = None, cols: int | None = None) -> None:
        old = self.block_table
        grown = np.zeros((rows or old.shape[0], cols or old.shape[1]), np.int64)
        grown[: old.shape[0], : old.shape[1]] = old
        self._free_rows[:0] = range(grown.shape[0] - 1, old.shape[0] - 1, -1)
        self.block_table = grown

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        salt = request.cache_salt
        if request.long_context:  # the same tokens hold other KV in a long sequence
            salt = hash((salt, _LONG_CONTEXT_SALT))
        if request.lora_int_id:  # and under another adapter
            salt = hash((salt, _LORA_SALT, request.lora_int_id))
        images = request.images
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            extra = image_keys(images, start, start + bs) if images else ()
            hashes.append(hash_block(parent, tokens[start : start + bs], salt, extra))

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute, so that the step produces logits, and
        at most `request.max_cached_tokens` come from the cache. With
        `has_bidirectional_images`, the run ends at a block boundary outside every image.
        """
        if not self._caches(request) or request.max_cached_tokens == 0:
            return ComputedBlocks([], 0)
        self._update_block_hashes(request)
        limit = request.num_tokens - 1
        if request.max_cached_tokens is not None:
            limit = min(limit, request.max_cached_tokens)
        max_hit_blocks = limit // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if self.has_bidirectional_images and request.images and hits:
            for image in reversed(request.images):  # later images first: each cut goes back
                if image.offset < num_hit_tokens < image.end:
                    num_hit_tokens = image.offset // self.block_size * self.block_size
            hits = hits[: num_hit_tokens // self.block_size]
        return ComputedBlocks(hits, num_hit_tokens)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Args:
            request: The request; `request.num_computed_tokens` tokens already have KV.
            num_new_tokens: Tokens to compute in this step.
            computed: Prefix-cache hit for a request scheduled for the first time.

        Returns:
            The ids of newly allocated blocks, or None (and no change) when the pool cannot
            provide them.
        """
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if computed is None and blocks is not None:
            # A running request whose blocks already hold the new tokens (most decode steps):
            # nothing to allocate, only blocks that become full to register.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(blocks) * self.block_size:
                if self._caches(request):
                    self._cache_full_blocks(request, num_tokens)
                return []
        if blocks is None:
            blocks = self.req_blocks[rid] = []
            self.req_block_ids[rid] = []
            self.num_cached_blocks[rid] = 0
        hit_blocks = computed.blocks if computed else []
        num_computed = request.num_computed_tokens + (
            computed.num_computed_tokens if computed else 0
        )
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(blocks) - len(hit_blocks)
        # Hit blocks sitting in the free queue stop being available once touched.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                self._forget(rid)
            return None
        if computed is not None and self._caches(request):
            # Counted once per admission, not on every lookup of a request still waiting.
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += computed.num_computed_tokens
        if hit_blocks:
            self.pool.touch(hit_blocks)
            blocks.extend(hit_blocks)
            self._append_block_ids(rid, [b.block_id for b in hit_blocks])
            self.num_cached_blocks[rid] = len(blocks)
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        new_ids = [b.block_id for b in new_blocks]
        self._append_block_ids(rid, new_ids)
        if self._caches(request):
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_ids

    def _caches(self, request: Request) -> bool:
        """Whether the request's full blocks are hashed and shared: always with prefix caching
        on; otherwise only within a salted group (siblings of one prompt)."""
        return self.enable_prefix_caching or request.cache_salt is not None

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register blocks that are full once this step's tokens are written."""
        rid = request.request_id
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks[rid]
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self.req_blocks[rid]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[rid] = num_full

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """Take the request's blocks past its first `num_tokens` tokens out of the prefix cache.

        For a step that failed: the blocks that became full in it were hashed when it was
        scheduled, but their KV was never (or only partly) written, so no request may share
        them. Blocks before `num_tokens` were computed by earlier steps and stay cached.
        """
        rid = request.request_id
        first = num_tokens // self.block_size
        for block in self.req_blocks.get(rid, [])[first:]:
            self.pool.uncache_block(block)
        if rid in self.num_cached_blocks:
            self.num_cached_blocks[rid] = min(self.num_cached_blocks[rid], first)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its last blocks are evicted first."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks is None:
            return
        self.pool.free(list(reversed(blocks)))
        self._forget(request.request_id)

    def _forget(self, request_id: str) -> None:
        self.req_blocks.pop(request_id, None)
        ids = self.req_block_ids.pop(request_id, None)
        row = self.block_rows.pop(request_id, None)
        if row is not None:
            if ids:
                # A new array when the next step reuses the row would cost more; the rows of
                # a step already launched were gathered when it was prepared.
                self.block_table[row, : len(ids)] = 0
            self._free_rows.append(row)
        self.num_cached_blocks.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
