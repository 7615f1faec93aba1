"""``echo`` and ``prompt_logprobs`` in answers, as vLLM writes them.

Called by ``completions.py`` and ``chat.py`` once the engine's outputs are in (the prompt logprobs come with each
choice's first token, ``RequestOutput.prompt_logprobs``: ``PromptLogprob`` of prompt tokens 1..):

    texts = prompt_texts(state, body, prompts)      # completions echo: each prompt's text (None without echo)
    rows = prompt_rows(state, ids, entries, n)      # the legacy logprobs of the prompt tokens (echo with logprobs)
    legacy_logprobs(rows + output_rows(...), 0)     # {tokens, token_logprobs, top_logprobs, text_offset}
    prompt_logprobs_json(state, entries)            # vLLM's list: None, then {id: {logprob, rank, decoded_token}}
    chat_echo(body)                                 # chat echo: the last message's text, or ""

Completions echo the prompt before each choice's text: a text prompt as sent, a token-id prompt decoded. With
``logprobs`` the echoed prompt tokens lead the choice's logprobs, the first one's logprob and top_logprobs null;
a prompt token's top_logprobs are the first ``logprobs + 1`` entries of its ``prompt_logprobs`` dict (the token,
then the most likely ones: vLLM's rule). Logprobs of prompt tokens are clamped at -9999.0 (vLLM's; -inf is not
JSON). Chat echo (vLLM's): the last message's content, when its role is the answer's ("assistant" with
``add_generation_prompt``, else the last message's own), goes before each choice's content.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.outputs import finite_logprob
from pdserve.engine.server.protocol import message_dicts, prompt_list

Row = tuple[str, "float | None", "dict[str, float] | None"]      # token text, its logprob, top_logprobs


def prompt_texts(state, body, prompts: list[list[int]]) -> list[str] | None:
    """The echoed text of each prompt of a completions ``body`` (token ids in ``prompts``); None without echo."""
    if not body.echo:
        return None
    given = prompt_list(body.prompt)
    return [p if isinstance(p, str) else state.engine.tokenizer.decode(ids) for p, ids in zip(given, prompts)]


def _clamp(logprob: float) -> float:
    return finite_logprob(logprob)


def prompt_rows(state, prompt_ids: list[int], entries: list | None, num_top: int | None) -> list[Row]:
    """The legacy logprobs rows of the echoed prompt; ``num_top``: the request's ``logprobs``."""
    rows: list[Row] = [(state.token_text(prompt_ids[0]), None, None)]
    for e in entries or ():
        ranked = {e.token_id: e.logprob, **dict(e.top)}          # the token first, then the most likely (vLLM)
        top = {state.token_text(t): _clamp(lp) for t, lp in list(ranked.items())[:(num_top or 0) + 1]}
        rows.append((state.token_text(e.token_id), _clamp(e.logprob), top))
    return rows


def output_rows(state, results: list) -> list[Row]:
    """Rows of generated tokens (``SampleResult``s): top_logprobs include the chosen token."""
    rows: list[Row] = []
    for r in results:
        text = state.token_text(r.token_id)
        alternatives = {state.token_text(t): _clamp(lp) for t, lp in (r.top_logprobs or [])}
        alternatives.setdefault(text, _clamp(r.logprob))
        rows.append((text, _clamp(r.logprob), alternatives))
    return rows


def legacy_logprobs(rows: list[Row], text_offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists per token, offsets from ``text_offset`` by token text."""
    offsets = []
    for text, _, _ in rows:
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [r[2] for r in rows], "text_offset": offsets}


def prompt_logprobs_json(state, entries: list) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} -- the token itself first, then its top ones (ranks 1..k; the token's own entry takes its
    top rank when it is among them)."""
    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": _clamp(logprob), "rank": rank, "decoded_token": state.token_text(token_id)}

    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        d = {str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
        d.update({str(t): entry(t, lp, rank) for rank, (t, lp) in enumerate(e.top, 1)})
        out.append(d)
    return out


def chat_echo(body) -> str:
    """The text chat ``echo`` puts before each choice's content ("" for none)."""
    if not body.echo:
        return ""
    last = message_dicts(body.messages[-1:])[0]
    role = "assistant" if body.add_generation_prompt else last["role"]
    content = last.get("content")
    return content if last["role"] == role and isinstance(content, str) else ""
