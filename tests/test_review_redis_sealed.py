"""Review of codec format 3 (FLAG_SEALED), the lean Redis pipeline and their consumers: attacks, real Redis.

Each test is an attack on ``kvstore/codec.py``, ``blob.py`` and ``redis_tier.py`` as merged in 59a7b0f/968761e:
a private redis-server (``own_redis``: may be OOM'd, killed and restarted) or 127.0.0.1:6379 under a unique
prefix, real engines for the end-to-end cases, no mocks. What each one found or showed to hold is in its docstring.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import redis
import torch

from kvstore_fixtures import *  # noqa: F401,F403 - fixtures (own_redis, redis_server)
from kvstore_fixtures import RedisServer, unique_prefix
from pdserve.decode.loader import ChunkLoader
from pdserve.kvstore import codec
from pdserve.kvstore.auth import ClusterKey
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.seal import SEAL_BYTES, seal, sealed_for, unseal
from pdserve.kvstore.tiered import TieredStore

SEAL_KEY = ClusterKey.random().seal_key
SHAPE = (2, 16, 2, 8)                                 # [C, tokens, Hkv, D]
PAYLOAD = codec.HEADER_BYTES + SEAL_BYTES             # where a sealed object's KV bytes start in a stored value


def _sealed(key: str, seed: int = 0, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return seal(key, torch.randn(shape, generator=g).to(torch.bfloat16), SEAL_KEY)[0]


def _loader(store) -> ChunkLoader:
    return ChunkLoader(store, kv_caches=[], first_layer=0, expect_shape=(SHAPE[0], SHAPE[2], SHAPE[3]),
                       health=None, seal_key=SEAL_KEY)


def _flip(client, name: str, offset: int) -> None:
    byte = client.getrange(name, offset, offset)
    client.setrange(name, offset, bytes([byte[0] ^ 1]))


# -- the pipeline: replies matched to their keys whatever Redis answers ------------------------------------------

def test_error_replies_mid_pipeline_leave_the_connection_in_step(own_redis):
    """Holds: a WRONGTYPE in the middle of a read is that key's counted miss (deleted), the keys around it get their
    own objects; an OOM reply in the middle of a write (maxmemory, noeviction) raises once every reply is read, and
    the same pooled connection then answers every later read with the right object."""
    client = own_redis.client()
    tier = RedisTier(own_redis.url, prefix="r:")
    items = [(f"k{i}", _sealed(f"k{i}", seed=i)) for i in range(12)]
    tier.put(items)
    client.delete("r:k5")
    client.hset("r:k5", "planted", "x")
    got = tier.get([k for k, _ in items])
    assert got[5] is None and client.exists("r:k5") == 0
    assert all(torch.equal(g, o) for i, (g, (_, o)) in enumerate(zip(got, items)) if i != 5)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(client.info("memory")["used_memory"] + (256 << 10)))
    big = [(f"b{i}", _sealed(f"b{i}", seed=100 + i, shape=(2, 512, 2, 8))) for i in range(40)]
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        tier.put(big[:20] + items + big[20:])
    client.config_set("maxmemory", "0")
    keys = [k for k, _ in items + big]
    got = tier.get(keys[::-1])
    assert all(g is None or torch.equal(g, o) for g, (_, o) in zip(got, (items + big)[::-1]))
    assert sum(g is not None for g in got) >= len(items) and tier.stats()["redis"]["checksum_failures"] == 1
    tier.close()


def test_a_connection_killed_mid_read_and_a_restarted_redis_leave_the_pool_usable(own_redis):
    """Holds: CLIENT KILL while 8 MiB of replies are in flight raises a ConnectionError (the connection is dropped,
    never reused half read); a redis-server killed and started again on its port is a ConnectionError, then a
    miss, then a round trip of the right objects -- on the same tier object and pool."""
    client = own_redis.client()
    tier = RedisTier(own_redis.url, prefix="r:", timeout_s=5.0)
    big = [(f"z{i}", _sealed(f"z{i}", seed=i, shape=(2, 8192, 2, 16))) for i in range(8)]
    tier.put(big)
    killed = threading.Event()

    def kill_readers():
        while not killed.is_set():
            if any(c.get("cmd") == "getrange" for c in client.client_list()):
                client.client_kill_filter(_type="normal", skipme=True)
                killed.set()

    killer = threading.Thread(target=kill_readers)
    killer.start()
    outcomes = []
    for _ in range(50):
        try:
            got = tier.get([k for k, _ in big])
            outcomes.append(all(torch.equal(g, o) for g, (_, o) in zip(got, big)))
        except redis.ConnectionError:
            outcomes.append("dropped")
        if killed.is_set():
            break
    killed.set()
    killer.join()
    assert killed.is_set() and False not in outcomes   # every read was whole and right, or dropped
    got = tier.get([k for k, _ in big])
    assert all(torch.equal(g, o) for g, (_, o) in zip(got, big))
    own_redis.kill()
    with pytest.raises(redis.ConnectionError):
        tier.get(["z0"])
    again = RedisServer(own_redis.port).start()
    own_redis.proc = again.proc                       # the fixture stops the new process
    assert tier.get(["z0"]) == [None]
    tier.put(big[:2])
    assert all(torch.equal(g, o) for g, (_, o) in zip(tier.get(["z0", "z1"]), big[:2]))
    tier.close()


def test_publisher_and_loader_threads_sharing_one_tier_read_only_their_own_objects(redis_server):
    """Holds: six threads put and read back (in reverse order) 40 keys each, small (joined sends) and large (payload
    sent apart) mixed, 20 generations: every read unseals to the generation that thread just wrote."""
    tier = RedisTier(redis_server.url, prefix=unique_prefix() + ":")
    wrong = []

    def writer_reader(w: int) -> None:
        keys = [f"w{w}-{i}" for i in range(40)]
        for gen in range(20):
            items = [(k, seal(k, torch.full((40 if i % 3 else 80000,), float(gen)), SEAL_KEY)[0])
                     for i, k in enumerate(keys)]
            tier.put(items)
            for k, g in zip(keys[::-1], tier.get(keys[::-1])):
                if g is None or unseal(k, g, SEAL_KEY)[0][0].item() != gen:
                    wrong.append((k, gen))

    threads = [threading.Thread(target=writer_reader, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and tier.stats()["redis"]["hits"] == 6 * 20 * 40
    tier.close()


# -- FLAG_SEALED: what the tier no longer checks, the loader must ------------------------------------------------

@pytest.fixture
def shared_redis():
    client = redis.Redis(port=6379, socket_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis on 127.0.0.1:6379: {exc}")
    prefix = f"pdkv-review-{os.getpid()}-{os.urandom(4).hex()}:"
    yield client, prefix
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def _two_tier_store(prefix: str, disk_dir) -> TieredStore:
    return TieredStore(MemoryTier(64 << 20), [RedisTier("redis://127.0.0.1:6379/0", prefix),
                                              DiskTier(disk_dir, 64 << 20)])


def test_a_payload_byte_flipped_in_redis_does_not_cost_the_good_copy_on_disk(shared_redis, tmp_path):
    """Finding: before format 3 the Redis tier's checksum refused a payload byte changed in Redis, the read went on to
    the disk tier and the load used its intact copy. With FLAG_SEALED the tier hands the changed object out, the
    loader's seal refuses it and deletes the key from every tier -- the disk's good copy too: one flipped byte in
    Redis (an accident the checksum was there for, or a local user without the token) cost every copy and a
    recompute. The loader must discard only the copies that are the refused bytes; the next read finds the disk's."""
    client, prefix = shared_redis
    obj = _sealed("c:0")
    writer = _two_tier_store(prefix, tmp_path / "kv")
    writer.put([("c:0", obj)])
    assert writer.flush(5.0)
    writer.close()
    _flip(client, prefix + "c:0", PAYLOAD + 1000)
    store = _two_tier_store(prefix, tmp_path / "kv")          # a fresh node: empty L1, the same Redis and disk
    loader = _loader(store)
    try:
        with store.borrow(["c:0"]) as objs:
            assert loader.unsealed("c:0", objs[0], SHAPE[1]) is None
        assert loader.integrity_failures == 1 and client.exists(prefix + "c:0") == 0
        with store.borrow(["c:0"]) as objs:
            assert objs[0] is not None and loader.unsealed("c:0", objs[0], SHAPE[1]) is not None
    finally:
        loader.stop()
        store.close()


def test_a_flagged_object_whose_mac_is_garbage_is_refused_counted_and_deleted(shared_redis):
    """Holds: a value planted with FLAG_SEALED whose seal head passes ``sealed_for`` (magic, key hash, length) but
    whose MAC region is junk, or whose payload is another object's of the same length, is handed out by the tier (its
    checksum is over header + seal head, which anyone can compute) and refused by the loader: counted, deleted."""
    client, prefix = shared_redis
    tier = RedisTier("redis://127.0.0.1:6379/0", prefix=prefix)
    good = _sealed("m:0")
    junk_mac = good.clone()
    junk_mac[40:72] = torch.randint(0, 256, (32,), dtype=torch.uint8)
    spliced = good.clone()
    spliced[SEAL_BYTES:] = _sealed("m:0", seed=7)[SEAL_BYTES:]
    for planted in (junk_mac, spliced):
        blob = codec.encode(planted, "none", "m:0", sealed_for)
        assert blob[9] == codec.FLAG_SEALED
        client.set(prefix + "m:0", blob)
        loader = _loader(tier)
        try:
            got = tier.get(["m:0"])[0]
            assert got is not None and loader.unsealed("m:0", got, SHAPE[1]) is None
            assert loader.integrity_failures == 1 and client.exists(prefix + "m:0") == 0
        finally:
            loader.stop()
    tier.close()


def test_a_flagged_object_whose_payload_length_differs_from_its_seal_is_a_counted_miss(shared_redis):
    """Holds: the same seal head with a payload one element longer or shorter (codec header re-made to match, as a
    local user can) fails ``sealed_for``'s length check at decode: a miss at the tier, counted and deleted."""
    client, prefix = shared_redis
    tier = RedisTier("redis://127.0.0.1:6379/0", prefix=prefix)
    good = _sealed("n:0")
    for planted in (torch.cat([good, good[-2:]]), good[:-2]):
        header, payload = codec.encode_parts(planted, "none", "n:0", lambda key, raw: True)   # forced flag
        client.set(prefix + "n:0", header + bytes(payload))
        assert tier.get(["n:0"]) == [None] and client.exists(prefix + "n:0") == 0
    assert tier.stats()["redis"]["checksum_failures"] == 2
    tier.close()


# -- end to end: real engines, the store between them is Redis --------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_llama):
    from hf_reference import hf_model
    return hf_model(tiny_llama)


def test_kv_planted_flagged_in_redis_is_refused_and_recomputed(tiny_llama, reference, redis_server):
    """Holds: forged KV planted the way format 3 writes a sealed object (FLAG_SEALED, so the tier never hashes the
    payload; MAC'd with a key the attacker made up) reaches both loaders and is refused by their seal: the prefill
    node recomputes and publishes the real KV over it, the decode node loads that, both answers are HF's."""
    from forgery import forge_keyed
    from test_kv_forgery import _engine, _plant, _victim
    from hf_reference import random_prompt

    prefix = unique_prefix() + ":"
    raw = redis.Redis(port=redis_server.port)
    prompt = random_prompt(reference.config.vocab_size, 70, seed=31)
    probe = _engine(tiny_llama, "both", TieredStore(MemoryTier(1 << 20)))
    planted = _plant(probe, prompt, lambda k, obj: raw.set(prefix + k, codec.encode(obj, "none", k, sealed_for)),
                     forge_keyed)
    probe.shutdown()
    assert all(raw.getrange(prefix + k, 9, 9) == b"\x01" for k in planted)
    stores = [TieredStore(MemoryTier(64 << 20), [RedisTier(redis_server.url, prefix)]) for _ in range(2)]
    try:
        loader, pacc, dacc = _victim(tiny_llama, reference, prompt, *stores)
    finally:
        for store in stores:
            store.close()
    assert loader.integrity_failures == 1 and pacc["loaded_tokens"] == 0 and dacc["loaded_tokens"] > 0


def test_a_payload_flipped_in_redis_between_publish_and_load_is_recomputed(tiny_llama, reference, redis_server):
    """Holds: the prefill node publishes (write-through to Redis); one payload byte of a published object is changed
    in Redis; a decode node with its own L1 loads the request: its seal refuses that object (counted, discarded),
    the chunks after it are recomputed, the answer is HF's, and a second decode of the same prompt is too."""
    from engine_run import run_request
    from forgery import victim_keys
    from hf_reference import hf_greedy, random_prompt
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kvstore.keys import object_key
    from test_kv_forgery import _engine

    prefix = unique_prefix() + ":"
    raw = redis.Redis(port=redis_server.port)
    prompt = random_prompt(reference.config.vocab_size, 70, seed=32)
    pstore = TieredStore(MemoryTier(64 << 20), [RedisTier(redis_server.url, prefix)])
    dstore = TieredStore(MemoryTier(64 << 20), [RedisTier(redis_server.url, prefix)])
    prefill, decode = _engine(tiny_llama, "prefill", pstore), _engine(tiny_llama, "decode", dstore)
    try:
        _, out = run_request(prefill, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                             {"do_remote_decode": True})
        assert pstore.flush(10.0)
        victim = object_key(victim_keys(prompt, 32, prefill.connector.fingerprint)[1], 0)   # chunk 1, layer 0
        _flip(raw, prefix + victim, PAYLOAD + 7)
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        tokens, dout = run_request(decode, "d", prompt, greedy, out.kv_transfer_params)
        assert tokens == hf_greedy(reference, prompt, 8)
        assert decode.connector.loader.integrity_failures == 1 and raw.exists(prefix + victim) == 0
        assert 0 < dout.kv_accounting["loaded_tokens"] <= 32           # chunk 0 loaded, the rest recomputed
        again, _ = run_request(decode, "d2", prompt, greedy, out.kv_transfer_params)
        assert again == tokens
    finally:
        prefill.shutdown()
        decode.shutdown()
        pstore.close()
        dstore.close()


@contextlib.contextmanager
def flipped_in_redis(redis_server, tmp_path, obj: torch.Tensor, cpu_bytes: int):
    """A daemon (Redis and disk tiers) that stored ``obj`` as ``c:0``, started again (L1 empty) once Redis's copy had
    a payload byte flipped; the disk's copy is intact. -> (the daemon, a Redis client, the daemon's Redis prefix)."""
    from kvstore_fixtures import TOKEN, DaemonProcess, wait_for
    from pdserve.kvstore.client import DaemonClient

    prefix = unique_prefix() + ":"
    raw = redis.Redis(port=redis_server.port)
    flags = ("--kv-cpu-bytes", str(cpu_bytes), "--kv-redis", redis_server.url, "--kv-redis-prefix", prefix,
             "--kv-disk-dir", str(tmp_path / "kv"), "--log-level", "ERROR")
    daemon = DaemonProcess(*flags, token=TOKEN)
    try:
        with DaemonClient(daemon.url, token=TOKEN, timeout_s=20) as client:
            client.put([("c:0", obj)])
        wait_for(lambda: raw.exists(prefix + "c:0") and list((tmp_path / "kv").glob("*.kv")), what="write-through")
    finally:
        daemon.stop()
    _flip(raw, prefix + "c:0", PAYLOAD + 1000)
    daemon = DaemonProcess(*flags, token=TOKEN)                 # empty L1: the read goes to Redis
    try:
        yield daemon, raw, prefix
    finally:
        raw.close()
        daemon.stop()


def test_through_a_daemon_a_payload_flipped_in_redis_does_not_cost_the_disk_copy(redis_server, tmp_path):
    """Finding (the daemon's half of the one above): a node loading through ``--kv-store tcp://`` refused the object
    the daemon read from Redis and sent Delete: the daemon removed every copy, the intact one on its disk too. Now
    the client sends Discard with the refused bytes' digest; the daemon keeps the disk's copy, the next get has it.
    (The daemon answers the Discard once its write-through worker removed Redis's copy: kvstore/tiered.py.)"""
    from kvstore_fixtures import TOKEN
    from pdserve.kvstore.client import DaemonClient

    obj = _sealed("c:0")
    with flipped_in_redis(redis_server, tmp_path, obj, 64 << 20) as (daemon, raw, prefix):
        with DaemonClient(daemon.url, token=TOKEN, timeout_s=20) as client:
            loader = _loader(client)
            try:
                with client.borrow(["c:0"]) as objs:
                    assert loader.unsealed("c:0", objs[0], SHAPE[1]) is None
                assert loader.integrity_failures == 1 and raw.exists(prefix + "c:0") == 0
                with client.borrow(["c:0"]) as objs:
                    assert objs[0] is not None and torch.equal(objs[0], obj)
            finally:
                loader.stop()
