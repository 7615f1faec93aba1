"""Sealed objects in the Redis tier (real Redis on 127.0.0.1:6379): their payload is checked once, by the loader's MAC.

The codec writes a sealed object laid out for its key with FLAG_SEALED: its checksum covers the header and the
seal head only, so neither put nor get hashes the payload. What the checksum no longer sees -- a payload byte
changed inside Redis -- the loader's seal does: ``ChunkLoader.unsealed`` refuses it, counts it and deletes it. A
byte changed in the header or the seal head, another key's object, a short value, and any object that is not sealed
(full checksum) stay a counted miss at the tier, deleted. Each case is a byte flipped in Redis with SETRANGE.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.decode.loader import ChunkLoader
from pdserve.kvstore import codec
from pdserve.kvstore.auth import ClusterKey
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.seal import SEAL_BYTES, seal

REDIS = "redis://127.0.0.1:6379/0"
SEAL_KEY = ClusterKey.random().seal_key
SHAPE = (2, 16, 2, 8)                                # an object: [C, tokens, Hkv, D]
PAYLOAD = codec.HEADER_BYTES + SEAL_BYTES            # where a sealed object's KV bytes start in the Redis value


def _sealed(key: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return seal(key, torch.randn(SHAPE, generator=g).to(torch.bfloat16), SEAL_KEY)[0]


@pytest.fixture
def tier():
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(REDIS, socket_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis on 127.0.0.1:6379: {exc}")
    prefix = f"pdkv-sealed-{os.getpid()}-{os.urandom(4).hex()}:"
    store = RedisTier(REDIS, prefix=prefix)
    yield store, client, prefix
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    store.close()
    client.close()


def _flip(client, name: str, offset: int) -> None:
    byte = client.getrange(name, offset, offset)
    client.setrange(name, offset, bytes([byte[0] ^ 1]))


def _loader(store) -> ChunkLoader:
    return ChunkLoader(store, kv_caches=[], first_layer=0, expect_shape=(SHAPE[0], SHAPE[2], SHAPE[3]),
                       health=None, seal_key=SEAL_KEY)


def test_a_sealed_object_is_stored_flagged_and_read_back_bit_identical(tier):
    store, client, prefix = tier
    small, large = _sealed("s:0"), seal("l:0", torch.randn(64, 1024, dtype=torch.float32), SEAL_KEY)[0]
    plain = torch.randn(SHAPE).to(torch.bfloat16)
    store.put([("s:0", small), ("l:0", large), ("p:0", plain)])     # l:0's payload sent apart, s:0 and p:0 joined
    assert [client.getrange(prefix + k, 9, 9) for k in ("s:0", "l:0", "p:0")] == [b"\x01", b"\x01", b"\x00"]
    got = store.get(["s:0", "l:0", "p:0"])
    assert torch.equal(got[0], small) and torch.equal(got[1], large) and torch.equal(got[2], plain)
    assert store.stats()["redis"]["checksum_failures"] == 0


def test_a_payload_byte_flipped_in_redis_is_refused_by_the_loaders_seal(tier):
    """Mutation caught: FLAG_SEALED's checksum skips the payload -- without the MAC this object would be scattered."""
    store, client, prefix = tier
    store.put([("c:0", _sealed("c:0"))])
    _flip(client, prefix + "c:0", PAYLOAD + 1000)
    got = store.get(["c:0"])[0]
    assert got is not None and store.stats()["redis"]["checksum_failures"] == 0   # the tier no longer hashes it
    loader = _loader(store)
    try:
        assert loader.unsealed("c:0", got, SHAPE[1]) is None
        assert loader.integrity_failures == 1
    finally:
        loader.stop()
    assert client.exists(prefix + "c:0") == 0                                     # the loader deleted it
    store.put([("c:0", _sealed("c:0"))])
    assert _loader_accepts(store, "c:0")


def _loader_accepts(store, key: str) -> bool:
    loader = _loader(store)
    try:
        return loader.unsealed(key, store.get([key])[0], SHAPE[1]) is not None
    finally:
        loader.stop()


@pytest.mark.parametrize("offset", [4, 9, 20, 84, codec.HEADER_BYTES + 3, codec.HEADER_BYTES + 40,
                                    codec.HEADER_BYTES + 100], ids=["version", "flags", "shape", "length",
                                                                    "seal-magic", "seal-mac", "seal-pad"])
def test_a_header_or_seal_head_byte_flipped_in_redis_is_a_counted_miss(tier, offset):
    store, client, prefix = tier
    store.put([("c:0", _sealed("c:0")), ("d:0", _sealed("d:0", seed=1))])
    _flip(client, prefix + "c:0", offset)
    got = store.get(["c:0", "d:0"])
    assert got[0] is None and torch.equal(got[1], _sealed("d:0", seed=1))
    assert store.stats()["redis"]["checksum_failures"] == 1 and client.exists(prefix + "c:0") == 0


def test_another_keys_sealed_object_a_cut_one_and_an_unsealed_one_are_counted_misses(tier):
    store, client, prefix = tier
    plain = torch.randn(SHAPE).to(torch.bfloat16)
    store.put([("a:0", _sealed("a:0")), ("b:0", _sealed("b:0")), ("p:0", plain), ("q:0", _sealed("q:0"))])
    client.copy(prefix + "b:0", prefix + "a:0", replace=True)          # b's intact object under a's key
    _flip(client, prefix + "p:0", codec.HEADER_BYTES + 500)             # not sealed: its payload is checksummed
    client.set(prefix + "q:0", client.getrange(prefix + "q:0", 0, PAYLOAD + 99))   # a short value
    assert store.get(["a:0", "p:0", "q:0", "b:0"])[:3] == [None, None, None]
    s = store.stats()["redis"]
    assert (s["key_mismatch"], s["checksum_failures"], s["hits"]) == (1, 2, 1)
    assert client.exists(prefix + "a:0", prefix + "p:0", prefix + "q:0") == 0


def test_a_flag_set_on_an_object_that_is_not_sealed_is_refused(tier):
    """An object laid out as sealed but written without the flag reads back; one flagged but not sealed for its key
    (another key's seal under this key, re-flagged and re-checksummed as a writer without the check would) does not."""
    store, client, prefix = tier
    other = _sealed("x:0")
    client.set(prefix + "y:0", codec.encode(other, "none", "y:0"))     # no sealed_for: written unflagged
    assert torch.equal(store.get(["y:0"])[0], other)
    flagged = codec.encode(other, "none", "y:0", sealed_for=lambda key, payload: True)
    assert flagged[9] == codec.FLAG_SEALED
    client.set(prefix + "y:0", flagged)
    assert store.get(["y:0"]) == [None] and store.stats()["redis"]["checksum_failures"] == 1


def test_a_planted_value_past_the_bound_is_read_cut_and_is_a_counted_miss(tier):
    """The read bound: a value longer than any object this tier stores (a sealed object's valid header, then junk)
    comes back cut at ``max_blob_bytes`` + 1 bytes, never whole, and is refused, counted and deleted."""
    _, client, prefix = tier
    store = RedisTier(REDIS, prefix=prefix, max_object_bytes=4096)
    try:
        obj = seal("big:0", torch.arange(960, dtype=torch.float32), SEAL_KEY)[0]     # 3968 bytes: fits
        store.put([("big:0", obj), ("ok:0", obj[:0].new_zeros(16))])
        client.append(prefix + "big:0", b"\xab" * (1 << 20))                       # a local user makes it 1 MiB
        assert [len(b or b"") for b in store._read(["big:0"])] == [store.max_blob_bytes + 1]
        assert store.get(["big:0", "ok:0"])[0] is None
        assert store.stats()["redis"]["checksum_failures"] == 1 and client.exists(prefix + "big:0") == 0
    finally:
        store.close()
