"""``echo`` and ``prompt_logprobs`` over HTTP with the official ``openai`` client, on a node and through the proxy.

One P/D cluster (proxy, prefill node chunking prompts over 8-token steps, KV store daemon, decode node) and one
colocated node whose engine core runs in its own process (the prompt logprobs cross its message channel) serve the
same tiny llama. Every answer is checked for the OpenAI / vLLM shape, against HF transformers' log_softmax, and
node against proxy (field by field, floats to 1e-3): lm-eval-harness's loglikelihood request (echo, max_tokens 0
or 1, logprobs 1, token-id prompts), echo with and without generation, streamed echo, ``prompt_logprobs`` on
completions and chat, chat's echo of the last message, and the 400s for values out of range.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from hf_reference import hf_model
from parity_matrix import differences
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.proxy.cluster import ClusterSpec, LocalCluster

FLAGS = ("--kv-chunk-tokens", "8", "--block-size", "4")
PROMPT = "The quiet engineer politely asked about the server logs in 1999."
PAIRS = [("The quick brown fox", " jumps over the lazy dog"), ("Her younger brother", " crossed the garden")]
ATOL = 2e-4


@pytest.fixture(scope="module")
def served(tiny_llama, node_factory):
    """{"node": client, "proxy": client}."""
    cluster = LocalCluster(str(tiny_llama), ClusterSpec(prefill=1, decode=1, node_flags=FLAGS,
                                                        prefill_flags=("--max-num-batched-tokens", "8")))
    with ThreadPoolExecutor(2) as pool:
        started = pool.submit(cluster.start)
        node = pool.submit(node_factory, tiny_llama, *FLAGS, "--engine-core-process")
        try:
            started.result()
            url = node.result().url
        except BaseException:
            cluster.stop()
            raise
    try:
        yield {name: openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=120)
               for name, u in (("node", url), ("proxy", cluster.url))}
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def ref(tiny_llama):
    """(tokenizer, HF log_softmax of a prompt's ids: row i is token i + 1's distribution)."""
    hf = hf_model(tiny_llama)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]

    return load_tokenizer(tiny_llama), logprobs


def both(served, call) -> dict:
    """``call(client)`` on the node and through the proxy: equal but for ids and timestamps -> the node's, dumped."""
    answers = {name: call(client) for name, client in served.items()}
    dumped = {name: [c.model_dump() for c in a] if isinstance(a, list) else a.model_dump()
              for name, a in answers.items()}
    diffs = differences(dumped["proxy"], dumped["node"])
    assert not diffs, "proxy vs node:\n" + "\n".join(diffs[:20])
    return answers["node"]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_with_logprobs_is_the_prompt_then_the_completion(served, ref, max_tokens):
    tok, hf_logprobs = ref
    out = both(served, lambda c: c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, echo=True,
                                                       logprobs=1, max_tokens=max_tokens, temperature=0.0))
    choice, ids = out.choices[0], tok.encode(PROMPT)
    assert choice.text.startswith(PROMPT) and (max_tokens or choice.text == PROMPT)
    assert out.usage.completion_tokens == max_tokens and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert all(tokn in top and len(top) <= 2 for tokn, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    want = hf_logprobs(ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want.tolist(), abs=ATOL)
    if not max_tokens:
        assert choice.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(served, ref, max_tokens):
    """lm-eval-harness's local-completions loglikelihood: token-id prompts (context + continuation), echo,
    max_tokens 0 or 1, logprobs 1; it sums token_logprobs over the continuation and checks greediness."""
    tok, hf_logprobs = ref
    pairs = [(tok.encode(ctx), tok.encode(ctx + cont)) for ctx, cont in PAIRS]
    out = both(served, lambda c: c.completions.create(
        model=c.models.list().data[0].id, prompt=[full for _, full in pairs], echo=True, max_tokens=max_tokens,
        logprobs=1, temperature=0.0, seed=1234))
    assert [c.index for c in out.choices] == [0, 1]
    for choice, (ctx, full) in zip(out.choices, pairs):
        lp = choice.logprobs
        end = len(lp.token_logprobs) - max_tokens                   # lm-eval drops the generated one: [ctx:-1]
        got, tops = lp.token_logprobs[len(ctx):end], lp.top_logprobs[len(ctx):end]
        rows = hf_logprobs(full)[len(ctx) - 1:]
        targets = torch.tensor(full[len(ctx):])
        assert sum(got) == pytest.approx(rows[torch.arange(len(targets)), targets].sum().item(), abs=1e-3)
        greedy = all(t == max(top.values()) for t, top in zip(got, tops))
        assert greedy == bool((rows.argmax(-1) == targets).all())


def test_prompt_logprobs_completions_and_chat(served, ref):
    tok, hf_logprobs = ref
    out = both(served, lambda c: c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=2,
                                                       temperature=0.0, extra_body={"prompt_logprobs": 2}))
    ids, entries = tok.encode(PROMPT), out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    want = hf_logprobs(ids)
    for i, (token_id, entry) in enumerate(zip(ids[1:], entries[1:])):
        mine = entry[str(token_id)]
        assert mine["logprob"] == pytest.approx(want[i, token_id].item(), abs=ATOL)
        assert mine["rank"] >= 1 and mine["decoded_token"] == tok.decode([token_id])
        assert {1, 2} <= {e["rank"] for e in entry.values()}                  # the token, then the top 2
        assert set(entry) <= {str(token_id), *map(str, want[i].topk(2).indices.tolist())}
    assert out.choices[0].logprobs is None and out.choices[0].text           # a plain completion besides
    chat = both(served, lambda c: c.chat.completions.create(
        model=c.models.list().data[0].id, messages=[{"role": "user", "content": "Hi there"}], max_tokens=2,
        temperature=0.0, extra_body={"prompt_logprobs": 0}))
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens and all(len(e) == 1 for e in plp[1:])


def test_streamed_echo_leads_with_the_prompt(served, ref):
    tok, _ = ref
    chunks = both(served, lambda c: list(c.completions.create(
        model=c.models.list().data[0].id, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, temperature=0.0,
        stream=True)))
    first, n = chunks[0].choices[0], len(tok.encode(PROMPT))
    assert first.text.startswith(PROMPT) and len(first.logprobs.tokens) == n + 1     # the prompt + the first token
    assert first.logprobs.token_logprobs[0] is None
    later = [c.choices[0] for c in chunks[1:]]
    assert later[0].logprobs.text_offset[0] == len(first.text) and not any(c.text.startswith(PROMPT) for c in later)
    only = both(served, lambda c: list(c.completions.create(
        model=c.models.list().data[0].id, prompt=PROMPT, echo=True, max_tokens=0, stream=True)))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in only] == [(PROMPT, "length")]


def test_chat_echo_puts_the_last_message_first(served):
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris is"}]
    out = both(served, lambda c: c.chat.completions.create(
        model=c.models.list().data[0].id, messages=messages, max_tokens=3, temperature=0.0,
        extra_body={"echo": True, "add_generation_prompt": False}))
    assert out.choices[0].message.content.startswith("Paris is") and len(out.choices[0].message.content) > 8
    user_last = both(served, lambda c: c.chat.completions.create(           # the answer's role is not the user's
        model=c.models.list().data[0].id, messages=messages[:1], max_tokens=3, temperature=0.0,
        extra_body={"echo": True}))
    assert not user_last.choices[0].message.content.startswith("What is")
    streamed = both(served, lambda c: list(c.chat.completions.create(
        model=c.models.list().data[0].id, messages=messages, max_tokens=2, temperature=0.0, stream=True,
        extra_body={"echo": True, "add_generation_prompt": False})))
    assert streamed[1].choices[0].delta.content == "Paris is"                # after the role chunk (vLLM's)


@pytest.mark.parametrize("extra, message", [
    ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20], got 21"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20], got -1"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs are not available when stream=true"),
    ({"echo": True, "logprobs": 21}, "logprobs must be in [0, 20], got 21"),
])
def test_bad_values_are_400_on_node_and_proxy(served, extra, message):
    for client in served.values():
        with pytest.raises(openai.BadRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
            client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=2,
                                      extra_body=extra)
