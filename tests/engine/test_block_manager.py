"""BlockManager: allocation, reference counts, copy-on-write forks, prefix caching and eviction."""
from __future__ import annotations

import pytest

from tierllm.engine.block_manager import BlockManager


def _state(bm: BlockManager):
    return (list(bm.ref_counts), list(bm.free_blocks), {k: list(v) for k, v in bm.block_tables.items()},
            dict(bm.hash_to_block), dict(bm.block_to_hash), dict(bm.num_cached_blocks))


def test_needs_at_least_one_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 4)


def test_blocks_needed_rounds_up():
    bm = BlockManager(8, 4)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_free_ref_counts():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    assert bm.allocate_slots("a", 0, 10) == []              # 10 tokens -> 3 blocks, no copies
    table = list(bm.get_block_table("a"))
    assert len(table) == 3 and len(set(table)) == 3
    assert all(bm.ref_counts[b] == 1 for b in table)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5

    # growing inside the last block takes nothing; crossing a boundary takes exactly one block
    assert bm.allocate_slots("a", 10, 2) == []
    assert bm.get_block_table("a") == table
    assert bm.allocate_slots("a", 12, 1) == []
    assert len(bm.get_block_table("a")) == 4 and bm.get_block_table("a")[:3] == table

    bm.allocate_slots("b", 0, 4)
    assert bm.num_used_blocks == 5
    assert not set(bm.get_block_table("a")) & set(bm.get_block_table("b"))

    bm.free("a")
    assert bm.get_block_table("a") == []
    assert bm.num_used_blocks == 1
    assert all(bm.ref_counts[b] == 0 for b in table)
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    bm.free("never-allocated")                               # harmless
    assert bm.num_free_blocks == 8


def test_can_allocate_false_when_full_and_nothing_changes():
    bm = BlockManager(4, 4)
    assert bm.allocate_slots("a", 0, 12) == []               # 3 of 4 blocks
    assert bm.can_allocate("b", 0, 4)
    assert not bm.can_allocate("b", 0, 5)                    # needs 2, 1 free
    before = _state(bm)
    assert bm.allocate_slots("b", 0, 5) is None
    assert _state(bm) == before                              # a failed allocation changes nothing
    assert not bm.can_allocate("a", 12, 8)                   # a needs 2 more blocks, 1 free
    assert bm.allocate_slots("a", 12, 8) is None
    assert _state(bm) == before


def test_fork_shares_blocks_and_copy_on_write_on_first_write():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    bm.allocate_slots("parent", 0, 6)                        # block 0 full, block 1 holds 2 of 4 tokens
    full, partial = list(bm.get_block_table("parent"))
    bm.fork({"child": "parent"})
    assert bm.get_block_table("child") == [full, partial]
    assert bm.ref_counts[full] == 2 and bm.ref_counts[partial] == 2
    assert bm.num_used_blocks == 2

    # the child's first write lands in the shared partial block -> one (src, dst) copy
    assert bm.can_allocate("child", 6, 1)
    copies = bm.allocate_slots("child", 6, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == partial and dst not in (full, partial)
    assert bm.get_block_table("child") == [full, dst]
    assert bm.ref_counts[partial] == 1 and bm.ref_counts[dst] == 1 and bm.ref_counts[full] == 2

    # the block is private now: no further copies, for the child or the parent
    assert bm.allocate_slots("child", 7, 1) == []
    assert bm.allocate_slots("parent", 6, 1) == []
    assert bm.get_block_table("parent") == [full, partial]

    bm.free("parent")
    assert bm.ref_counts[full] == 1 and bm.ref_counts[partial] == 0
    bm.free("child")
    assert bm.num_used_blocks == 0


def test_fork_full_blocks_need_no_copy():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    bm.allocate_slots("parent", 0, 8)                        # exactly two full blocks
    bm.fork({"child": "parent"})
    copies = bm.allocate_slots("child", 8, 1)                # writes into a new, third block
    assert copies == []
    assert len(bm.get_block_table("child")) == 3
    assert bm.get_block_table("child")[:2] == bm.get_block_table("parent")


def test_copy_on_write_counts_in_can_allocate():
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    bm.allocate_slots("parent", 0, 6)                        # both blocks
    bm.fork({"child": "parent"})
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate("child", 6, 1)                # the copy needs a free block
    before = _state(bm)
    assert bm.allocate_slots("child", 6, 1) is None
    assert _state(bm) == before


def test_fork_uses_the_tables_from_before_the_call():
    """Beam search: slot 0 continues parent 1 and slot 1 continues parent 0 (a swap)."""
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    bm.allocate_slots("b0", 0, 3)
    bm.allocate_slots("b1", 0, 3)
    t0, t1 = list(bm.get_block_table("b0")), list(bm.get_block_table("b1"))
    bm.fork({"b0": "b1", "b1": "b0"})
    assert bm.get_block_table("b0") == t1 and bm.get_block_table("b1") == t0
    assert all(bm.ref_counts[b] == 1 for b in t0 + t1)
    # both slots continue the same parent: its block is shared, the other one is free again
    bm.fork({"b0": "b0", "b1": "b0"})
    assert bm.get_block_table("b0") == bm.get_block_table("b1") == t1
    assert bm.ref_counts[t1[0]] == 2 and bm.ref_counts[t0[0]] == 0
    bm.free("b0")
    bm.free("b1")
    assert bm.num_used_blocks == 0


def _fill(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """Allocate and 'compute' the whole token list, registering full blocks in the prefix cache."""
    assert bm.allocate_slots(rid, 0, len(tokens)) is not None
    bm.cache_full_blocks(rid, len(tokens), lambda: tokens)


def test_prefix_cache_hits_full_blocks_only_and_leaves_a_token():
    bm = BlockManager(16, 4)
    tokens = list(range(10, 20))                             # 10 tokens: 2 full blocks + 2 tokens
    _fill(bm, "a", tokens)
    table = list(bm.get_block_table("a"))
    assert bm.get_computed_blocks(tokens) == table[:2]       # never the partial third block
    assert bm.get_computed_blocks(tokens + [99, 98]) == table[:2]
    assert bm.get_computed_blocks(tokens[:9]) == table[:2]
    # a prompt that is exactly 2 full cached blocks: the last block is left to compute (>= 1 token)
    assert bm.get_computed_blocks(tokens[:8]) == table[:1]
    assert bm.get_computed_blocks(tokens[:4]) == []
    # a different first block: no hit at all (chained hashes), even if the second block matches
    assert bm.get_computed_blocks([0] + tokens[1:]) == []
    assert bm.get_computed_blocks(tokens[:4] + [0] + tokens[5:]) == table[:1]


def test_prefix_cache_disabled_never_hits():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    tokens = list(range(10, 22))
    _fill(bm, "a", tokens)
    assert bm.get_computed_blocks(tokens + [1]) == []


def test_prefix_cache_hit_shares_blocks_and_survives_free():
    bm = BlockManager(16, 4)
    tokens = list(range(10, 22))                             # 3 full blocks
    _fill(bm, "a", tokens)
    table_a = list(bm.get_block_table("a"))
    prompt_b = tokens + [1, 2]
    hits = bm.get_computed_blocks(prompt_b)
    assert hits == table_a
    assert bm.allocate_slots("b", len(hits) * 4, len(prompt_b) - len(hits) * 4, hits) == []
    table_b = bm.get_block_table("b")
    assert table_b[:3] == table_a and len(table_b) == 4
    assert all(bm.ref_counts[b] == 2 for b in table_a)

    bm.free("a")
    bm.free("b")
    assert bm.num_used_blocks == 0
    # freed blocks keep their content: a third request still hits them (taken back out of the free list)
    hits = bm.get_computed_blocks(tokens + [5])
    assert hits == table_a
    free_before = bm.num_free_blocks
    assert bm.allocate_slots("c", 12, 1, hits) == []
    assert bm.num_free_blocks == free_before - 4             # 3 reused + 1 new
    assert all(bm.ref_counts[b] == 1 for b in bm.get_block_table("c"))


def test_can_allocate_counts_cached_hits_sitting_in_the_free_list():
    bm = BlockManager(3, 4)
    tokens = list(range(10, 18))                             # 2 full blocks
    _fill(bm, "a", tokens)
    bm.free("a")
    hits = bm.get_computed_blocks(tokens + [1])
    assert len(hits) == 2 and bm.num_free_blocks == 3
    assert bm.can_allocate("b", 8, 1, hits)                  # 2 reused + 1 new = 3
    assert not bm.can_allocate("b", 8, 5, hits)              # 2 reused + 2 new = 4 > 3
    before = _state(bm)
    assert bm.allocate_slots("b", 8, 5, hits) is None
    assert _state(bm) == before


def test_eviction_of_freed_cached_blocks():
    bm = BlockManager(4, 4)
    old = list(range(10, 18))                                # 2 full blocks
    _fill(bm, "old", old)
    old_table = list(bm.get_block_table("old"))
    bm.free("old")
    assert bm.get_computed_blocks(old + [1]) == old_table    # still cached while free

    _fill(bm, "new", list(range(50, 66)))                    # needs all 4 blocks: evicts the cached ones
    assert bm.get_computed_blocks(old + [1]) == []
    assert not any(b in bm.block_to_hash and bm.hash_to_block.get(bm.block_to_hash[b]) != b for b in old_table)
    bm.free("new")
    assert bm.num_used_blocks == 0


def test_eviction_takes_least_recently_freed_first():
    bm = BlockManager(4, 4)
    a, b = list(range(10, 14)), list(range(20, 24))
    _fill(bm, "a", a)
    _fill(bm, "b", b)
    bm.free("a")                                             # a freed before b: a is evicted first
    bm.free("b")
    bm.allocate_slots("x", 0, 4)                             # takes one never-used block
    bm.allocate_slots("y", 0, 4)                             # another never-used block
    assert bm.get_computed_blocks(a + [1]) and bm.get_computed_blocks(b + [1])
    bm.allocate_slots("z", 0, 4)                             # now a cached block must go: a's
    assert bm.get_computed_blocks(a + [1]) == []
    assert bm.get_computed_blocks(b + [1]) != []


def test_cache_full_blocks_only_registers_computed_full_blocks():
    bm = BlockManager(8, 4)
    tokens = list(range(10, 22))
    bm.allocate_slots("a", 0, 12)
    bm.cache_full_blocks("a", 5, lambda: tokens)                    # only block 0 is fully computed
    assert len(bm.block_to_hash) == 1
    assert bm.get_computed_blocks(tokens) == bm.get_block_table("a")[:1]
    bm.cache_full_blocks("a", 12, lambda: tokens)
    assert len(bm.block_to_hash) == 3
