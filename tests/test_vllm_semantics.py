"""Sampling, stop and detokenization rules that follow vLLM's (issue 10, items 7-12).

Each test pins one rule on the offline engine (``LLM``) or the detokenizer, against the engine's
own unconstrained greedy run: what min_tokens holds back, which finish_reason a stop string on the
last token gives, that logprobs are the model's raw ones, that the first token keeps its leading
space with a SentencePiece/Metaspace tokenizer, and that a rejected prompt leaves nothing queued.
"""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.core.llm_engine import PromptTooLongError
from pdserve.engine.sampling_params import SamplingParamsError
from pdserve.engine.text.detokenizer import IncrementalDetokenizer

PROMPT = "The old sailor"


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 12, **kw})


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama))


@pytest.fixture(scope="module")
def free(llm):
    """The unconstrained greedy run every test cuts from, and its text after k tokens."""
    texts = {k: llm.generate([PROMPT], greedy(max_tokens=k))[0].text for k in (2, 5, 6, 10)}
    return llm.generate([PROMPT], greedy(max_tokens=20))[0], texts


def _first_occurring_at(text: str, end: int, lo: int) -> str:
    """The shortest substring ending at ``end`` whose first occurrence in ``text`` ends there (>= lo chars)."""
    for n in range(lo, end + 1):
        s = text[end - n:end]
        if s.strip() and text.find(s) == end - n:
            return s
    pytest.skip(f"no stop string ends uniquely at {end} in {text!r}")


def test_min_tokens_holds_back_stop_strings(llm, free):
    out, texts = free
    stop = _first_occurring_at(out.text, len(texts[2]), 1)          # completed by token 2
    [cut] = llm.generate([PROMPT], greedy(max_tokens=20, stop=[stop]))
    assert cut.text == out.text[:len(texts[2]) - len(stop)] and cut.finish_reason == "stop"
    [held] = llm.generate([PROMPT], greedy(max_tokens=20, stop=[stop], min_tokens=10))
    later = out.text.find(stop, len(texts[10]) - len(stop) + 1)     # must end after token 10's text
    assert len(held.token_ids) > 10
    assert held.text == (out.text if later < 0 else out.text[:later])


def test_stop_string_on_the_last_allowed_token_finishes_with_stop(llm, free):
    _, texts = free
    assert len(texts[6]) > len(texts[5]), "token 6 has no text of its own"
    stop = _first_occurring_at(texts[6], len(texts[6]), 1)          # completed by token 6, not before
    [out] = llm.generate([PROMPT], greedy(max_tokens=6, stop=[stop]))
    assert out.finish_reason == "stop" and out.text == texts[6][:-len(stop)]
    assert len(out.token_ids) == 6


def test_stop_token_text_is_left_out_unless_asked(llm, free):
    out, texts = free
    stop_id = out.token_ids[2]
    [early] = llm.generate([PROMPT], greedy(stop_token_ids=[stop_id]))
    assert early.token_ids == out.token_ids[:3] and early.finish_reason == "stop"
    assert early.text == texts[2]
    [kept] = llm.generate([PROMPT], greedy(stop_token_ids=[stop_id], include_stop_str_in_output=True))
    assert kept.text == llm.generate([PROMPT], greedy(max_tokens=3))[0].text


def test_logprobs_are_raw_before_min_tokens_suppression(llm, free):
    out, _ = free
    first = out.token_ids[0]
    [plain] = llm.generate([PROMPT], greedy(max_tokens=2, logprobs=5))
    [held] = llm.generate([PROMPT], greedy(max_tokens=2, logprobs=5, stop_token_ids=[first], min_tokens=1))
    assert held.token_ids[0] != first                               # suppressed ...
    raw = dict(plain.logprobs[0].top_logprobs)
    assert dict(held.logprobs[0].top_logprobs) == pytest.approx(raw)     # ... but reported as the model's
    assert held.logprobs[0].logprob == pytest.approx(raw[held.token_ids[0]])


@pytest.mark.parametrize("stop", [[""], ["ok", ""], ""])
def test_empty_stop_string_is_rejected(stop):
    with pytest.raises(SamplingParamsError, match="non-empty"):
        SamplingParams(stop=stop)


def test_rejected_prompt_leaves_nothing_queued(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64)
    with pytest.raises(PromptTooLongError, match="max-model-len"):
        llm.generate([PROMPT, list(range(3, 80)), PROMPT], greedy(max_tokens=4))
    assert not llm.engine.has_unfinished()
    [out] = llm.generate([PROMPT], greedy(max_tokens=4))
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("bad", [-1, 10**6, 2.0, True, float("nan")])
def test_a_token_id_outside_the_vocabulary_is_rejected_up_front(llm, bad):
    # before, it reached the embedding lookup and failed every request of that step, not this one alone
    vocab = llm.engine.model_config.vocab_size
    message = (f"token id {bad} is out of range; the vocabulary has {vocab} tokens" if type(bad) is int
               else f"token id {bad!r} is not an integer")
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, [5, 6, bad, 7], PROMPT], greedy(max_tokens=4))
    assert not llm.engine.has_unfinished()
    outs = llm.generate([PROMPT, [5, 6, vocab - 1, 7]], greedy(max_tokens=4))
    assert [len(o.token_ids) for o in outs] == [4, 4]


def test_metaspace_first_token_keeps_its_leading_space(tiny_llama_metaspace):
    llm = LLM(str(tiny_llama_metaspace))
    tok = llm.tokenizer
    prompt = tok.encode(PROMPT)
    words = tok.encode(PROMPT + " carefully painted")[len(prompt):]
    assert tok.convert_ids_to_tokens(words[0]).startswith("▁")
    detok = IncrementalDetokenizer.for_request(tok, prompt, SamplingParams())
    assert "".join(detok.add_tokens([t]) for t in words) == " carefully painted"
    stopped = IncrementalDetokenizer.for_request(tok, prompt, SamplingParams(stop=[" carefully"]))
    stopped.add_tokens(words[:1])
    assert stopped.stopped_by == " carefully" and stopped.text == ""
    [out] = llm.generate([prompt], greedy(max_tokens=16))
    full = tok.decode(prompt + out.token_ids, skip_special_tokens=True)
    assert full == tok.decode(prompt, skip_special_tokens=True) + out.text

