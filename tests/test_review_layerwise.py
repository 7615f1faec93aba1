"""Review of --kv-load-layerwise (``decode/layerwise.py``): reproductions of what the review found, each with a
real embedded store and a tiny model; each failed before its fix."""

from __future__ import annotations

import pytest

from engine_run import run_request
from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(model_dir, role, store, layerwise=False, chunk=16, budget=2048):
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=chunk,
                                                    kv_load_layerwise=layerwise))
    return LLMEngine(cfg, store=store)


@pytest.fixture()
def store():
    s = TieredStore(MemoryTier(256 << 20))
    yield s
    s.close()


def _prefill(model, store, prompt, rid="p", chunk=16, sp=None):
    import dataclasses

    engine = _engine(model, "prefill", store, chunk=chunk)
    sp = SamplingParams(max_tokens=1, **GREEDY) if sp is None else dataclasses.replace(sp, max_tokens=1)
    _, out = run_request(engine, rid, prompt, sp, {"do_remote_decode": True})
    engine.shutdown()
    return out.kv_transfer_params


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from pdserve.engine.checkpoints.tiny_deepseek import make_tiny_deepseek

    path = make_tiny_deepseek(tmp_path_factory.mktemp("ds") / "v3", "deepseek_v3", seed=4, num_layers=2,
                              q_lora_rank=24)
    return path, hf_model(path)


def test_a_latent_cache_model_loads_layerwise(deepseek, store):
    """An MLA model's cache layers are {"latent": ...}, not {"k", "v"}: before the fix ``start_layers`` looked up
    ``kv_caches[0]["k"]`` (KeyError), so every step with a layerwise load failed its requests -- and the load stayed
    queued, so every later step failed too."""
    model, ref = deepseek
    prompt = random_prompt(ref.config.vocab_size, 77, seed=11)
    params = _prefill(model, store, prompt, chunk=32)
    lw = _engine(model, "decode", store, layerwise=True, chunk=32)
    tokens, out = run_request(lw, "d", prompt, SamplingParams(max_tokens=6, **GREEDY), params)
    assert out.finish_reason == "length" and tokens == hf_greedy(ref, prompt, 6)
    assert out.kv_accounting["loaded_tokens"] == 72 and lw.connector.layerwise_batches == 1
    tokens, out = run_request(lw, "d2", prompt, SamplingParams(max_tokens=3, **GREEDY), params)
    assert out.finish_reason == "length" and tokens == hf_greedy(ref, prompt, 3)
    lw.shutdown()


# -- what held up: a failed layerwise load leaves no trace in what the client gets -------------------------------

def _lose_after_lookup(store, key, lookups=1):
    """The store answers ``lookups`` lookups, then ``key`` is gone (evicted, deleted): the loads fail mid-step."""
    real, seen = store.lookup, []

    def lookup(chunk_keys, num_layers):
        n = real(chunk_keys, num_layers)
        seen.append(n)
        if len(seen) == lookups:
            store.delete([key])
        return n

    store.lookup = lookup


def _decode(tiny_llama, prompt, sp, layerwise, lose=None, budget=2048):
    """A fresh store, a prefill node's KV in it, one decode request; ``lose``: (chunk, layer) lost after lookup."""
    from pdserve.kvstore.keys import object_key

    s = TieredStore(MemoryTier(256 << 20))
    params = _prefill(tiny_llama, s, prompt, sp=sp)
    if lose is not None:
        _lose_after_lookup(s, object_key(params["chunk_keys"][lose[0]], lose[1]))
    engine = _engine(tiny_llama, "decode", s, layerwise=layerwise, budget=budget)
    outs = []
    engine.add_request("d", prompt, sp, params)
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == "d"]
    failures = engine.connector.loader.failures
    engine.shutdown()
    s.close()
    return outs, failures


def _stream(outs):
    """Every delta as the client sees it, and the final one's cached tokens (its kv_transfer accounting differs by
    design: a chunk-major load keeps the chunks before the bad one, a layerwise one keeps none)."""
    return [(o.new_token_ids, o.logprobs, o.finished, o.finish_reason) for o in outs] + [outs[-1].num_cached_tokens]


@pytest.mark.parametrize("budget", [2048, 4])
def test_a_failed_load_streams_what_the_chunk_major_path_does(tiny_llama, budget):
    """Seeded sampling with penalties and logprobs, a small token budget (the tail spread over steps): a layerwise
    load that fails streams, delta for delta, what a chunk-major decode whose load failed the same way streams
    (no delta of the dropped step; the seeded draw counter, output counts and logprobs as if it never ran)."""
    ref = hf_model(tiny_llama)
    prompt = random_prompt(ref.config.vocab_size, 61, seed=31)
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=7, repetition_penalty=1.3, frequency_penalty=0.5,
                        logprobs=3, ignore_eos=True)
    want, f0 = _decode(tiny_llama, prompt, sp, layerwise=False, lose=(2, 1), budget=budget)
    got, f1 = _decode(tiny_llama, prompt, sp, layerwise=True, lose=(2, 1), budget=budget)
    assert f0 == f1 == 1
    assert _stream(got) == _stream(want) and len([t for o in got for t in o.new_token_ids]) == 8
    acc = got[-1].kv_accounting
    assert acc["loaded_tokens"] == 0 and acc["recomputed_tokens"] == acc["total_tokens"] == 62


def test_a_failed_load_of_a_structured_request_streams_what_the_chunk_major_path_does(tiny_llama):
    """A regex constraint, seeded: the dropped step's token never reached the grammar (the matcher is not advanced
    by it), so the constrained stream equals the chunk-major decode's."""
    pytest.importorskip("xgrammar")
    from pdserve.engine.structured.spec import StructuredOutputs

    ref = hf_model(tiny_llama)
    prompt = random_prompt(ref.config.vocab_size, 61, seed=39)
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                        structured=StructuredOutputs(regex=r"[a-z]{2,6}@[a-z]{2,5}\\.(com|org)"))
    want, f0 = _decode(tiny_llama, prompt, sp, layerwise=False, lose=(1, 0))
    got, f1 = _decode(tiny_llama, prompt, sp, layerwise=True, lose=(1, 0))
    assert f0 == f1 == 1 and want[-1].finish_reason == "stop"
    assert _stream(got) == _stream(want)


def test_parallel_samples_of_one_prompt_whose_shared_load_fails(tiny_llama, store):
    """n=3 as the server makes it (three requests, one prompt, one transfer, own seeds), all in one LayerBatch; the
    object they all read is gone: each recomputes and streams what it does without a store."""
    from pdserve.kvstore.keys import object_key

    ref = hf_model(tiny_llama)
    prompt = random_prompt(ref.config.vocab_size, 61, seed=40)
    params = _prefill(tiny_llama, store, prompt)
    _lose_after_lookup(store, object_key(params["chunk_keys"][0], 1), lookups=3)
    lw = _engine(tiny_llama, "decode", store, layerwise=True)
    plain = _engine(tiny_llama, "decode", TieredStore(MemoryTier(1 << 20)))
    got, want = {}, {}
    for engine, into in ((lw, got), (plain, want)):
        for i in range(3):
            engine.add_request(f"c{i}", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=i,
                                                                ignore_eos=True), params)
        while engine.has_unfinished():
            for out in engine.step():
                into[out.request_id] = into.get(out.request_id, []) + out.new_token_ids
    assert got == want and lw.connector.loader.failures == 3 and lw.connector.layerwise_batches == 1
    for engine in (lw, plain):
        engine.shutdown()


def test_a_request_reusing_a_rewound_requests_prefix_is_right(tiny_llama, store):
    """a's load fails (its own last chunk) and a recomputes; b shares a's first 48 tokens and comes after: it
    reuses a's prefix-cache blocks, which must hold the recomputed KV, not the failed step's."""
    from pdserve.kvstore.keys import object_key

    ref = hf_model(tiny_llama)
    prefix = random_prompt(ref.config.vocab_size, 48, seed=32)
    a = prefix + random_prompt(ref.config.vocab_size, 13, seed=33)
    b = prefix + random_prompt(ref.config.vocab_size, 11, seed=34)
    pa = _prefill(tiny_llama, store, a, "pa")
    _lose_after_lookup(store, object_key(pa["chunk_keys"][3], 1))
    lw = _engine(tiny_llama, "decode", store, layerwise=True)
    tokens, out = run_request(lw, "a", a, SamplingParams(max_tokens=5, **GREEDY), pa)
    assert tokens == hf_greedy(ref, a, 5) and lw.connector.loader.failures == 1
    tokens, out = run_request(lw, "b", b, SamplingParams(max_tokens=5, **GREEDY))
    assert tokens == hf_greedy(ref, b, 5) and out.num_cached_tokens == 48
    lw.shutdown()


class _RaisingStore:
    """A real store whose reads of layer ``layer`` raise (a store error mid-load) while ``armed``."""

    def __init__(self, store, layer):
        self.store, self.layer, self.armed = store, layer, True

    def __getattr__(self, name):
        return getattr(self.store, name)

    def borrow(self, keys):
        if self.armed and any(k.endswith(f":{self.layer}") for k in keys):
            raise ConnectionError("store read failed")
        return self.store.borrow(keys)


def test_a_store_error_mid_load_recomputes_and_the_engine_keeps_serving(tiny_llama, store):
    ref = hf_model(tiny_llama)
    prompt = random_prompt(ref.config.vocab_size, 61, seed=35)
    params = _prefill(tiny_llama, store, prompt)
    raising = _RaisingStore(store, 1)
    lw = _engine(tiny_llama, "decode", raising, layerwise=True)
    tokens, out = run_request(lw, "d", prompt, SamplingParams(max_tokens=4, **GREEDY), params)
    assert tokens == hf_greedy(ref, prompt, 4) and out.kv_accounting["loaded_tokens"] == 0
    raising.armed = False
    tokens, out = run_request(lw, "d2", prompt, SamplingParams(max_tokens=4, **GREEDY), params)
    assert tokens == hf_greedy(ref, prompt, 4) and out.finish_reason == "length"
    lw.shutdown()


def test_a_wrongly_shaped_object_recomputes(tiny_llama, store):
    """A validly sealed object of the wrong shape under a chunk's key: the shape check fails the load."""
    import torch

    from pdserve.kvstore.auth import process_key
    from pdserve.kvstore.keys import object_key
    from pdserve.kvstore.seal import seal, unseal

    ref = hf_model(tiny_llama)
    prompt = random_prompt(ref.config.vocab_size, 61, seed=36)
    params = _prefill(tiny_llama, store, prompt)
    key, k = object_key(params["chunk_keys"][1], 0), process_key().seal_key
    view, _ = unseal(key, store.get([key])[0], k)
    store.put([(key, seal(key, torch.cat([view, view], dim=1), k)[0])])
    lw = _engine(tiny_llama, "decode", store, layerwise=True)
    tokens, out = run_request(lw, "d", prompt, SamplingParams(max_tokens=4, **GREEDY), params)
    assert tokens == hf_greedy(ref, prompt, 4) and lw.connector.loader.failures == 1
    lw.shutdown()


@pytest.mark.parametrize("where", ["bitmask", "start_layers"])
def test_a_step_that_fails_before_its_loads_start_leaves_none_for_the_next_step(tiny_llama, store, where):
    """The step raises after the schedule queued a layerwise load but before (or while) ``begin_loads`` handed it to
    the loader: the step's requests fail and their blocks are freed. Before the fix the load stayed queued and the
    next step handed it over -- a load of a dead request into blocks that are free or another request's by then
    (and, where ``start_layers`` itself raised, every later step failed the same way)."""
    ref = hf_model(tiny_llama)
    a = random_prompt(ref.config.vocab_size, 61, seed=37)
    b = random_prompt(ref.config.vocab_size, 45, seed=38)
    pa, pb = _prefill(tiny_llama, store, a, "pa"), _prefill(tiny_llama, store, b, "pb")
    lw = _engine(tiny_llama, "decode", store, layerwise=True)
    owner = lw.structured if where == "bitmask" else lw.connector.loader
    real, handed = getattr(owner, where), []

    def once(*args):
        if not handed:
            handed.append(None)
            raise RuntimeError("injected")
        if where == "start_layers":
            handed.append(sorted(j.request_id for j in args[0]))
        return real(*args)

    setattr(owner, where, once)
    _, out = run_request(lw, "a", a, SamplingParams(max_tokens=4, **GREEDY), pa)
    assert out.finish_reason == "abort"
    jobs = []
    real_start = lw.connector.loader.start_layers
    lw.connector.loader.start_layers = lambda js: (jobs.append(sorted(j.request_id for j in js)), real_start(js))[1]
    tokens, out = run_request(lw, "b", b, SamplingParams(max_tokens=4, **GREEDY), pb)
    assert out.finish_reason == "length" and tokens == hf_greedy(ref, b, 4)
    assert jobs == [["b"]]
    lw.shutdown()


def test_a_store_marked_down_by_another_thread_is_not_failed_again(tiny_llama, store):
    """The store answers the lookup, then another thread of the node (the publisher, a chunk-major load) marks it
    down before the layerwise read: the read is refused by the health gate and the load recomputes. Before the fix
    the refusal itself counted as a store failure (``health.failed``): the back-off doubled for a failure that never
    happened, and any probe another thread had in flight was cancelled (its success then ignored)."""
    ref = hf_model(tiny_llama)
    prompt = random_prompt(ref.config.vocab_size, 61, seed=41)
    params = _prefill(tiny_llama, store, prompt)
    lw = _engine(tiny_llama, "decode", store, layerwise=True)
    health, real = lw.connector.health, store.lookup

    def lookup(chunk_keys, num_layers):
        n = real(chunk_keys, num_layers)
        health.failed(ConnectionError("a put of the publisher failed"))
        return n

    store.lookup = lookup
    tokens, out = run_request(lw, "d", prompt, SamplingParams(max_tokens=4, **GREEDY), params)
    assert tokens == hf_greedy(ref, prompt, 4) and out.kv_accounting["loaded_tokens"] == 0
    assert lw.connector.stats()["store_consecutive_failures"] == 1
    lw.shutdown()


def test_a_scatter_that_raises_is_not_a_store_failure(tiny_llama, store, monkeypatch):
    """A scatter into the cache raises (not the store's doing): the batch's loads recompute, the store stays up and
    the next load uses it. Before the fix the error was taken for the store's: marked down, the next request
    found no store hit."""
    import pdserve.decode.layer_reader as layer_reader

    ref = hf_model(tiny_llama)
    prompt = random_prompt(ref.config.vocab_size, 61, seed=42)
    params = _prefill(tiny_llama, store, prompt)
    lw = _engine(tiny_llama, "decode", store, layerwise=True)
    real, calls = layer_reader.scatter_kv, []

    def scatter_once(*args):
        calls.append(None)
        if len(calls) == 1:
            raise RuntimeError("injected scatter failure")
        return real(*args)

    monkeypatch.setattr(layer_reader, "scatter_kv", scatter_once)
    tokens, out = run_request(lw, "d", prompt, SamplingParams(max_tokens=4, **GREEDY), params)
    assert tokens == hf_greedy(ref, prompt, 4) and out.kv_accounting["loaded_tokens"] == 0
    assert lw.connector.stats()["store_down"] == 0
    other = random_prompt(ref.config.vocab_size, 61, seed=43)
    po = _prefill(tiny_llama, store, other, "po")
    tokens, out = run_request(lw, "d2", other, SamplingParams(max_tokens=4, **GREEDY), po)
    assert tokens == hf_greedy(ref, other, 4) and out.kv_accounting["loaded_tokens"] == 56
    lw.shutdown()


class _HeldLayer:
    """A real store whose read of layer ``layer``'s objects does not answer until ``release`` is set (or
    ``deadline_s`` passed): a store that hangs after the lookup. ``done``: that read has returned."""

    def __init__(self, store, layer, deadline_s=10.0):
        import threading

        self.store, self.layer, self.deadline_s = store, layer, deadline_s
        self.release, self.done = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def borrow(self, keys):
        import contextlib

        @contextlib.contextmanager
        def held():
            self.release.wait(self.deadline_s)
            try:
                with self.store.borrow(keys) as objs:
                    yield objs
            finally:
                self.done.set()

        return held() if keys and all(k.endswith(f":{self.layer}") for k in keys) else self.store.borrow(keys)


def test_a_hung_store_read_fails_the_load_not_the_engine(tiny_llama, store):
    """The read of layer 1 hangs (the store answered the lookup, then stopped answering). Before the fix
    ``before(1)`` waited as long as the read did -- every request of the engine stalled with it (a daemon client
    gives up after 30 s; an embedded store never). Now the step waits ``kv_load_layerwise_timeout_s``, the load
    fails (the request recomputes, the step goes on) and the read, when it answers at last, writes nothing: its
    object here holds other (validly sealed) KV, so a late write would change the tokens decoded after it."""
    import time

    from pdserve.kvstore.auth import process_key
    from pdserve.kvstore.keys import object_key
    from pdserve.kvstore.seal import seal, unseal

    ref = hf_model(tiny_llama)
    prompt = random_prompt(ref.config.vocab_size, 61, seed=44)
    params = _prefill(tiny_llama, store, prompt)
    key, k = object_key(params["chunk_keys"][0], 1), process_key().seal_key
    view, _ = unseal(key, store.get([key])[0], k)
    store.put([(key, seal(key, view + 1.0, k)[0])])
    held = _HeldLayer(store, 1)
    lw = _engine(tiny_llama, "decode", held, layerwise=True)
    assert lw.connector.loader.layer_timeout_s == KVTransferConfig().kv_load_layerwise_timeout_s == 10.0
    lw.connector.loader.layer_timeout_s = 0.2
    lw.add_request("d", prompt, SamplingParams(max_tokens=6, **GREEDY), params)
    tokens = [t for o in lw.step() for t in o.new_token_ids]
    assert not held.done.is_set(), "the step waited for the hung read"
    assert lw.connector.stats()["load_layerwise_batches"] == 1 and lw.scheduler.running[0].num_computed_tokens == 0
    tokens += [t for o in lw.step() for t in o.new_token_ids]          # the recompute: its first token
    held.release.set()
    deadline = time.monotonic() + 10.0
    while not held.done.wait(0.05) and time.monotonic() < deadline:
        pass
    final = None
    while lw.has_unfinished():
        for out in lw.step():
            tokens += out.new_token_ids
            final = out if out.finished else final
    assert tokens == hf_greedy(ref, prompt, 6) and final.kv_accounting["loaded_tokens"] == 0
    deadline = time.monotonic() + 10.0                                  # counted once the loader is done with it
    while lw.connector.stats()["load_failures"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lw.connector.stats()["load_failures"] == 1
    lw.shutdown()


def test_prompt_logprobs_of_a_request_beside_a_failed_load(tiny_llama, store):
    """One step: a's layerwise load fails (its result dropped), b computes its prompt logprobs (every row, the
    hooks on): b's prompt logprobs and tokens are those of b alone; a's are the reference's."""
    from pdserve.kvstore.keys import object_key

    ref = hf_model(tiny_llama)
    a = random_prompt(ref.config.vocab_size, 61, seed=45)
    b = random_prompt(ref.config.vocab_size, 30, seed=46)
    pa = _prefill(tiny_llama, store, a, "pa")
    _lose_after_lookup(store, object_key(pa["chunk_keys"][1], 0))
    sp_b = SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY)

    def run(engine, with_a):
        if with_a:
            engine.add_request("a", a, SamplingParams(max_tokens=3, **GREEDY), pa)
        engine.add_request("b", b, sp_b)
        got = {}
        while engine.has_unfinished():
            for out in engine.step():
                toks, lps = got.get(out.request_id, ([], None))
                got[out.request_id] = (toks + out.new_token_ids, out.prompt_logprobs or lps)
        engine.shutdown()
        return got

    both = run(_engine(tiny_llama, "decode", store, layerwise=True), True)
    alone = run(_engine(tiny_llama, "decode", TieredStore(MemoryTier(1 << 20))), False)
    assert both["b"] == alone["b"] and both["b"][1]
    assert both["a"][0] == hf_greedy(ref, a, 3)
