"""Chunk keys: deterministic across processes, chained, salted, partial chunks."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from pdserve.kvstore.keys import check_key, chunk_keys, model_fingerprint, object_key

FP = model_fingerprint("LlamaForCausalLM", "sha256:abc", "bfloat16", "mha:kv_heads=8:head_dim=128", 1)
TOKENS = list(range(1000, 1000 + 600))
SCRIPT = ("import json,sys; from pdserve.kvstore.keys import chunk_keys, model_fingerprint;"
          "fp = model_fingerprint('LlamaForCausalLM','sha256:abc','bfloat16','mha:kv_heads=8:head_dim=128',1);"
          "print(json.dumps(chunk_keys(list(range(1000,1600)), 256, fp, True)))")


def test_keys_are_identical_in_another_process():
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == chunk_keys(TOKENS, 256, FP, include_partial=True)


def test_keys_follow_the_documented_chain():
    # Changing these values changes every stored key: bump KEY_FORMAT_VERSION when it must.
    root = hashlib.sha256(b"pdserve-kv-root" + b"fp").digest()
    k0 = hashlib.sha256(root + struct.pack("<2q", 1, 2)).digest()
    k1 = hashlib.sha256(k0 + struct.pack("<2q", 3, 4)).digest()
    assert chunk_keys([1, 2, 3, 4], 2, "fp") == [k0.hex()[:32], k1.hex()[:32]]
    assert chunk_keys([1, 2, 3, 4], 2, "fp") == ["bdb78aaa93ff105c1ade9c2fdf9023c6", "e7c687257c21d9c2030f3a19a90693f1"]


def test_chain_shares_prefixes_and_depends_on_history():
    a = chunk_keys(TOKENS, 256, FP)
    b = chunk_keys(TOKENS[:512] + [7] * 256, 256, FP)
    c = chunk_keys([0] + TOKENS[1:], 256, FP)
    assert len(a) == 2 and a == b[:2]
    assert c[1] != a[1]                               # same chunk-1 tokens, different parent
    assert len(set(a)) == 2 and all(len(k) == 32 for k in a)


def test_partial_chunk_only_when_asked_and_distinct():
    assert len(chunk_keys(TOKENS, 256, FP)) == 2
    keys = chunk_keys(TOKENS, 256, FP, include_partial=True)
    assert len(keys) == 3
    assert chunk_keys(TOKENS[:530], 256, FP, True)[2] != keys[2]
    assert chunk_keys(TOKENS[:100], 256, FP) == []


def test_fingerprint_salts_every_key():
    other = model_fingerprint("LlamaForCausalLM", "sha256:abc", "float16", "mha:kv_heads=8:head_dim=128", 1)
    assert other != FP
    assert set(chunk_keys(TOKENS, 256, FP)).isdisjoint(chunk_keys(TOKENS, 256, other))


def test_object_keys_and_validation():
    assert object_key("ab12", 3) == "ab12:3" and check_key("ab12:3") == "ab12:3"
    with pytest.raises(ValueError, match="layer"):
        object_key("ab12", -1)
    with pytest.raises(ValueError, match="--kv-chunk-tokens"):
        chunk_keys(TOKENS, 0, FP)
    with pytest.raises(ValueError, match="int64"):
        chunk_keys([2**63], 1, FP)


@pytest.mark.parametrize("bad", ["ab12:3\n", "\n", "", "a" * 201, "a/b", "a\nb", "a b"])
def test_check_key_refuses_any_character_outside_the_set_a_trailing_newline_too(bad):
    """``^...$`` with ``match`` let "ab12:3\\n" through ("$" matches before a final newline)."""
    with pytest.raises(ValueError, match="invalid store key"):
        check_key(bad)
