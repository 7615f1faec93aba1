"""TP x PP engines (driver + worker processes, gloo on CPU) give the tp1pp1 engine's and HF's greedy tokens.

Tiny models with 4 heads / 2 KV heads / 2 layers, so tp 2 splits heads and pp 2 splits layers.
The batch mixes prompt lengths 1 / 17 / 300 under a 48-token budget: prompts are cut across steps
and every step is cut into micro-batches. Every engine is shut down and its ranks reaped.
"""

from __future__ import annotations

import os

import pytest

from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def make_engine(model_dir, tp: int = 1, pp: int = 1, budget: int = 48, **parallel) -> LLMEngine:
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                       parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, **parallel))
    return LLMEngine(cfg)


def run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def shutdown(engine: LLMEngine) -> list[int]:
    """Stop the engine's ranks; -> their pids and the launcher's (all gone)."""
    pids = engine.runner.pids()
    assert len(pids) == engine.config.parallel.world_size + 1
    engine.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return pids


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    vocab = hf_model(tiny_llama).config.vocab_size
    return [random_prompt(vocab, n, seed=n) for n in (1, 17, 300, 5)]


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    ref = hf_model(tiny_llama)
    hf = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    assert run(make_engine(tiny_llama), prompts, GREEDY) == hf
    return hf


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2pp2"])
def layout_engine(request, tiny_llama):
    """One engine per layout, shared by the tests that only read from it."""
    engine = make_engine(tiny_llama, *request.param)
    yield engine
    shutdown(engine)


def test_greedy_equals_tp1pp1_and_hf(layout_engine, prompts, expected):
    engine = layout_engine
    assert run(engine, prompts, GREEDY) == expected
    assert engine.block_manager.num_free_blocks == engine.runtime.num_blocks
    engine.block_manager.check_integrity()


def test_min_tokens_bans_eos_and_stop_ids_as_tp1(layout_engine, tiny_llama, prompts, expected):
    """The ranks see each request's banned ids: eos and stop_token_ids are not sampled before min_tokens.
    The stop ids are the greedy continuation's first tokens, so the ban changes the output."""
    stop = expected[1][:2]
    params = [SamplingParams(max_tokens=6, temperature=0.0, min_tokens=4, stop_token_ids=stop),
              SamplingParams(max_tokens=6, temperature=0.0, min_tokens=1, stop_token_ids=stop)]
    single = run(make_engine(tiny_llama), prompts[1:2] * 2, params)
    assert not set(single[0][:4]) & set(stop) and single[0][:4] != expected[1][:4]
    assert run(layout_engine, prompts[1:2] * 2, params) == single


def test_prompt_logprobs_are_refused_by_name(layout_engine, prompts):
    """The ranks compute the sampled rows' logits only: prompt logprobs are a 400 naming the layout, not wrong."""
    with pytest.raises(ValueError, match=r"not supported on a tensor/pipeline parallel node \(-tp/-pp\)"):
        layout_engine.add_request("plp", prompts[1], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert not layout_engine.has_unfinished()


def test_tied_embeddings_and_qkv_bias_split_over_tp2pp2(tiny_models):
    """qwen2: q/k/v biases (column-parallel) and a tied LM head that lives on the other stage."""
    ref = hf_model(tiny_models["qwen2"])
    prompts = [random_prompt(ref.config.vocab_size, n, seed=50 + n) for n in (9, 70)]
    engine = make_engine(tiny_models["qwen2"], 2, 2)
    try:
        assert run(engine, prompts, GREEDY) == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    finally:
        shutdown(engine)


def test_seeded_sampling_and_penalties_equal_tp1(tiny_llama, prompts):
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)]
    single = run(make_engine(tiny_llama), prompts[1:3], params)
    engine = make_engine(tiny_llama, 2, 1)
    try:
        assert run(engine, prompts[1:3], params) == single
    finally:
        shutdown(engine)


def test_logit_bias_and_output_penalties_equal_tp1(tiny_llama, prompts):
    """A worker rank counts the output ids its step message carries (``StepRequest.outputs``): the same tokens
    as the driver's input-batch counts. The greedy request pushes its first token 1 above its repeat gap, so
    it repeats unless its count is seen; the seeded one's negative penalties reshape every later draw."""
    single = make_engine(tiny_llama)
    prompt = prompts[1]
    first, gap = _repeat_gap(single, prompt)
    push = {first: gap + 1.0}
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=push, frequency_penalty=1.5,
                             presence_penalty=1.0),
              SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, frequency_penalty=-2.0,
                             presence_penalty=-2.0, logit_bias={3: -100.0, 4: 5.0}),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=push)]
    want = run(single, [prompt] * 3, params)
    assert want[2][:2] == [first, first] and want[0][1] != first            # the count decides the second token
    engine = make_engine(tiny_llama, 2, 1)
    try:
        assert run(engine, [prompt] * 3, params) == want
    finally:
        shutdown(engine)


def _repeat_gap(engine: LLMEngine, prompt: list[int]) -> tuple[int, float]:
    """The greedy first token, and how far its raw logprob is below the top one's right after it."""
    [[first]] = run(engine, [prompt], SamplingParams(max_tokens=1, temperature=0.0))
    engine.add_request("gap", prompt + [first], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1,
                                                               logit_bias={first: 100.0}))
    results = []
    while engine.has_unfinished():
        results += [r for out in engine.step() for r in out.logprobs or ()]
    return first, results[0].top_logprobs[0][1] - results[0].logprob


def test_debug_sync_logs_every_rank_phase(tiny_llama, prompts, expected, capfd):
    engine = make_engine(tiny_llama, 2, 1, debug_sync=True)
    try:
        assert run(engine, prompts[:1], GREEDY) == expected[:1]
    finally:
        shutdown(engine)
    err = capfd.readouterr().err
    for rank, coords in ((0, "tp 0, pp 0"), (1, "tp 1, pp 0")):
        assert f"rank {rank} ({coords}) step 1: recv_scheduler_output -> forward" in err
        assert f"rank {rank} ({coords}) step 1: forward -> all_reduce" in err
    assert "rank 0 (tp 0, pp 0) step 1: forward -> all_gather" in err       # the vocab-parallel LM head
    assert "rank 0 (tp 0, pp 0) step 1: forward -> sample" in err


@pytest.mark.parametrize("tp,pp,message", [(4, 1, r"2 KV heads, not divisible by --tensor-parallel-size 4"),
                                           (1, 3, r"2 layers, fewer than --pipeline-parallel-size 3")])
def test_impossible_layouts_fail_before_any_rank_starts(tiny_llama, tp, pp, message):
    with pytest.raises(ValueError, match=message):
        make_engine(tiny_llama, tp, pp)


@pytest.mark.parametrize("kwargs,flag", [({"rank_timeout": 0}, "--rank-timeout"), ({"tensor_parallel_size": 2, "nnodes": 2}, "--master-port"),
                                         ({"node_rank": 1}, "--node-rank"),
                                         ({"tensor_parallel_size": 3, "nnodes": 2, "master_port": 1}, "--nnodes 2")])
def test_parallel_config_names_the_flag(kwargs, flag):
    from pdserve.engine.config import ConfigError

    with pytest.raises(ConfigError, match=flag):
        ParallelConfig(**kwargs)


def test_stage_layers_and_micro_batches():
    from pdserve.engine.parallel.messages import StepRequest
    from pdserve.engine.parallel.messages import micro_batches
    from pdserve.engine.parallel.stage import stage_layers

    assert stage_layers(5, 2) == [(0, 3), (3, 2)]
    assert stage_layers(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    reqs = [StepRequest(str(i), [0] * n, 0, [], False) for i, n in enumerate([5, 1, 1, 1, 30, 2])]
    ids = lambda groups: [[r.request_id for r in g] for g in groups]          # noqa: E731
    assert ids(micro_batches(reqs, 1)) == [["0", "1", "2", "3", "4", "5"]]
    assert ids(micro_batches(reqs, 2)) == [["0", "1", "2", "3"], ["4", "5"]]  # by tokens: 8 | 32
    assert ids(micro_batches(reqs, 3)) == [["0", "1", "2", "3"], ["4"], ["5"]]
    assert ids(micro_batches(reqs[:4], 2)) == [["0"], ["1", "2", "3"]]
    assert ids(micro_batches(reqs[:2], 4)) == [["0"], ["1"]]                  # never an empty micro-batch
