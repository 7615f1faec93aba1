"""Accounting: the cases from issue 3; every figure >= 0 and local + loaded + recomputed == total."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kvstore.accounting import account


def _invariants(a):
    assert min(a.total_tokens, a.local_hit_tokens, a.store_hit_tokens, a.need_to_load,
               a.loaded_tokens, a.recomputed_tokens) >= 0
    assert a.local_hit_tokens + a.loaded_tokens + a.recomputed_tokens == a.total_tokens


def test_local_hit_beyond_store_hit_is_zero_not_minus_128():
    a = account(146, 128, 0, block_size=16)
    assert a.need_to_load == 0
    assert a.log_line() == "total=146 local_hit=128 store_hit=0 need_to_load=0 loaded=0 recomputed=18"
    _invariants(a)


def test_partial_chunk_rounds_down_to_whole_blocks():
    a = account(300, 0, 290, block_size=16)           # store has 256 + a 34-token partial chunk
    assert (a.need_to_load, a.recomputed_tokens) == (288, 12)
    _invariants(a)


def test_chunk_and_block_granularity_mismatch():
    a = account(836, 832, 768, block_size=16)         # local prefix cache ahead of the store
    assert (a.need_to_load, a.loaded_tokens, a.recomputed_tokens) == (0, 0, 4)
    b = account(836, 512, 768, block_size=16)
    assert (b.need_to_load, b.recomputed_tokens) == (256, 68)
    _invariants(a), _invariants(b)


def test_store_hit_beyond_the_prompt_keeps_the_last_token():
    a = account(512, 0, 768, block_size=16)
    assert a.need_to_load == 496                       # min(768, 511) = 511 -> 31 blocks
    assert a.recomputed_tokens == 16
    _invariants(a)


def test_failed_load_after_a_hit_is_recomputed():
    plan = account(1000, 256, 768, block_size=16)
    assert plan.need_to_load == 512
    failed, half = plan.with_loaded(0), plan.with_loaded(256)
    assert (failed.loaded_tokens, failed.recomputed_tokens) == (0, 744)
    assert (half.loaded_tokens, half.recomputed_tokens) == (256, 488)
    _invariants(failed), _invariants(half)


def test_bad_inputs_name_the_value_and_the_limit():
    with pytest.raises(ValueError, match="local_hit_tokens=10 exceeds total_tokens=5"):
        account(5, 10, 0, 16)
    with pytest.raises(ValueError, match="loaded_tokens=32 exceeds need_to_load=16"):
        account(40, 0, 16, 16).with_loaded(32)
    with pytest.raises(ValueError, match="store_hit_tokens must be >= 0"):
        account(5, 0, -1, 16)
    with pytest.raises(ValueError, match="--block-size"):
        account(5, 0, 0, 0)
    assert account(0, 0, 0, 16).log_line().startswith("total=0")


@given(total=st.integers(0, 5000), local=st.integers(0, 5000), store=st.integers(0, 6000),
       block=st.sampled_from([1, 16, 64]), frac=st.floats(0, 1))
def test_invariants_hold_everywhere(total, local, store, block, frac):
    a = account(total, min(local, total), store, block)
    assert a.need_to_load % block == 0
    assert a.local_hit_tokens + a.need_to_load <= max(total - 1, a.local_hit_tokens)
    _invariants(a)
    _invariants(a.with_loaded(int(a.need_to_load * frac)))


def test_a_request_that_never_ran_computed_nothing():
    from pdserve.kvstore.accounting import not_run

    a = not_run()
    assert (a.total_tokens, a.local_hit_tokens, a.store_hit_tokens, a.need_to_load, a.loaded_tokens,
            a.recomputed_tokens, a.ran) == (0, 0, 0, 0, 0, 0, False)
    assert a.local_hit_tokens + a.loaded_tokens + a.recomputed_tokens == a.total_tokens
    assert a.log_line().startswith("not run")
