"""The Redis tier's framed SETs (kvstore/redis_wire.py) and many-object reads, against a private redis-server.

A put of uncompressed objects writes each SET's RESP itself, the payload sent from the
tensor's memory: the framing must equal hiredis's packing byte for byte, and every value in Redis must be exactly
the codec's blob, TTL included, on both sides of SEND_APART and PACK_JOIN. A read of many objects refuses only the
corrupt ones (counted, deleted); the rest load bit-identical, a format 2 object among them included.
"""

from __future__ import annotations

import hiredis
import pytest
import torch

from pdserve.kvstore import codec, redis_wire
from pdserve.kvstore.auth import ClusterKey
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.seal import SEAL_BYTES, seal, sealed_for

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures (redis_server)
from kvstore_fixtures import unique_prefix

SEAL_KEY = ClusterKey.random().seal_key
SIZES = [0, 1, 200, redis_wire.SEND_APART - 1, redis_wire.SEND_APART, 64 << 10, 3 << 20]  # bytes


@pytest.fixture
def tier(redis_server):
    """(url, prefix, client) on the session's private redis-server (kvstore_fixtures)."""
    client = redis_server.client()
    yield redis_server.url, unique_prefix() + ":", client
    client.close()


def _plain(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _sealed(key: str, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return seal(key, torch.randn(max(nbytes - SEAL_BYTES, 0) // 2, generator=g).to(torch.bfloat16), SEAL_KEY)[0]


@pytest.mark.parametrize("ttl_s", [None, 7, 86400])
def test_set_frames_equal_hiredis_packing(ttl_s):
    """Catches: a length counted in elements not bytes, a missing CRLF, EX framed wrong -- Redis would read the next
    command's bytes as this value (or refuse the pipeline)."""
    sets, commands = [], []
    for i, size in enumerate(SIZES + [3 * redis_wire.PACK_JOIN]):
        key, tensor = f"pre:k{i}:0", _plain(size, i).view(torch.uint8)
        header, payload = codec.encode_parts(tensor, "none", f"k{i}:0")
        sets.append((key.encode(), header, payload))
        commands.append(("SET", key, header + bytes(payload)) + (() if ttl_s is None else ("EX", ttl_s)))
    frames = redis_wire.set_frames(sets, ttl_s)
    assert b"".join(bytes(f) for f in frames) == b"".join(hiredis.pack_command(c) for c in commands)
    assert any(isinstance(f, memoryview) for f in frames)             # large payloads leave from their own memory


@pytest.mark.parametrize("ttl_s", [None, 600])
def test_every_value_is_the_codecs_blob_across_the_frame_sizes(tier, ttl_s):
    url, prefix, client = tier
    store = RedisTier(url, prefix=prefix, ttl_s=ttl_s)
    items = [(f"p{i}:0", _plain(size, i)) for i, size in enumerate(SIZES)]
    items += [(f"s{i}:0", _sealed(f"s{i}:0", size, i)) for i, size in enumerate(SIZES) if size >= SEAL_BYTES]
    items += [("bf:0", torch.randn(3, 5, 7).to(torch.bfloat16)), ("big:0", torch.randn(1 << 20))]
    store.put(items)
    for key, tensor in items:
        assert client.get(prefix + key) == codec.encode(tensor, "none", key, sealed_for), key
        assert client.ttl(prefix + key) == (-1 if ttl_s is None else pytest.approx(ttl_s, abs=5)), key
    got = store.get([k for k, _ in items])
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, items))
    assert store.stats()["redis"]["bytes_in"] == sum(len(codec.encode(t, "none", k, sealed_for)) for k, t in items)
    store.close()


def test_corrupt_objects_among_many_in_one_read_are_refused_the_rest_bit_identical(tier):
    """One read of 64 sealed 64 KiB objects: a header byte flipped in one, a seal-head byte in another, a third
    replaced by a format 2 object (an older node's): two counted misses, deleted; 62 objects bit-identical."""
    url, prefix, client = tier
    store = RedisTier(url, prefix=prefix)
    items = [(f"m{i}:0", _sealed(f"m{i}:0", 64 << 10, i)) for i in range(64)]
    store.put(items)
    for name, offset in ((prefix + "m10:0", 20), (prefix + "m40:0", codec.HEADER_BYTES + 50)):
        byte = client.getrange(name, offset, offset)
        client.setrange(name, offset, bytes([byte[0] ^ 0x10]))
    old = torch.randn(4, 8).to(torch.bfloat16)
    client.set(prefix + "m63:0", _as_format_2(codec.encode(old, "none", "m63:0")))
    got = store.get([k for k, _ in items])
    assert got[10] is None and got[40] is None and torch.equal(got[63], old)
    assert all(torch.equal(got[i], t) for i, (_, t) in enumerate(items) if i not in (10, 40, 63))
    stats = store.stats()["redis"]
    assert (stats["checksum_failures"], stats["hits"], stats["misses"]) == (2, 62, 2)
    assert client.exists(prefix + "m10:0", prefix + "m40:0") == 0 and client.exists(prefix + "m63:0") == 1
    store.close()


def _as_format_2(blob: bytes) -> bytes:
    """``blob`` as a format 2 writer made it: version 2, byte 9 zero, the checksum over the header and payload."""
    b = bytearray(blob)
    b[4:6], b[9] = (2).to_bytes(2, "little"), 0
    b[100:108] = codec._checksum(bytes(b[:100]), bytes(b[codec.HEADER_BYTES:])).to_bytes(8, "little")
    return bytes(b)
