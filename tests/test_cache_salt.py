"""cache_salt without processes: the prefix-cache hash chain, the store's chunk keys, the block pool,
the request schema and the proxy's per-tenant salts and accounting filter.

Each salt roots its own chain: two salts (or a salt and none) never share a block or a chunk key; no
salt gives exactly the hashes and keys of before (pinned in test_block_manager / test_kvstore_keys).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest
from pydantic import ValidationError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.block_manager import BlockManager
from pdserve.engine.sched.hashing import block_hashes, salt_root
from pdserve.engine.sched.request import Request
from pdserve.engine.server.errors import APIError
from pdserve.engine.server.protocol import MAX_CACHE_SALT_CHARS, ChatCompletionRequest, CompletionRequest
from pdserve.kvstore.keys import chunk_keys
from pdserve.proxy.accounting import event_without_kv_accounting, json_without_kv_accounting
from pdserve.proxy.config import ProxyConfig
from pdserve.proxy.inputs import COMPLETIONS, Routing, decode_body, parse_request, prefill_body
from pdserve.proxy.tenants import TenantSalts, load_secret

TOKENS = list(range(1, 10))       # 2 full blocks of 4 + 1 token
# the chain of TOKENS under salt "tenant-a"; pinned so a change of format is noticed
SALTED_GOLDEN = [7089623662302440804, 4729427526325783855]
CROSS_PROCESS = ("import json; from pdserve.engine.sched.hashing import block_hashes, salt_root; "
                 "from pdserve.kvstore.keys import chunk_keys; "
                 "print(json.dumps([block_hashes(list(range(1, 10)), 4, parent=salt_root('tenant-a')), "
                 "chunk_keys(list(range(1, 10)), 4, 'fp', True, cache_salt='tenant-a')]))")


# ---- hashing and keys ---------------------------------------------------------------------------

def test_salted_hashes_and_keys_are_identical_in_another_process():
    here = [block_hashes(TOKENS, 4, parent=salt_root("tenant-a")),
            chunk_keys(TOKENS, 4, "fp", True, cache_salt="tenant-a")]
    assert here[0] == SALTED_GOLDEN
    out = subprocess.run([sys.executable, "-c", CROSS_PROCESS], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "321"})
    assert json.loads(out.stdout) == here


def test_salt_roots_the_block_chain_and_none_keeps_the_old_one():
    documented = hashlib.sha256(b"pdserve-cache-salt\x00tenant-a").digest()[:8]      # hashing's docstring
    assert salt_root("tenant-a") == int.from_bytes(documented, "little")
    plain = block_hashes(TOKENS, 4)
    a, b = (block_hashes(TOKENS, 4, parent=salt_root(s)) for s in ("tenant-a", "tenant-b"))
    assert salt_root(None) is None and block_hashes(TOKENS, 4, parent=salt_root(None)) == plain
    assert len(a) == len(b) == 2
    assert not set(a) & set(b) and not set(a) & set(plain)          # no block shared, from block 0 on
    assert salt_root("é\ud800") != salt_root("é")                   # any str hashes, lone surrogates too
    with pytest.raises(ValueError, match="non-empty"):
        salt_root("")


def test_salt_roots_the_chunk_keys_as_documented():
    root = hashlib.sha256(b"pdserve-kv-root" + b"fp").digest()
    salted = hashlib.sha256(b"pdserve-kv-salt" + root + b"tenant-a").digest()
    k0 = hashlib.sha256(salted + struct.pack("<2q", 1, 2)).digest()
    assert chunk_keys([1, 2, 3], 2, "fp", cache_salt="tenant-a") == [k0.hex()[:32]]
    plain = chunk_keys(TOKENS, 4, "fp", include_partial=True)
    assert chunk_keys(TOKENS, 4, "fp", include_partial=True, cache_salt=None) == plain
    a = chunk_keys(TOKENS, 4, "fp", include_partial=True, cache_salt="tenant-a")
    b = chunk_keys(TOKENS, 4, "fp", include_partial=True, cache_salt="tenant-b")
    assert len(a) == 3 and not set(a) & set(b) and not set(a) & set(plain)
    with pytest.raises(ValueError, match="non-empty"):
        chunk_keys(TOKENS, 4, "fp", cache_salt="")


# ---- the block pool -----------------------------------------------------------------------------

def _run(bm: BlockManager, rid: str, salt: str | None) -> int:
    """Admit the 9-token prompt with a prefix lookup, compute it, free it; returns the hit in tokens."""
    req = Request(rid, list(TOKENS), SamplingParams(), eos_token_id=None, arrival_time=0.0, cache_salt=salt)
    blocks, hit = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - hit, blocks)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req, req.num_tokens)
    bm.check_integrity()
    bm.free(req)
    return hit


def test_block_pool_shares_blocks_only_within_one_salt():
    bm = BlockManager(num_blocks=16, block_size=4)
    assert _run(bm, "a1", "tenant-a") == 0
    assert _run(bm, "b1", "tenant-b") == 0          # the same tokens, another tenant: nothing found
    assert _run(bm, "n1", None) == 0                # nor without a salt
    assert _run(bm, "a2", "tenant-a") == 8          # the same salt still hits (2 whole blocks)
    assert _run(bm, "b2", "tenant-b") == 8
    assert _run(bm, "n2", None) == 8                # no salt: as before
    bm.check_integrity()


# ---- the request schema (node and proxy) --------------------------------------------------------

@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_cache_salt_is_a_bounded_non_empty_string(model):
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    assert model.model_validate({**base, "cache_salt": "s" * MAX_CACHE_SALT_CHARS}).cache_salt == "s" * 256
    assert model.model_validate(base).cache_salt is None
    for bad in ("", "s" * (MAX_CACHE_SALT_CHARS + 1), 7):
        with pytest.raises(ValidationError, match="cache_salt"):
            model.model_validate({**base, "cache_salt": bad})


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from pdserve.engine.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama)


def _parse(body: dict, tokenizer):
    return asyncio.run(parse_request(COMPLETIONS, json.dumps(body).encode(), tokenizer, Routing(4, "proxy:t")))


def test_proxy_forwards_the_salt_and_routes_by_it(tokenizer):
    body = {"prompt": "one two three four five six seven eight nine ten", "max_tokens": 3}
    plain, salted = _parse(body, tokenizer), _parse({**body, "cache_salt": "tenant-a"}, tokenizer)
    other = _parse({**body, "cache_salt": "tenant-b"}, tokenizer)
    assert salted.cache_salt == "tenant-a" and plain.cache_salt is None
    assert plain.chunk_keys and not set(plain.chunk_keys) & set(salted.chunk_keys)
    assert not set(salted.chunk_keys) & set(other.chunk_keys)
    assert prefill_body(salted, "m")["cache_salt"] == decode_body(salted, "m", [None])["cache_salt"] == "tenant-a"
    assert "cache_salt" not in prefill_body(plain, "m") and "cache_salt" not in decode_body(plain, "m", [None])
    with pytest.raises(APIError) as info:
        _parse({**body, "cache_salt": ""}, tokenizer)
    assert info.value.status == 400 and "cache_salt" in info.value.message


# ---- the proxy's tenants ------------------------------------------------------------------------

def test_tenant_salts_are_keyed_distinct_and_mix_the_client_salt():
    secret = b"k" * 32
    salts = TenantSalts(("alice-key", "bob-key"), secret)
    alice, bob = salts.salt(0, None), salts.salt(1, None)
    assert alice != bob and len(alice) == 64 and "alice" not in alice
    assert TenantSalts(("alice-key", "bob-key"), secret).salt(0, None) == alice          # stable for a secret
    assert TenantSalts(("alice-key",), b"j" * 32).salt(0, None) != alice                   # keyed by it
    assert salts.salt(0, "x") not in (alice, salts.salt(1, "x"), salts.salt(0, "y"))    # the client's salt mixed in
    assert salts.salt(0, "x") == salts.salt(0, "x")
    with pytest.raises(RuntimeError, match="BearerAuth"):
        salts.salt(None, None)


def test_tenant_config_and_secret_errors_name_the_flag(tmp_path):
    base = dict(prefill_urls=("http://p",), decode_urls=("http://d",), model="m")
    for kwargs, message in ((dict(cache_salt_from_api_key=True), "--cache-salt-from-api-key needs --api-key"),
                            (dict(api_keys=("a", "")), "empty key"),
                            (dict(api_keys=("a",), cache_salt_secret_file="f"), "only used with")):
        with pytest.raises(ValueError, match=message):
            ProxyConfig(**base, **kwargs)
    short = tmp_path / "short"
    short.write_bytes(b"x" * 15)
    short.chmod(0o600)
    with pytest.raises(ValueError, match="--cache-salt-secret-file .* has 15 bytes; need >= 16"):
        load_secret(str(short))
    with pytest.raises(ValueError, match="--cache-salt-secret-file"):
        load_secret(str(tmp_path / "missing"))
    good = tmp_path / "good"
    good.write_bytes(b"y" * 32)
    good.chmod(0o644)                              # a review: whoever reads it computes every tenant's salt
    with pytest.raises(ValueError, match="readable by its owner only"):
        load_secret(str(good))
    good.chmod(0o600)
    assert load_secret(str(good)) == b"y" * 32 and len(load_secret(None)) == 32


# ---- usage.kv_transfer out of public answers ----------------------------------------------------

def test_kv_accounting_is_taken_out_of_answers_and_stream_events():
    usage = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8},
             "kv_transfer": {"decode": {"store_hit_tokens": 8}}}
    answer = json.dumps({"choices": [{"text": 'say "kv_transfer"'}], "usage": usage}).encode()
    stripped = json.loads(json_without_kv_accounting(answer))
    assert stripped["usage"] == {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}
    assert stripped["choices"][0]["text"] == 'say "kv_transfer"'
    event = b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
    out = event_without_kv_accounting(event)
    assert out.endswith(b"\n\n") and json.loads(out[len(b"data: "):])["usage"]["prompt_tokens"] == 9
    assert b"kv_transfer" not in out
    for untouched in (b'data: {"choices": [{"text": "kv_transfer"}]}\n\n', b"data: [DONE]\n\n"):
        assert event_without_kv_accounting(untouched) == untouched
    assert json_without_kv_accounting(b'{"usage": {"prompt_tokens": 1}}') == b'{"usage": {"prompt_tokens": 1}}'
