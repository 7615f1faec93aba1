"""--kv-load-layerwise end to end: a real embedded store, the real tiny model, its prefill node's published KV.

The decode engine loads the prompt's leading chunks layer by layer while the tail computes in the same step
(``decode/layerwise.py``). Greedy tokens must equal the HF reference and the chunk-major load; a load that loses an
object, meets a bad seal or a digest mismatch drops that request's step and recomputes (0 failed requests).
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from engine_run import run_request
from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, ConfigError, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.keys import object_key
from pdserve.kvstore.auth import process_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.seal import seal, unseal
from pdserve.kvstore.tiered import TieredStore

GREEDY = dict(temperature=0.0, ignore_eos=True)
CHUNK = 16
KEY = process_key().seal_key          # what engines in this process seal with (an embedded store, no token)


def _engine(model_dir, role, store, layerwise=False):
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=CHUNK,
                                                    kv_load_layerwise=layerwise))
    return LLMEngine(cfg, store=store)


@pytest.fixture()
def store():
    s = TieredStore(MemoryTier(256 << 20))
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_model(tiny_llama)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """A 3-layer tiny llama (a middle layer; layer 1 is not the last, whose rows-only path skips ``__call__``)."""
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("three") / "llama", arch="llama", seed=3, num_layers=3)
    return model, hf_model(model)


def _prefill(tiny_llama, store, prompt, rid="p"):
    engine = _engine(tiny_llama, "prefill", store)
    _, out = run_request(engine, rid, prompt, SamplingParams(max_tokens=1, **GREEDY), {"do_remote_decode": True})
    engine.shutdown()
    return out.kv_transfer_params


def _never_waits_for_kv(engine):
    """Record every step's WAITING_FOR_KV set (a layerwise engine's stays empty)."""
    seen, real = [], engine.scheduler.schedule

    def schedule():
        out = real()
        seen.append(set(engine.scheduler.loading))
        return out

    engine.scheduler.schedule = schedule
    return seen


def _batches(engine):
    """The job count of every LayerBatch the decode engine's loader was handed."""
    loader, sizes = engine.connector.loader, []
    real = loader.start_layers

    def start_layers(jobs):
        sizes.append(sorted(j.request_id for j in jobs))
        return real(jobs)

    loader.start_layers = start_layers
    return sizes


def test_layerwise_equals_chunk_major_and_the_reference(tiny_llama, reference, store):
    """Mutation caught: ``before(i)`` not waiting (the step reads layer i before it is in) -> other tokens; the
    scheduler keeping the request in WAITING_FOR_KV -> ``loading`` is seen non-empty."""
    prompt = random_prompt(reference.config.vocab_size, 61, seed=21)
    params = _prefill(tiny_llama, store, prompt)
    want = hf_greedy(reference, prompt, 8)
    base = _engine(tiny_llama, "decode", store)
    tokens, chunked = run_request(base, "d0", prompt, SamplingParams(max_tokens=8, **GREEDY), params)
    assert tokens == want and chunked.kv_accounting["loaded_tokens"] == 56
    lw = _engine(tiny_llama, "decode", store, layerwise=True)
    waiting, batches = _never_waits_for_kv(lw), _batches(lw)
    tokens, out = run_request(lw, "d1", prompt, SamplingParams(max_tokens=8, **GREEDY), params)
    assert tokens == want
    assert out.kv_accounting == chunked.kv_accounting
    assert batches == [["d1"]] and not any(waiting)
    assert lw.connector.loader.failures == 0
    for engine in (base, lw):
        engine.shutdown()


def _lose_after_lookup(store, chunk_key, layer):
    """The store answers the lookup, then the object of (chunk, layer) is gone (evicted, deleted)."""
    real = store.lookup

    def lookup(chunk_keys, num_layers):
        n = real(chunk_keys, num_layers)
        store.delete([object_key(chunk_key, layer)])
        return n

    store.lookup = lookup


def test_an_object_lost_after_lookup_recomputes_the_request(tiny_llama, reference, store):
    """Mutation caught: a failed layerwise load reported like a good one -> the step's token, sampled on a cache
    without layer 1 of chunk 2, is streamed (other tokens); or the request fails instead of recomputing."""
    prompt = random_prompt(reference.config.vocab_size, 61, seed=22)
    params = _prefill(tiny_llama, store, prompt)
    _lose_after_lookup(store, params["chunk_keys"][2], 1)
    lw = _engine(tiny_llama, "decode", store, layerwise=True)
    tokens, out = run_request(lw, "d", prompt, SamplingParams(max_tokens=8, **GREEDY), params)
    assert tokens == hf_greedy(reference, prompt, 8) and out.finish_reason == "length"
    assert out.kv_accounting["loaded_tokens"] == 0 and out.kv_accounting["local_hit_tokens"] == 0
    assert lw.connector.loader.failures == 1
    lw.shutdown()


def _tamper(store, key):
    obj = store.get([key])[0].clone()
    obj[-1] ^= 0x40                                       # one bit of its KV: the seal fails
    store.put([(key, obj)])


def _reseal_other(store, key):
    """A correctly sealed object holding other KV: only the prefill node's chunk digest can tell."""
    view, _ = unseal(key, store.get([key])[0], KEY)
    store.put([(key, seal(key, view + 1.0, KEY)[0])])


@pytest.mark.parametrize("bad", ["seal", "digest"])
def test_a_bad_object_at_a_middle_layer_recomputes(three_layers, store, bad):
    """A 3-layer model; layer 1 of chunk 0 fails its seal, or is validly sealed but not what the prefill node
    published (its chunk digest, checked once all layers are in). Mutations caught: ``_scatter_layer`` without the
    seal check, or ``_check_digests`` skipped -> wrong tokens; the failed load's step kept -> wrong tokens."""
    model, ref = three_layers
    prompt = random_prompt(ref.config.vocab_size, 40, seed=23)
    params = _prefill(model, store, prompt)
    key = object_key(params["chunk_keys"][0], 1)
    (_tamper if bad == "seal" else _reseal_other)(store, key)
    lw = _engine(model, "decode", store, layerwise=True)
    tokens, out = run_request(lw, "d", prompt, SamplingParams(max_tokens=6, **GREEDY), params)
    assert tokens == hf_greedy(ref, prompt, 6) and out.finish_reason == "length"
    if bad == "seal":
        assert lw.connector.loader.integrity_failures == 1 and store.get([key]) == [None]
    else:
        assert lw.connector.loader.digest_mismatches == 1
    assert out.kv_accounting["loaded_tokens"] == 0
    lw.shutdown()


def test_one_load_fails_and_one_succeeds_in_the_same_step(tiny_llama, reference, store):
    """Two requests, one LayerBatch: a's chunk 1 fails its seal at layer 0 (b's object under a's key), b loads.
    Mutation caught: failing the whole batch -> b's accounting shows 0 loaded; rewinding by position in the
    batch instead of by id -> wrong tokens."""
    a = random_prompt(reference.config.vocab_size, 50, seed=24)
    b = random_prompt(reference.config.vocab_size, 45, seed=25)
    pa, pb = _prefill(tiny_llama, store, a, "pa"), _prefill(tiny_llama, store, b, "pb")
    victim = object_key(pa["chunk_keys"][1], 0)
    store.put([(victim, store.get([object_key(pb["chunk_keys"][1], 0)])[0])])   # b's object under a's key
    lw = _engine(tiny_llama, "decode", store, layerwise=True)
    batches = _batches(lw)
    greedy = SamplingParams(max_tokens=6, **GREEDY)
    lw.add_request("a", a, greedy, pa)
    lw.add_request("b", b, greedy, pb)
    tokens, final = {"a": [], "b": []}, {}
    while lw.has_unfinished():
        for out in lw.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    assert batches == [["a", "b"]]
    assert tokens == {"a": hf_greedy(reference, a, 6), "b": hf_greedy(reference, b, 6)}
    assert final["a"].kv_accounting["loaded_tokens"] == 0 and final["b"].kv_accounting["loaded_tokens"] == 40
    assert {o.finish_reason for o in final.values()} == {"length"}
    assert lw.connector.loader.integrity_failures == 1
    lw.shutdown()


class SlowLayer:
    """A real store whose read of layer ``layer``'s objects starts ``lag_s`` after ``release`` is set (or after
    ``deadline_s``); ``arrived``: when the read returned, ``landed``: when the loader was done with it (scattered).
    The lag outlasts a tiny layer's compute many times over: a step that does not wait for the layer reads it
    before it is there, every time."""

    def __init__(self, store, layer: int, lag_s: float = 0.2, deadline_s: float = 10.0):
        self.store, self.layer, self.lag_s, self.deadline_s = store, layer, lag_s, deadline_s
        self.release, self.arrived, self.landed = threading.Event(), None, None

    def __getattr__(self, name):
        return getattr(self.store, name)

    @contextlib.contextmanager
    def borrow(self, keys):
        slow = keys and all(k.endswith(f":{self.layer}") for k in keys)
        if slow:
            self.release.wait(self.deadline_s)
            time.sleep(self.lag_s)
        with self.store.borrow(keys) as objs:
            self.arrived = time.monotonic() if slow else self.arrived
            yield objs
        self.landed = time.monotonic() if slow else self.landed


def test_layer_zero_computes_before_a_slow_layer_arrives(three_layers, store):
    """The hooks wait per layer: layer 1's read is held until layer 0 of the step has started computing, and
    layer 1 computes only once its KV landed. Mutations caught: ``before(i)`` waiting for the whole load (or the
    request waiting in WAITING_FOR_KV) -> layer 0 starts only after layer 1 arrived (at the 10 s deadline);
    ``before(i)`` not waiting -> layer 1 starts before its KV landed."""
    model, ref = three_layers
    prompt = random_prompt(ref.config.vocab_size, 61, seed=26)
    params = _prefill(model, store, prompt)
    slow = SlowLayer(store, layer=1)
    lw = _engine(model, "decode", slow, layerwise=True)
    starts = {0: [], 1: []}

    def stamp(layer):
        def hook(module, args):
            starts[layer].append(time.monotonic())
            slow.release.set()
        return hook

    handles = [lw.model.layers[i].register_forward_pre_hook(stamp(i)) for i in (0, 1)]
    tokens, _ = run_request(lw, "d", prompt, SamplingParams(max_tokens=4, **GREEDY), params)
    for h in handles:
        h.remove()
    assert tokens == hf_greedy(ref, prompt, 4)
    assert slow.arrived is not None and starts[0][0] < slow.arrived < slow.landed < starts[1][0]
    assert lw.connector.loader.failures == 0
    lw.shutdown()


def test_the_flag_reaches_the_engine_config_and_serve_passes_it_on(tiny_llama):
    from pdserve.engine.cli import build_parser
    from pdserve.engine.node import config_from_args
    from pdserve.proxy.serve import node_flags

    def config(*flags):
        return config_from_args(build_parser().parse_args(["node", "--model", str(tiny_llama), *flags]))

    assert config("--kv-load-layerwise").kv_transfer.kv_load_layerwise
    assert not config().kv_transfer.kv_load_layerwise
    serve = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--kv-load-layerwise"])
    assert "--kv-load-layerwise" in node_flags(serve)
    assert config("--kv-load-layerwise-timeout", "2.5").kv_transfer.kv_load_layerwise_timeout_s == 2.5
    serve = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--kv-load-layerwise-timeout", "3"])
    assert node_flags(serve)[-2:] == ("--kv-load-layerwise-timeout", "3.0")
    for bad in ("0", "-1", "nan", "1e9"):
        with pytest.raises(ConfigError, match=r"--kv-load-layerwise-timeout must be in \(0, 3600\] seconds"):
            config("--kv-load-layerwise-timeout", bad)


def test_layers_are_read_in_as_many_groups_as_the_longest_load_has_chunks():
    """A store read costs a round trip: a 30-layer model loading 4 chunks reads 4 groups of <= 8 layers (not 30
    reads); more chunks than layers: one layer per read."""
    import torch

    from pdserve.decode.layer_reader import _group_size
    from pdserve.decode.layerwise import LayerBatch
    from pdserve.decode.loader import LoadJob

    def batch(*tokens):
        jobs = [LoadJob(f"r{i}", [f"c{j}" for j in range(8)], [256] * 8, torch.arange(n), 0, n)
                for i, n in enumerate(tokens)]
        return LayerBatch(jobs, 30, torch.device("cpu"))

    assert _group_size(30, batch(1024)) == 8 and _group_size(30, batch(256, 1024)) == 8
    assert _group_size(30, batch(200)) == 30 and _group_size(2, batch(1024)) == 1
