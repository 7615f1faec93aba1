"""Vocabularies that do not divide by the TP size (issue 39): padded vocab-parallel embedding and LM head shards.

Two tiny models with vocab_size 515 (the tokenizer's 512 + 3; odd): at tp 2 the vocabulary pads to 576 rows, 288
a rank, rank 1's last 61 rows zeros. llama has an untied LM head; qwen2 a tied one (and q/k/v biases).

- ``make-tiny-model --vocab-size`` writes such a model (not below the tokenizer's size).
- ``padded_vocab``: V on one rank, else a multiple of lcm(64, tp); each rank loads the checkpoint's rows, then
  zeros (a shard wholly past V: all zeros); a tied head shares the embedding's padded shard, and at tp 2 x pp 2
  the last stage's tied head reads the embedding's rows itself: greedy still equals HF.
- tp 2 against tp 1 (and HF transformers fp32 for greedy), one batch: greedy (a prompt cut across steps by the
  token budget), logprobs / top_logprobs, penalties, a structured choice, logit_bias on the last real id (514),
  and logit_bias -100 on every real id: the padding's logits (0) would then top every row, so an uncut head
  shows up as an id >= 515 in the tokens or the top logprobs. No id >= 515 appears anywhere.
- An id >= 515 in logit_bias is refused at the engine; at the HTTP node (tp 2) whose edge is min(tokenizer, model)
  = 512 ids, logit_bias on 511 works and 512 / 515 are 400s, as before.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import save_file

from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine import LLM
from pdserve.engine.checkpoints.tiny_model import make_tiny_model
from pdserve.engine.models.llama import ShardSizes
from pdserve.engine.models.loader import WeightSource, load_model
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.vocab import padded_vocab, vocab_rows
from pdserve.engine.sampling_params import SamplingParams
from test_parallel_engine import make_engine, run, shutdown

VOCAB = 515
PROMPT_LENS = (1, 17, 70)                     # 70 > the 48-token budget: cut across steps


@pytest.fixture(scope="module", params=[("llama", False), ("qwen2", True)], ids=["untied", "tied"])
def odd_model(request, tmp_path_factory):
    arch, tied = request.param
    path = make_tiny_model(tmp_path_factory.mktemp("odd-vocab") / arch, arch=arch, seed=3, vocab_size=VOCAB,
                           tie_word_embeddings=tied)
    assert ModelConfig.from_dir(path).vocab_size == VOCAB and hf_model(path).config.vocab_size == VOCAB
    return path


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(VOCAB, n, seed=n) for n in PROMPT_LENS]


def test_padded_vocab_sizes():
    assert [padded_vocab(515, tp) for tp in (1, 2, 3, 4, 8)] == [515, 576, 576, 576, 576]
    assert [padded_vocab(v, 2) for v in (1, 64, 101, 128, 32000, 32001)] == [64, 64, 128, 128, 32000, 32064]
    assert padded_vocab(101, 128) == 128 and padded_vocab(129, 128) == 256


def test_make_tiny_model_vocab_size_flag(tmp_path):
    from pdserve.engine.cli import main

    assert main(["make-tiny-model", str(tmp_path / "m"), "--vocab-size", "515"]) == 0
    assert ModelConfig.from_dir(tmp_path / "m").vocab_size == 515
    with pytest.raises(ValueError, match="vocab_size=500 is below the tokenizer's 512 tokens"):
        make_tiny_model(tmp_path / "small", vocab_size=500)


def test_vocab_rows_reads_the_real_rows_then_zeros(tmp_path):
    table = torch.randn(65, 3)
    save_file({"w": table}, str(tmp_path / "model.safetensors"))
    with WeightSource(tmp_path) as src:
        assert torch.equal(vocab_rows(src, "w", 32, 32, 65), table[32:64])
        assert torch.equal(vocab_rows(src, "w", 64, 32, 65), torch.cat([table[64:], torch.zeros(31, 3)]))
        assert torch.equal(vocab_rows(src, "w", 96, 32, 65), torch.zeros(32, 3))     # wholly past the vocabulary


def test_each_rank_holds_the_checkpoint_rows_then_zeros(odd_model):
    config = ModelConfig.from_dir(odd_model)
    assert ShardSizes.for_tp(config, 2).vocab_size == 288
    with WeightSource(odd_model) as src:
        embed = src.get("model.embed_tokens.weight")
        head = embed if config.tie_word_embeddings else src.get("lm_head.weight")
    want_embed, want_head = (torch.cat([t, torch.zeros(576 - VOCAB, t.shape[1])]) for t in (embed, head))
    shards = [load_model(odd_model, tp_rank=r, tp_size=2)[0] for r in range(2)]
    assert torch.equal(torch.cat([m.embed_tokens.weight for m in shards]), want_embed)
    assert torch.equal(torch.cat([m.lm_head.weight for m in shards]), want_head)
    assert [m.embed_tokens.vocab_start for m in shards] == [0, 288]
    if config.tie_word_embeddings:
        assert all(m.lm_head.weight is m.embed_tokens.weight for m in shards)


def _params(last_id: int) -> list[SamplingParams]:
    base = dict(max_tokens=6, ignore_eos=True)
    return [SamplingParams(temperature=0.0, **base),
            SamplingParams(temperature=0.0, logprobs=5, **base),
            SamplingParams(temperature=0.0, logprobs=5, logit_bias={t: -100.0 for t in range(VOCAB)}, **base),
            SamplingParams(temperature=0.0, logprobs=3, logit_bias={last_id: 100.0}, **base),
            SamplingParams(temperature=0.9, seed=11, frequency_penalty=1.5, presence_penalty=0.5,
                           repetition_penalty=1.2, logprobs=2, **base)]


def _run_with_logprobs(engine, prompts, params):
    """-> per request: (token ids, [(id, logprob, top_logprobs)] or None)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    got = {f"r{i}": ([], []) for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend((s.token_id, s.logprob, tuple(s.top_logprobs or ()))
                                          for s in out.logprobs or ())
    return [got[f"r{i}"] for i in range(len(prompts))]


def _ids(result) -> set[int]:
    tokens, samples = result
    return {*tokens, *(t for s in samples for t, _ in s[2])}


def test_tp2_equals_tp1_and_hf_and_never_names_a_padded_id(odd_model, prompts):
    ref = hf_model(odd_model)
    hf = [hf_greedy(ref, p, 6) for p in prompts]
    batch = [prompts[i % len(prompts)] for i in range(5)]
    params = _params(VOCAB - 1)
    single = make_engine(odd_model)
    assert run(single, prompts, params[0]) == hf
    want = _run_with_logprobs(single, batch, params)
    engine = make_engine(odd_model, 2)
    try:
        assert run(engine, prompts, params[0]) == hf
        got = _run_with_logprobs(engine, batch, params)
    finally:
        shutdown(engine)
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want):
        for (gid, glp, gtop), (wid, wlp, wtop) in zip(g[1], w[1]):
            assert gid == wid and [t for t, _ in gtop] == [t for t, _ in wtop]
            assert glp == pytest.approx(wlp, abs=1e-4)
            assert [lp for _, lp in gtop] == pytest.approx([lp for _, lp in wtop], abs=1e-4)
    assert all(max(_ids(r)) < VOCAB for r in got)
    assert got[2][0] == hf[2 % len(prompts)]             # a uniform -100 shift picks what no bias picks
    assert got[3][0] == [VOCAB - 1] * 6                  # the last real id is reachable
    assert all(len(s[2]) == k for r, k in zip(got[1:], (5, 5, 3, 2)) for s in r[1])


def test_tp2_pp2_greedy_equals_hf(odd_model, prompts):
    """The last stage's LM head reads its padded rows itself (tied: the embedding's, which lives on stage 0)."""
    ref = hf_model(odd_model)
    engine = make_engine(odd_model, 2, 2)
    try:
        assert run(engine, prompts, _params(0)[0]) == [hf_greedy(ref, p, 6) for p in prompts]
    finally:
        shutdown(engine)


def test_structured_choice_at_tp2_equals_tp1(odd_model, prompts):
    pytest.importorskip("xgrammar")
    from pdserve.engine.structured.spec import StructuredOutputs

    params = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutputs(choice=("yes", "no way")))
    want = run(make_engine(odd_model), prompts[1:], params)
    engine = make_engine(odd_model, 2)
    try:
        assert run(engine, prompts[1:], params) == want
    finally:
        shutdown(engine)


def test_logit_bias_past_the_vocabulary_is_refused(odd_model, prompts):
    engine = make_engine(odd_model)
    with pytest.raises(ValueError, match=f"logit_bias token id {VOCAB} is out of range; the vocabulary has {VOCAB}"):
        engine.add_request("past", prompts[0], SamplingParams(max_tokens=1, logit_bias={VOCAB: 1.0}))
    assert not engine.has_unfinished()


def test_tp2_node_takes_the_last_id_and_refuses_past_it(node_factory, odd_model, prompts):
    node = node_factory(odd_model, "-tp", "2")
    body = {"prompt": prompts[1], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    ok = httpx.post(node.url + "/v1/completions", json={**body, "logit_bias": {"511": 100}}, timeout=60)
    assert ok.status_code == 200, ok.text
    [single] = LLM(str(odd_model)).generate([prompts[1]], SamplingParams(max_tokens=3, temperature=0.0,
                                                                         ignore_eos=True, logit_bias={511: 100.0}))
    assert single.token_ids == [511] * 3 and ok.json()["choices"][0]["text"] == single.text
    for bad in (512, VOCAB):
        r = httpx.post(node.url + "/v1/completions", json={**body, "logit_bias": {str(bad): 1}}, timeout=60)
        assert r.status_code == 400 and f"token id {bad} is out of range; the vocabulary has 512" in r.text, r.text
