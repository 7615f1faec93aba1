"""One contract suite, every KVStore: memory, redis, disk, tiered, daemon over TCP and shm.

Fault injection: corrupted/truncated objects in Redis and on disk are counted misses
and deleted (test_corrupt_object_is_a_counted_miss); Redis killed under load lives in
test_kvstore_tiers.py; malformed daemon frames in test_kvstore_daemon.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures
from kvstore_fixtures import unique_prefix
from pdserve.kvstore.client import DaemonClient
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.keys import object_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.tiered import TieredStore

IMPLS = ["memory", "redis", "disk", "tiered", "daemon_tcp", "daemon_shm"]


@dataclass
class Harness:
    store: object
    corrupt: Callable[[str, str], list[str]] | None = None   # (key, how) -> tiers that count it
    no_corrupt_reason: str = ""


def _corrupt_bytes(blob: bytes, how: str) -> bytes:
    if how == "flip":
        return blob[:-1] + bytes([blob[-1] ^ 0x01])
    if how == "truncate":
        return blob[: len(blob) - 7]
    return b"XXXX" + blob[4:]          # bad magic


def _redis_corrupter(tier: RedisTier, raw):
    def corrupt(key: str, how: str) -> list[str]:
        raw.set(tier.prefix + key, _corrupt_bytes(raw.get(tier.prefix + key), how))
        return ["redis"]
    return corrupt


def _disk_corrupter(tier: DiskTier):
    def corrupt(key: str, how: str) -> list[str]:
        path = tier.path_of(key)
        path.write_bytes(_corrupt_bytes(path.read_bytes(), how))
        return ["disk"]
    return corrupt


@pytest.fixture(params=IMPLS)
def harness(request, redis_server, tmp_path):
    kind = request.param
    raw = redis_server.client()
    if kind == "memory":
        h = Harness(MemoryTier(64 << 20), no_corrupt_reason="the memory tier keeps tensors, not bytes")
    elif kind == "redis":
        tier = RedisTier(redis_server.url, prefix=unique_prefix() + ":")
        h = Harness(tier, _redis_corrupter(tier, raw))
    elif kind == "disk":
        tier = DiskTier(tmp_path / "disk", 64 << 20, codec_name="lz4")
        h = Harness(tier, _disk_corrupter(tier))
    elif kind == "tiered":
        h = _tiered_harness(redis_server, raw, tmp_path)
    else:
        url = request.getfixturevalue("daemon").url
        client = DaemonClient(url, shm_bytes=(8 << 20) if kind == "daemon_shm" else 0, timeout_s=20)
        h = Harness(client, no_corrupt_reason="the daemon serves a TieredStore; its byte tiers run under 'tiered'")
    yield h
    h.store.close()
    raw.close()


def _tiered_harness(redis_server, raw, tmp_path) -> Harness:
    l2 = RedisTier(redis_server.url, prefix=unique_prefix() + ":", codec_name="lz4")
    l3 = DiskTier(tmp_path / "l3", 64 << 20)
    store = TieredStore(MemoryTier(64 << 20), [l2, l3])

    def corrupt(key: str, how: str) -> list[str]:
        assert store.flush()
        _redis_corrupter(l2, raw)(key, how)
        _disk_corrupter(l3)(key, how)
        store.l1.delete([key])
        return ["redis", "disk"]
    return Harness(store, corrupt)


def _tensors(n: int, dtype=torch.float32, shape=(2, 4, 8)) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    prefix = unique_prefix()
    return [(object_key(f"{prefix}{i}", 0), torch.randn(shape, generator=g).to(dtype)) for i in range(n)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_identical(harness, dtype):
    items = _tensors(3, dtype)
    items.append((unique_prefix() + ":0", torch.tensor([float("nan"), -0.0, float("inf")]).to(dtype)))
    harness.store.put(items)
    got = harness.store.get([k for k, _ in items])
    for (_, want), have in zip(items, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(_bits(have), _bits(want))


def test_missing_keys_are_none_in_order(harness):
    items = _tensors(2)
    harness.store.put(items)
    got = harness.store.get([items[1][0], "absent:0", items[0][0]])
    assert torch.equal(got[0], items[1][1]) and got[1] is None and torch.equal(got[2], items[0][1])
    assert harness.store.contains([items[0][0], "absent:0"]) == [True, False]


def test_lookup_counts_leading_chunks_with_every_layer(harness):
    chunks, layers = [unique_prefix() for _ in range(4)], 3
    t = torch.ones(2, 2)
    present = [(c, layer) for c in chunks for layer in range(layers) if not (c == chunks[1] and layer == 2)]
    harness.store.put([(object_key(c, layer), t) for c, layer in present])
    assert harness.store.lookup(chunks, layers) == 1
    assert harness.store.lookup(chunks[:1], layers) == 1
    assert harness.store.lookup([], layers) == 0
    assert harness.store.lookup(chunks[2:], layers) == 2


def test_delete_removes_and_tolerates_absent(harness):
    items = _tensors(2)
    harness.store.put(items)
    harness.store.delete([items[0][0], "never-stored:0"])
    assert harness.store.get([items[0][0]]) == [None]
    assert harness.store.contains([k for k, _ in items]) == [False, True]


def test_overwrite_returns_latest(harness):
    key = unique_prefix() + ":0"
    harness.store.put([(key, torch.zeros(4))])
    harness.store.put([(key, torch.ones(4))])
    assert torch.equal(harness.store.get([key])[0], torch.ones(4))


def test_caller_owns_inputs_and_outputs(harness):
    key, src = unique_prefix() + ":0", torch.arange(6.0).reshape(2, 3)
    harness.store.put([(key, src.t())])                 # non-contiguous input
    src.zero_()
    first = harness.store.get([key])[0]
    first.fill_(-1)
    with harness.store.borrow([key]) as borrowed:
        assert torch.equal(borrowed[0], torch.arange(6.0).reshape(2, 3).t())
    assert torch.equal(harness.store.get([key])[0], torch.arange(6.0).reshape(2, 3).t())


def test_empty_batches_and_large_batch(harness):
    harness.store.put([])
    assert harness.store.get([]) == [] and harness.store.contains([]) == []
    items = _tensors(300, shape=(16,))
    harness.store.put(items)
    got = harness.store.get([k for k, _ in items])
    assert all(torch.equal(a, b) for (_, a), b in zip(items, got))


@pytest.mark.parametrize("bad", ["", "a b", "../etc/passwd", "x" * 201])
def test_invalid_keys_are_rejected(harness, bad):
    with pytest.raises(ValueError, match="invalid store key"):
        harness.store.put([(bad, torch.zeros(1))])
    with pytest.raises(ValueError, match="invalid store key"):
        harness.store.get([bad])


def test_stats_are_counters_per_tier(harness):
    items = _tensors(1)
    harness.store.put(items)
    harness.store.get([items[0][0], "absent:0"])
    stats = harness.store.stats()
    assert stats and all(isinstance(v, int) for counters in stats.values() for v in counters.values())
    first_tier = next(iter(stats.values()))
    assert first_tier["hits"] >= 1 and first_tier["misses"] >= 1


@pytest.mark.parametrize("how", ["flip", "truncate", "magic"])
def test_corrupt_object_is_a_counted_miss(harness, how):
    if harness.corrupt is None:
        pytest.skip(harness.no_corrupt_reason)
    items = _tensors(2)
    harness.store.put(items)
    before = harness.store.stats()
    tiers = harness.corrupt(items[0][0], how)
    assert harness.store.get([k for k, _ in items])[0] is None
    after = harness.store.stats()
    for tier in tiers:
        assert after[tier]["checksum_failures"] == before[tier]["checksum_failures"] + 1
    assert harness.store.contains([items[0][0]]) == [False]      # deleted
    assert torch.equal(harness.store.get([items[1][0]])[0], items[1][1])
