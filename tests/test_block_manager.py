"""Prefix hashing and the block pool, with tiny block sizes and exact block ids."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.block_manager import BlockIntegrityError, BlockManager
from pdserve.engine.sched.hashing import block_hashes, extend_block_hashes, hash_block
from pdserve.engine.sched.request import Request

# xxh64(seed=b"pdserve1", le_u64(parent) + le_int64 tokens); pinned so a change of format is noticed.
GOLDEN = [154893154814350346, 13493096724320370845]


def make_request(rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    req = Request(rid, list(prompt), SamplingParams(), eos_token_id=None, arrival_time=0.0)
    for tok in output:
        req.append_output_token(tok)
    return req


def compute(bm: BlockManager, req: Request, num_new: int | None = None, use_cache: bool = True) -> None:
    """Admit (with a prefix lookup) and compute the rest of the request, as the scheduler would."""
    blocks, hit = bm.get_computed_blocks(req) if use_cache else ([], 0)
    num_new = req.num_tokens - hit if num_new is None else num_new
    assert bm.allocate_slots(req, num_new, blocks)
    req.num_computed_tokens = hit + num_new
    bm.cache_full_blocks(req, req.num_computed_tokens)
    bm.check_integrity()


# ---- hashing -------------------------------------------------------------------------------

def test_hashes_are_pinned_and_identical_in_another_process():
    tokens = list(range(1, 10))           # 2 full blocks of 4 + 1 token that is not hashed
    assert block_hashes(tokens, 4) == GOLDEN
    code = ("import json; from pdserve.engine.sched.hashing import block_hashes; "
            "print(json.dumps(block_hashes(list(range(1, 10)), 4)))")
    env_out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert json.loads(env_out.stdout) == GOLDEN


def test_hash_chain_depends_on_every_earlier_token_and_the_parent():
    a = block_hashes([1, 2, 3, 4, 5, 6], 2)
    b = block_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))       # one token changes all later blocks
    assert block_hashes([3, 4], 2) != [a[1]]                        # same tokens, other position
    assert block_hashes([1, 2, 3, 4], 2, parent=7) != a[:2]         # a salt changes the chain
    assert hash_block(None, [1, 2]) == a[0]
    assert block_hashes([1, 2, 3], 4) == []


def test_incremental_hashes_equal_the_full_computation():
    tokens = list(range(100, 123))
    hashes: list[int] = []
    for end in range(0, len(tokens) + 1, 3):
        extend_block_hashes(hashes, tokens[:end], 4)
    assert hashes == block_hashes(tokens, 4)
    assert extend_block_hashes([], tokens, 4, num_tokens=9) == block_hashes(tokens[:8], 4)


def test_hash_rejects_tokens_outside_int64():
    with pytest.raises(ValueError, match="int64"):
        block_hashes([2**63, 1], 2)


# ---- allocation and free -------------------------------------------------------------------

def test_exact_block_ids_after_allocation_growth_and_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_request("a", range(10)), make_request("b", range(50, 55))
    assert bm.allocate_slots(a, 10, []) and a.block_ids == [0, 1, 2]
    assert bm.allocate_slots(b, 5, []) and b.block_ids == [3, 4]
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 2) and a.block_ids == [0, 1, 2]      # 12 tokens still fit 3 blocks
    assert bm.allocate_slots(a, 3) and a.block_ids == [0, 1, 2, 5]
    assert bm.num_free_blocks == 2 and bm.usage == pytest.approx(6 / 8)
    bm.free(b)                                   # uncached blocks go to the head, in table order
    c = make_request("c", range(90, 99))
    assert bm.allocate_slots(c, 9, []) and c.block_ids == [3, 4, 6]
    bm.check_integrity()
    for req in (a, c):
        bm.free(req)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", range(6))
    assert bm.allocate_slots(a, 6, []) and a.block_ids == [0, 1, 2]
    b = make_request("b", range(4))
    assert not bm.allocate_slots(b, 4, [])
    assert b.block_ids == [] and bm.num_free_blocks == 1
    assert bm.prefix_cache_stats.queries == 6                   # the failed call counted nothing
    bm.check_integrity()


def test_cached_free_blocks_a_hit_takes_count_against_free_space():
    """A prefix hit on cached blocks that sit in the free list takes them out of it: they cannot also
    serve as new blocks. Mutation caught: ``touched_free = 0`` in ``allocate_slots`` -> the check
    passes with 4 free blocks, then the free list runs dry (KeyError) half-way through the allocation.
    """
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", range(8))
    compute(bm, a)
    bm.free(a)                                                   # blocks 0, 1 cached and free
    assert bm.num_free_blocks == 4
    b = make_request("b", list(range(8)) + list(range(100, 109)))   # 17 tokens: hit 8, 9 new = 3 blocks
    blocks, hit = bm.get_computed_blocks(b)
    assert (blocks, hit) == ([0, 1], 8)
    assert not bm.allocate_slots(b, 9, blocks)                   # 4 free - 2 taken by the hit < 3 new
    assert b.block_ids == [] and bm.num_free_blocks == 4
    bm.check_integrity()
    assert bm.allocate_slots(b, 8, blocks)                       # 16 tokens: 2 hit + 2 new blocks fit
    assert b.block_ids[:2] == [0, 1] and bm.num_free_blocks == 0
    bm.check_integrity()


def test_free_twice_is_harmless_and_a_stale_block_table_is_caught():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", range(3))
    compute(bm, a)
    table = list(a.block_ids)
    bm.free(a)
    bm.free(a)
    bm.check_integrity()
    assert bm.num_free_blocks == 4
    a.block_ids = table                           # someone kept the old table and frees again
    with pytest.raises(BlockIntegrityError, match=r"block 1 freed more often than taken \(ref -1"):
        bm.free(a)


@pytest.mark.parametrize("corrupt, message", [
    (lambda bm, a: bm._ref.__setitem__(0, 2), r"block 0 has ref 2 but 1 live block tables hold it"),
    (lambda bm, a: a.block_ids.append(3), r"block 3 has ref 0 but 1 live block tables hold it"),
    (lambda bm, a: a.block_ids.append(a.block_ids[0]), r"request 'a' holds a block twice: \[0, 1, 0\]"),
    (lambda bm, a: bm._free.pop(3), r"block 3 has ref 0 and is not in the free list"),
    (lambda bm, a: a.block_hashes.__setitem__(0, 5), r"request 'a' block 0 \(id 0\) is cached as [0-9a-f]{16} "
                                                      r"but its tokens hash to 0000000000000005"),
    (lambda bm, a: bm._hash.__setitem__(3, 99), r"3 blocks carry a hash but the hash map has 2 entries"),
    (lambda bm, a: bm._cached.__setitem__(next(iter(bm._cached)), 1), r"maps to block 1, whose hash is"),
])
def test_check_integrity_names_the_inconsistency(corrupt, message):
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", range(3))
    compute(bm, a)                                # blocks [0, 1]; block 0 cached
    b = make_request("b", range(10, 12))
    compute(bm, b)                                # block 2, cached
    corrupt(bm, a)
    with pytest.raises(BlockIntegrityError, match=message):
        bm.check_integrity()


# ---- prefix caching ------------------------------------------------------------------------

def test_prefix_hit_is_capped_below_the_whole_prompt():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", range(8))
    compute(bm, a)
    assert a.block_ids == [0, 1]
    same = make_request("same", range(8))
    assert bm.get_computed_blocks(same) == ([0], 4)              # 8 tokens: at most (8 - 1) // 4 blocks
    longer = make_request("longer", list(range(8)) + [42])
    assert bm.get_computed_blocks(longer) == ([0, 1], 8)
    other = make_request("other", [0, 1, 2, 9, 4, 5, 6, 7, 8])
    assert bm.get_computed_blocks(other) == ([], 0)


def test_shared_blocks_are_ref_counted_and_freed_once_unused():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", range(9))
    compute(bm, a)                                               # [0, 1, 2]; 0 and 1 cached
    b = make_request("b", list(range(8)) + [7, 7, 7])
    compute(bm, b)
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 11
    assert bm.prefix_cache_stats.queries == 9 + 11 and bm.prefix_cache_stats.hits == 8
    bm.free(a)
    assert bm.num_free_blocks == 5                               # only block 2 came back
    bm.check_integrity()
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_output_tokens_are_cached_too():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_request("a", [5, 6, 7], output=[8, 9])
    compute(bm, a)
    bm.free(a)
    follow_up = make_request("f", [5, 6, 7, 8, 9, 1])             # next turn of the same chat
    assert bm.get_computed_blocks(follow_up) == ([0, 1], 4)      # [5, 6] [7, 8]: prompt + output


def test_lru_eviction_order_and_debug_log(caplog):
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(bm, a)                        # blocks [0, 1, 2]; 0 and 1 cached
    bm.free(a)                            # free list [2, 3 | 1, 0]: uncached head | cached, prompt tail first
    b = make_request("b", [7, 8, 9])
    compute(bm, b)
    assert b.block_ids == [2, 3]          # uncached blocks are handed out before cached ones
    bm.free(b)                            # [3 | 1, 0, 2]
    again = make_request("a2", [1, 2, 3, 4, 6])
    compute(bm, again)                    # hit: touches 0 and 1 out of the free list
    assert again.block_ids == [0, 1, 3]
    bm.free(again)                        # [3 | 2, 1, 0]: b's block is now the least recently used
    caplog.set_level(logging.DEBUG, logger="pdserve.engine.sched.block_manager")
    c = make_request("c", [20, 21, 22, 23, 24, 25, 26, 27])
    assert bm.allocate_slots(c, 8, [])
    evictions = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evict")]
    assert c.block_ids == [3, 2, 1, 0]
    assert [int(m.split()[2]) for m in evictions] == [2, 1, 0]
    assert evictions[0] == f"evict block 2 hash={block_hashes([7, 8], 2)[0]:016x}"
    bm.free(c)
    assert bm.get_computed_blocks(make_request("x", [1, 2, 3, 4, 5])) == ([], 0)
    bm.check_integrity()


def test_reset_prefix_cache_and_disabled_caching():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(bm, a)
    assert bm.reset_prefix_cache() == 2
    bm.check_integrity()
    bm.free(a)
    assert bm.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    off = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    c = make_request("c", [1, 2, 3, 4, 5])
    compute(off, c)
    off.free(c)
    assert off.get_computed_blocks(make_request("d", [1, 2, 3, 4, 5])) == ([], 0)
    off.check_integrity()
