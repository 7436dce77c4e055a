"""KV block pool: per-request block tables, reference counts, copy-on-write and prefix caching.

No torch here: blocks are integers; the runner owns the tensors and performs the copies returned
by `allocate_slots` (copy-on-write) before the step's forward pass.
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefer_low_ids: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks                       # pool size
        self.block_size = block_size                       # tokens per block
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks                 # live users per block
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU order
        self.block_tables: dict[str, list[int]] = {}       # request id -> physical blocks
        self.hash_to_block: dict[bytes, int] = {}          # prefix hash of a full block -> block
        self.block_to_hash: dict[int, bytes] = {}
        self.block_tokens: dict[int, tuple[int, ...]] = {}  # cached block -> its tokens (hits are verified)
        self.num_cached_blocks: dict[str, int] = {}        # request id -> leading blocks already hashed
        # KV offload copies the span of blocks [0, highest used id] each step: hand out the lowest free ids so the
        # span stays as small as the blocks in use (instead of least-recently-freed first). Lazy min-heap.
        self.prefer_low_ids = prefer_low_ids
        self.low_id_heap: list[int] = list(range(num_blocks)) if prefer_low_ids else []

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def _chain_hash(parent_hash: bytes | None, block_tokens: list[int]) -> bytes:
        """SHA-256 over the parent's hash and this block's tokens: a prefix cache shared by all clients must not
        be steerable by crafted collisions (hits are also checked token by token)."""
        digest = hashlib.sha256(parent_hash or b"")
        digest.update(array("q", block_tokens).tobytes())
        return digest.digest()

    def get_computed_blocks(self, token_ids: list[int]) -> list[int]:
        """Longest run of cached full blocks matching the prefix. At least one token is left to compute,
        so the step that follows still produces logits."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = None
        for i in range((len(token_ids) - 1) // self.block_size):
            tokens = token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = self._chain_hash(parent, tokens)
            block = self.hash_to_block.get(parent)
            if block is None or self.block_tokens[block] != tuple(tokens):
                break
            hits.append(block)
        return hits

    # ---- allocation ----------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if self.prefer_low_ids:
            block = heapq.heappop(self.low_id_heap)
            while self.ref_counts[block] or block not in self.free_blocks:   # stale entry: taken since
                block = heapq.heappop(self.low_id_heap)
            del self.free_blocks[block]
        else:
            block, _ = self.free_blocks.popitem(last=False)     # least recently freed first
        old_hash = self.block_to_hash.pop(block, None)
        if old_hash is not None:                            # evict its cached content
            self.hash_to_block.pop(old_hash, None)
            del self.block_tokens[block]
        self.ref_counts[block] = 1
        return block

    def _incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _decref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None
            if self.prefer_low_ids:
                heapq.heappush(self.low_id_heap, block)

    def can_allocate(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                     computed_blocks: list[int] = ()) -> bool:
        table = self.block_tables.get(request_id, []) or list(computed_blocks)
        needed = self.blocks_needed(num_computed_tokens + num_new_tokens) - len(table)
        num_reusable = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)  # hits now sitting in the free list
        num_cow = 1 if self._write_block_is_shared(table, num_computed_tokens) else 0
        return max(needed, 0) + num_cow + num_reusable <= self.num_free_blocks

    def _write_block_is_shared(self, table: list[int], num_computed_tokens: int) -> bool:
        index = num_computed_tokens // self.block_size
        return index < len(table) and self.ref_counts[table[index]] > 1

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       computed_blocks: list[int] = ()) -> list[tuple[int, int]] | None:
        """Make room for `num_new_tokens` after `num_computed_tokens`. Returns the (src, dst) block copies
        that copy-on-write needs, or None (and changes nothing) if the pool is too small right now."""
        if not self.can_allocate(request_id, num_computed_tokens, num_new_tokens, computed_blocks):
            return None
        table = self.block_tables.setdefault(request_id, [])
        if not table and computed_blocks:
            for block in computed_blocks:
                self._incref(block)
            table.extend(computed_blocks)
            self.num_cached_blocks[request_id] = len(computed_blocks)
        copies = []
        index = num_computed_tokens // self.block_size
        if index < len(table) and self.ref_counts[table[index]] > 1:   # copy-on-write of a shared partial block
            new_block = self._take_free_block()
            copies.append((table[index], new_block))
            self._decref(table[index])
            table[index] = new_block
        while len(table) < self.blocks_needed(num_computed_tokens + num_new_tokens):
            table.append(self._take_free_block())
        return copies

    def cache_full_blocks(self, request_id: str, num_computed_tokens: int,
                          get_token_ids: Callable[[], list[int]]) -> None:
        """Register the prefix hashes of blocks that became full (all their tokens computed). The token ids are
        fetched only when a block did fill (once per block_size tokens, not every step)."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request_id, [])
        start = self.num_cached_blocks.get(request_id, 0)
        num_full = min(num_computed_tokens // self.block_size, len(table))
        if num_full <= start:
            return
        token_ids = get_token_ids()
        parent = None
        for i in range(num_full):
            tokens = token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = self._chain_hash(parent, tokens)
            if i < start:
                continue
            block = table[i]
            if parent not in self.hash_to_block and block not in self.block_to_hash:
                self.hash_to_block[parent] = block
                self.block_to_hash[block] = parent
                self.block_tokens[block] = tuple(tokens)
        self.num_cached_blocks[request_id] = num_full

    def fork(self, child_to_parent: dict[str, str]) -> None:
        """Each child takes a shared copy of its parent's block table, as the tables were before the call
        (a child may also be another child's parent, as in beam search). Copy-on-write happens at the
        child's next write into a shared partial block."""
        new_tables = {c: list(self.block_tables.get(p, [])) for c, p in child_to_parent.items()}
        new_cached = {c: self.num_cached_blocks.get(p, 0) for c, p in child_to_parent.items()}
        for table in new_tables.values():
            for block in table:
                self._incref(block)
        for child in child_to_parent:
            self.free(child)
        self.block_tables.update(new_tables)
        self.num_cached_blocks.update(new_cached)

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        for block in reversed(table):          # tail blocks are evicted first
            self._decref(block)
