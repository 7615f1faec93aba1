"""The checks a parsed request meets before it costs anything, the same on the node and the proxy.

    vocab = vocab_size(tokenizer, model_vocab_size)       # once, at start-up
    check_request(body, vocab, tools)                     # after pydantic: unsupported fields, tool_choice,
                                                          # vocabulary, choices, the SamplingParams ranges
    check_prompt_chars(chars, max_model_len, per_token)   # before tokenizing (prompt_work calls it)
    check_token_ids(ids, vocab)                           # a prompt given as token ids
    resolve_max_tokens(max_model_len, requested, n)       # after tokenizing

Each raises ``APIError`` (400) whose message names the value and the limit and whose ``param`` names
the field, e.g. ``token id 600 is out of range; the vocabulary has 512 tokens`` (param ``stop_token_ids``).
"""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParamsError
from pdserve.engine.server.errors import APIError, bad_request
from pdserve.engine.server.protocol import MAX_CHOICES
from pdserve.engine.server.tools.config import ToolConfig
from pdserve.engine.server.tools.plan import ToolPlan


def vocab_size(tokenizer, model_vocab_size: int | None) -> int:
    """Ids both the tokenizer can decode and the model's logits have (they differ when the checkpoint
    pads its embedding, or the tokenizer adds tokens the embedding lacks)."""
    size = len(tokenizer)
    return size if model_vocab_size is None else min(size, model_vocab_size)


def check_request(body, vocab_size: int, tools: ToolConfig = ToolConfig()) -> None:
    """``body``: a CompletionRequest or ChatCompletionRequest; ``tools``: the server's tool-call flags."""
    if message := body.unsupported():
        raise bad_request(message)
    ToolPlan.of(body).check(tools)
    check_token_ids(body.stop_token_ids or (), vocab_size, "stop_token_ids")
    check_token_ids(body.logit_bias_ids, vocab_size, "logit_bias")
    choices = body.num_prompts * body.n
    if choices > MAX_CHOICES:
        raise bad_request(f"{body.num_prompts} prompts x n={body.n} is {choices} choices; the limit is {MAX_CHOICES}",
                          "n")
    requested = body.requested_max_tokens
    try:
        body.to_sampling_params(requested if requested is not None else 1, body.engine_logprobs)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def check_token_ids(ids, vocab_size: int, param: str = "prompt") -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range; the vocabulary has {vocab_size} tokens", param)


def check_prompt_chars(num_chars: int, max_model_len: int | None, chars_per_token: int, param: str) -> None:
    """Refuse, before tokenizing, a prompt that cannot fit ``max_model_len`` tokens even if every token
    were the longest one of the vocabulary (``tokenizer.max_chars_per_token``)."""
    if max_model_len is None:
        return
    limit = max_model_len * chars_per_token
    if num_chars > limit:
        raise bad_request(f"prompt has {num_chars} characters; at most {limit} can fit --max-model-len "
                          f"{max_model_len} ({chars_per_token} characters per token at most)", param)


def resolve_max_tokens(max_model_len: int, requested: int | None, num_prompt_tokens: int,
                       param: str = "prompt") -> int:
    """vLLM's rule: unset means 'up to --max-model-len'; a set value must fit, else 400."""
    limit = max_model_len
    if num_prompt_tokens < 1:
        raise bad_request("prompt is empty; send at least one token", param)
    if num_prompt_tokens >= limit:
        raise bad_request(f"prompt has {num_prompt_tokens} tokens; --max-model-len is {limit}", param)
    if requested is None:
        return limit - num_prompt_tokens
    if requested >= 1 and num_prompt_tokens + requested > limit:
        raise bad_request(f"prompt has {num_prompt_tokens} tokens and max_tokens is {requested}: "
                          f"{num_prompt_tokens + requested} > --max-model-len {limit}", "max_tokens")
    return requested
